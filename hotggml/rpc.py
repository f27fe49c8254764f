"""RPC peers from Python: adding a server of another build is a Python error naming both protocol versions.

The fork's op enum differs from upstream's (the training ops are appended), so its RPC protocol has a major of
its own (patch rpc-fork-major: 128 + upstream's, one byte on the wire) and ggml's handshake refuses a stock peer, either way round:
``ggml_backend_rpc_add_server`` returns NULL after logging the server's version. Needs a build with
``GGML_RPC=ON``, which every ``hotggml build`` and the wheel are.
"""

from __future__ import annotations

import re

from hotggml.errors import BackendError, InputError, InputTypeError
from hotggml.ffi import backend_proc, ffi, load

_ENDPOINT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def proto_version() -> str:
    """'major.minor.patch' of the RPC protocol the loaded library speaks."""
    return ffi.string(load().hotggml_rpc_proto_version()).decode()


def add_server(endpoint: str) -> int:
    """Register the RPC server at endpoint ('host:port') and return how many devices it offers.

    Raises InputTypeError / InputError for an endpoint that is not 'host:port', BackendError when this build
    has no RPC, and BackendError naming both versions when the server refuses the handshake (another build:
    stock ggml, or another fork) or cannot be reached.
    """
    if not isinstance(endpoint, str):
        raise InputTypeError(f"endpoint must be a str 'host:port', got {type(endpoint).__name__}")
    if not _ENDPOINT.match(endpoint):
        raise InputError(f"endpoint must be 'host:port', got {endpoint!r}")
    lib = load()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    add = None if reg == ffi.NULL else backend_proc(reg, "ggml_backend_rpc_add_server", "ggml_backend_rpc_add_server_t")
    if add is None:
        raise BackendError("this library was built without RPC (GGML_RPC=OFF): rebuild it with `hotggml build`, "
                           "which turns it on")
    said: list[str] = []

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def collect(level, text, user_data):  # what ggml logs during the handshake (the peer's version)
        said.append(ffi.string(text).decode(errors="replace"))

    lib.ggml_log_set(collect, ffi.NULL)
    try:
        server = add(endpoint.encode())
    finally:
        lib.ggml_log_set(ffi.NULL, ffi.NULL)  # ggml's default logger again
    if server == ffi.NULL:
        peer = next((m.group(1) for line in said if (m := re.search(r"version mismatch: (\d+\.\d+\.\d+)", line))), None)
        why = (f"the server speaks RPC {peer} and this ggml {proto_version()}: a peer of another build (stock ggml, "
               "or another fork) has other op ids" if peer else f"no RPC server answered ({''.join(said).strip()})")
        raise BackendError(f"RPC server {endpoint} refused: {why}")
    return int(lib.ggml_backend_reg_dev_count(server))
