"""The child process of ``hotggml.rpc.Server``: ``python -m hotggml.rpc_server ENDPOINT DEVICE N_THREADS``.

Serves the registry device DEVICE (e.g. 'CPU') at ENDPOINT through ``ggml_backend_rpc_start_server`` until it
is killed. With GGML_RPC_DEBUG set in its environment, the server logs each node it computed (patch
rpc-server-node-log) on stderr, which ``Server`` keeps in a file: the server's own record.
"""

from __future__ import annotations

import os
import signal
import sys


def _die_with_parent() -> None:
    """Linux: SIGKILL this server when the process that started it ends (an orphan would serve on forever)."""
    parent = os.environ.get("HOTGGML_RPC_PARENT")
    if not sys.platform.startswith("linux") or not parent:
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # the parent ended before the prctl: nobody is left to serve
        raise SystemExit(1)


def main(argv: list[str]) -> int:
    from hotggml.ffi import backend_proc, ffi, load

    if len(argv) != 3:
        print("usage: python -m hotggml.rpc_server ENDPOINT DEVICE N_THREADS", file=sys.stderr)
        return 2
    endpoint, device, n_threads = argv[0], argv[1], int(argv[2])
    _die_with_parent()
    lib = load()
    dev = lib.ggml_backend_dev_by_name(device.encode())
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if dev == ffi.NULL or reg == ffi.NULL:
        print(f"rpc_server: no device {device!r} or no RPC in this build", file=sys.stderr)
        return 2
    start = backend_proc(reg, "ggml_backend_rpc_start_server", "ggml_backend_rpc_start_server_t")
    devices = ffi.new("ggml_backend_dev_t[1]", [dev])
    sys.stdout.flush()
    start(endpoint.encode(), ffi.NULL, n_threads, 1, devices)  # serves until killed; returns only on failure
    print(f"rpc_server: the server at {endpoint} stopped (could it bind the port?)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
