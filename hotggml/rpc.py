"""RPC peers from Python: servers of this build in a child process, their devices as Backends, their record.

The fork's op enum differs from upstream's (the training ops are appended), so its RPC protocol has a major of
its own (patch rpc-fork-major: 128 + upstream's, one byte on the wire) and ggml's handshake refuses a stock peer, either way round:
``ggml_backend_rpc_add_server`` returns NULL after logging the server's version. Needs a build with
``GGML_RPC=ON``, which every ``hotggml build`` and the wheel are.

``Server`` starts ``ggml_backend_rpc_start_server`` for a local device (the CPU) in a child process bound to
127.0.0.1, with GGML_RPC_DEBUG set: the server then logs each node it computed (patch rpc-server-node-log),
and ``Server.computed_ops`` reads that record back. ``connect`` puts a server's devices in ggml's registry,
and ``Backend('RPC[host:port]')`` opens the first of them. A server lost mid-run (killed, or its network)
fails the client's calls (patch rpc-lost-server): ``Graph.compute`` raises ConnectionLostError, never an abort.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from hotggml.errors import BackendError, InputError, InputTypeError, UsageError
from hotggml.ffi import backend_proc, ffi, load

_ENDPOINT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
DEVICE_NAME = re.compile(r"^RPC\[(?P<endpoint>[^\]]+)\]$")  # Backend('RPC[127.0.0.1:50052]')
# a line of the server's record (patch rpc-server-node-log): one per node, after its graph ran
_COMPUTED = re.compile(r"^\[graph_(?:re)?compute\] device: (\d+), computed node (\d+): (\S+)")
_served: dict[str, str] = {}  # endpoint -> the device a Server of this process serves there ('CPU')
# how long ggml-rpc waits for a server's answer to the handshake (patch rpc-hello-timeout; ggml's default is no
# limit: a peer that takes the connection and never answers would block this process, and its later connections,
# for good); the user's own value in the environment wins
HELLO_TIMEOUT_ENV = "GGML_RPC_HELLO_TIMEOUT_MS"
HELLO_TIMEOUT_MS = 30000


def proto_version() -> str:
    """'major.minor.patch' of the RPC protocol the loaded library speaks."""
    return ffi.string(load().hotggml_rpc_proto_version()).decode()


def _check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str):
        raise InputTypeError(f"endpoint must be a str 'host:port', got {type(endpoint).__name__}")
    if not _ENDPOINT.match(endpoint):
        raise InputError(f"endpoint must be 'host:port', got {endpoint!r}")
    port = int(endpoint.rsplit(":", 1)[1])
    if not 1 <= port <= 65535:
        raise InputError(f"endpoint {endpoint!r}: a TCP port is in [1, 65535], got {port}")


def _add(endpoint: str):
    """ggml_backend_rpc_add_server(endpoint): the server's registry entry, or BackendError saying why not."""
    _check_endpoint(endpoint)
    lib = load()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    add = None if reg == ffi.NULL else backend_proc(reg, "ggml_backend_rpc_add_server", "ggml_backend_rpc_add_server_t")
    if add is None:
        raise BackendError("this library was built without RPC (GGML_RPC=OFF): rebuild it with `hotggml build`, "
                           "which turns it on")
    # set once for the process: ggml-rpc shakes hands again whenever it reconnects (a backend, a buffer)
    os.environ.setdefault(HELLO_TIMEOUT_ENV, str(HELLO_TIMEOUT_MS))
    if not re.fullmatch(r"\d{1,9}", os.environ[HELLO_TIMEOUT_ENV]):  # ggml-rpc would wait without limit
        raise InputError(f"{HELLO_TIMEOUT_ENV} = {os.environ[HELLO_TIMEOUT_ENV]!r} is not a number of milliseconds "
                         "(0: no limit)")
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
        late = next((m.group(1) for line in said if (m := re.search(r"sent nothing for GGML_RPC_HELLO_TIMEOUT_MS = (\d+) ms", line))), None)
        unaccepted = next((m.group(1) for line in said
                           if (m := re.search(r"did not accept the connection within GGML_RPC_HELLO_TIMEOUT_MS = (\d+) ms", line))), None)
        why = (f"the server speaks RPC {peer} and this ggml {proto_version()}: a peer of another build (stock ggml, "
               "or another fork) has other op ids" if peer else
               f"it sent nothing for {HELLO_TIMEOUT_ENV} = {late} ms during the handshake: the peer is no RPC "
               "server, or a server busy with another client (it serves one at a time)" if late else
               f"it did not accept the connection within {HELLO_TIMEOUT_ENV} = {unaccepted} ms: the host drops it "
               "(a firewall, a wrong address) or its listener's queue is full" if unaccepted else
               f"no RPC server answered ({''.join(said).strip()})")
        raise BackendError(f"RPC server {endpoint} refused: {why}")
    return server


def add_server(endpoint: str) -> int:
    """Register the RPC server at endpoint ('host:port') and return how many devices it offers.

    Raises InputTypeError / InputError for an endpoint that is not 'host:port', BackendError when this build
    has no RPC, and BackendError naming both versions when the server refuses the handshake (another build:
    stock ggml, or another fork), cannot be reached, does not accept the connection within
    GGML_RPC_HELLO_TIMEOUT_MS milliseconds, or sends nothing for that long during the handshake
    (30000 unless set in the environment; each receive's limit, not the handshake's:
    a peer that is no RPC server, or a server busy with another client, since it serves one at a time);
    InputError when that variable is not a number of milliseconds.
    """
    return int(load().ggml_backend_reg_dev_count(_add(endpoint)))


def connect(endpoint: str) -> list[str]:
    """Add the server at endpoint ('host:port') and put its devices in ggml's device registry (once per process);
    returns their registry names in the server's order (ggml numbers RPC devices RPC0, RPC1, .. across servers).

    Raises what add_server raises (InputTypeError / InputError for a bad endpoint, BackendError for a build
    without RPC, a server of another build or none answering)."""
    lib = load()
    reg = _add(endpoint)
    known = {int(ffi.cast("uintptr_t", lib.ggml_backend_dev_get(i))) for i in range(lib.ggml_backend_dev_count())}
    names = []
    for i in range(lib.ggml_backend_reg_dev_count(reg)):
        dev = lib.ggml_backend_reg_dev_get(reg, i)
        if int(ffi.cast("uintptr_t", dev)) not in known:
            lib.ggml_backend_device_register(dev)
        names.append(ffi.string(lib.ggml_backend_dev_name(dev)).decode())
    return names


def served_device(endpoint: str) -> str | None:
    """The device ('CPU') a Server of this process serves at endpoint, or None for a server started elsewhere
    (the RPC protocol does not say what device is behind a server)."""
    return _served.get(endpoint)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


class Server:
    """A local device served over RPC by a child process (``python -m hotggml.rpc_server``) bound to 127.0.0.1.

    ``Server(device='CPU', n_threads=None)``: the registry device to serve ('CPU'; its thread count, default one
    per core), on a free port; ``endpoint`` is '127.0.0.1:PORT', ``device_name`` 'RPC[127.0.0.1:PORT]' (what
    Backend takes). The child runs this process's library (HOTGGML_LIB_DIR) with GGML_RPC_DEBUG set, and its
    stderr goes to a file: the server's record, one line per node it computed, read by ``computed_ops``.
    Use it as a context manager, or call ``close()`` (kills the child, removes the record); a Server never closed
    is killed when collected or at exit, and on Linux when the thread that started it ends (PR_SET_PDEATHSIG).

    Raises InputTypeError / InputError for a bad device name or thread count, BackendError when the child
    exits or does not listen within ``start_timeout`` seconds (its stderr's tail in the message).
    """

    def __init__(self, device: str = "CPU", n_threads: int | None = None, start_timeout: float = 30.0):
        from hotggml.ffi import library_info

        if not isinstance(device, str) or not device:
            raise InputTypeError(f"device must be a registry device name (str), got {device!r}")
        from hotggml.graph import GGML_MAX_N_THREADS  # graph imports this module lazily: no cycle at load

        if n_threads is not None and (not isinstance(n_threads, (int, np.integer)) or isinstance(n_threads, bool)
                                      or not 1 <= n_threads <= GGML_MAX_N_THREADS):
            # (more than ggml's thread pool holds: the server would die at its first graph)
            raise InputError(f"n_threads must be an int in [1, {GGML_MAX_N_THREADS}], got {n_threads!r}")
        n_threads = None if n_threads is None else int(n_threads)
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float, np.integer, np.floating)) \
                or not start_timeout > 0:
            raise InputError(f"start_timeout must be a positive number of seconds, got {start_timeout!r}")
        lib = load()
        if lib.ggml_backend_dev_by_name(device.encode()) == ffi.NULL:
            raise InputError(f"no device {device!r} in this build's registry to serve")
        self.device = device
        self._dir = tempfile.TemporaryDirectory(prefix="hotggml-rpc-")
        self.record_path = Path(self._dir.name) / "server.log"
        package_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "GGML_RPC_DEBUG": "1", "HOTGGML_LIB_DIR": library_info()["lib_dir"],
               "HOTGGML_RPC_PARENT": str(os.getpid()),
               "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = None
        for _ in range(3):  # a port taken between the probe and the child's bind: another port
            self.endpoint = f"127.0.0.1:{_free_port()}"
            self.device_name = f"RPC[{self.endpoint}]"
            with open(self.record_path, "wb") as record:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "hotggml.rpc_server", self.endpoint, device,
                     str(n_threads or os.cpu_count() or 1)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=record, env=env)
            if self._wait_listening(start_timeout):
                _served[self.endpoint] = device
                # a Server never closed: its child is killed when the Server is collected or this process exits
                self._finalizer = weakref.finalize(self, _kill, self.proc)
                return
        tail = self.record_path.read_text(errors="replace")[-2000:]
        self.close()
        raise BackendError(f"the RPC server child did not start listening: {tail}")

    def _wait_listening(self, timeout: float) -> bool:
        host, port = self.endpoint.split(":")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with socket.socket() as s:
                if s.connect_ex((host, int(port))) == 0:
                    return True
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        return False

    def record(self) -> str:
        """The server's stderr so far (ggml's RPC debug log, the computed nodes among it)."""
        return self.record_path.read_text(errors="replace") if self.record_path.exists() else ""

    def computed_ops(self, since: int = 0) -> list[str]:
        """The op of every node the server computed, in order (ggml_op_desc: 'FLASH_ATTN_TRAIN', 'MUL_MAT', ..),
        from the ``since``-th on (``len(server.computed_ops())`` before a run marks where it starts)."""
        ops = [m.group(3) for line in self.record().splitlines() if (m := _COMPUTED.match(line))]
        return ops[since:]

    def kill(self) -> None:
        """SIGKILL the server (a crash, as a client sees it); the record stays readable until close()."""
        if self.proc is not None:
            _kill(self.proc)

    def close(self) -> None:
        """Kill the server and remove its record (once)."""
        self.kill()
        _served.pop(getattr(self, "endpoint", None), None)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def need_server(server) -> None:
    """UsageError unless server is an open Server (its record is read after a run)."""
    if not isinstance(server, Server):
        raise InputTypeError(f"server must be a hotggml.rpc.Server, got {type(server).__name__}")
    if server._dir is None:
        raise UsageError("this RPC Server is closed")
