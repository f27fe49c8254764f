"""RPC refuses a peer of another build, both ways round (issue 9, patch rpc-fork-major): a server started with
ggml_backend_rpc_start_server in a subprocess, from this fork's RPC build or from a build of the unpatched pin,
and a client of the other kind. Between two builds of the fork the handshake succeeds (the control)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotggml import build, paths

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ctypes server on Linux .so files")

# argv: the endpoint, then the library files in load order (base, cpu, rpc, ggml)
SERVER = r'''
import ctypes, sys
from pathlib import Path
endpoint = sys.argv[1].encode()
libs = {Path(f).name: ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL) for f in sys.argv[2:]}
ggml, rpc = libs["libggml.so"], libs["libggml-rpc.so"]
ggml.ggml_backend_dev_by_name.restype = ctypes.c_void_p
ggml.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
devices = (ctypes.c_void_p * 1)(ggml.ggml_backend_dev_by_name(b"CPU"))
rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                              ctypes.POINTER(ctypes.c_void_p)]
rpc.ggml_backend_rpc_start_server(endpoint, None, 1, 1, devices)  # serves until killed
'''

STOCK_CLIENT = r'''
import ctypes, sys
from pathlib import Path
endpoint = sys.argv[1].encode()
libs = {Path(f).name: ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL) for f in sys.argv[2:]}
rpc = libs["libggml-rpc.so"]
rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
print("refused" if rpc.ggml_backend_rpc_add_server(endpoint) is None else "accepted")
'''


LOAD_ORDER = ("libggml-base.so", "libggml-cpu.so", "libggml-rpc.so", "libggml.so")


def _libraries(root: Path) -> list[str]:
    """The libraries of a build under root, in load order (a stock build keeps them in src/ and src/ggml-rpc/)."""
    found = []
    for name in LOAD_ORDER:
        hits = sorted(root.rglob(name))
        assert hits, f"no {name} under {root}"
        found.append(str(hits[0]))
    return found


@pytest.fixture(scope="module")
def fork_lib() -> Path:
    return build.build("cpu").lib_dir  # every build has RPC


@pytest.fixture(scope="module")
def stock_libs() -> list[str]:
    return _libraries(build.build_stock("cpu", tests=False).ctest_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, libraries: list[str]):
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, self.endpoint, *libraries],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        host, port = self.endpoint.split(":")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            with socket.socket() as s:
                if s.connect_ex((host, int(port))) == 0:
                    return
            time.sleep(0.05)
        raise AssertionError("the RPC server did not start listening")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def _fork_client(fork_lib: Path, endpoint: str) -> subprocess.CompletedProcess:
    code = ("from hotggml import rpc\nfrom hotggml.errors import BackendError\n"
            f"print('version', rpc.proto_version())\n"
            f"try:\n    print('devices', rpc.add_server({endpoint!r}))\n"
            "except BackendError as e:\n    print('refused:', e)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), "HOTGGML_LIB_DIR": str(fork_lib)})


def test_two_builds_of_the_fork_shake_hands(fork_lib):
    with _Server(_libraries(fork_lib)) as server:
        run = _fork_client(fork_lib, server.endpoint)
    assert "version 132." in run.stdout and "devices 1" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.slow  # builds the stock pin with RPC
def test_a_fork_client_refuses_a_stock_server_naming_both_versions(fork_lib, stock_libs):
    with _Server(stock_libs) as server:
        run = _fork_client(fork_lib, server.endpoint)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: RPC server" in run.stdout and "the server speaks RPC 4." in run.stdout, run.stdout
    assert "and this ggml 132." in run.stdout


@pytest.mark.slow  # builds the stock pin with RPC
def test_a_stock_client_refuses_a_fork_server(fork_lib, stock_libs):
    with _Server(_libraries(fork_lib)) as server:
        run = subprocess.run([sys.executable, "-c", STOCK_CLIENT, server.endpoint, *stock_libs],
                             capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "refused", run.stdout + run.stderr[-2000:]
    assert "version mismatch: 132." in run.stderr
