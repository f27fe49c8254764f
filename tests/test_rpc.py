"""RPC refuses a peer of another build, both ways round (issue 9, patch rpc-fork-major): a server started with
ggml_backend_rpc_start_server in a subprocess, from this fork's RPC build or from a build of the unpatched pin,
and a client of the other kind. Between two builds of the fork the handshake succeeds (the control).

Issue 23: the smoke set's fused ops through a localhost CPU server (hotggml.rpc.Server), proven by the result
and the server's own record of the nodes it computed (patch rpc-server-node-log); a server killed mid-compute
gives the client ConnectionLostError, and the client lives on (patch rpc-lost-server)."""

from __future__ import annotations

import json
import os
import re
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


# -- issue 23: the fused ops through a localhost RPC server, and a server killed mid-compute -------------------

def _env(fork_lib: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), "HOTGGML_LIB_DIR": str(fork_lib)}


def test_parity_smoke_through_a_localhost_rpc_server(fork_lib, tmp_path):
    """`parity --backend rpc` starts a CPU server of this build on 127.0.0.1, runs the smoke set through it and
    checks the server's own record (patch rpc-server-node-log): each fused run's two nodes computed there."""
    out = tmp_path / "rpc.json"
    run = subprocess.run([sys.executable, "-m", "hotggml", "parity", "--backend", "rpc", "--set", "smoke",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, env=_env(fork_lib))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^\d+ passed, 0 failed$", run.stdout, re.M), run.stdout[-2000:]
    records = json.loads(out.read_text())
    assert records
    for r in records:
        assert r["backend"].startswith("RPC[127.0.0.1:") and r["kernel"] == "f32-cpu", r
        assert r["checks"]["fused_nodes_in_server_record"] and r["checks"]["fused_nodes_on_backend"], r
        assert r["checks"]["bitwise_across_runs"] and r["passed"], r
        assert r["chain_bar"] == 1e-4  # a CPU behind RPC: the CPU's chain bar, not the TF32 one
        assert set(r["placement"].values()) == {"RPC0"}
    m = re.search(r"RPC server record: (\d+) nodes computed, (\d+) FLASH_ATTN_TRAIN, (\d+) FLASH_ATTN_TRAIN_BACK",
                  run.stdout)
    assert m and int(m.group(2)) == int(m.group(3)) == 2 * len(records), run.stdout[-2000:]  # two fused runs a case


# A graph of 32 products of 2048 x 2048 matrices on a one-thread server (8 of them took 1.6 s on an idle 2-core
# machine), killed 0.5 s into compute(); the server's record (nodes logged once their graph ran) stays empty
KILLED = r'''
import threading, time
import numpy as np
from hotggml import rpc
from hotggml.errors import ConnectionLostError
from hotggml.graph import Backend, Graph

N = 2048
with rpc.Server("CPU", n_threads=1) as server:
    be = Backend(server.device_name)
    g = Graph(be)
    rng = np.random.default_rng(0)
    a = g.input(rng.standard_normal((N, N), dtype=np.float32) / np.float32(np.sqrt(N)))  # |x| ~ 1
    x = g.input(rng.standard_normal((N, N), dtype=np.float32))
    for _ in range(32):
        x = g.mul_mat(a, x)
    g.build([x])
    killed = []

    def kill():
        time.sleep(0.5)
        killed.append(time.monotonic())  # before the signal: the client may see the loss before kill() returns
        server.kill()

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        g.compute()
        print("computed", flush=True)
        g.read(x)  # the graph is in flight: before the patch, get_tensor aborts here when the server dies
        print("read", flush=True)
    except ConnectionLostError as exc:
        raised = time.monotonic()
        print(f"raised {type(exc).__name__}: {exc}", flush=True)
    killer.join()
    print(f"seconds after the kill {raised - killed[0]:.3f}", flush=True)
    print("computed nodes in the record", len(server.computed_ops()), flush=True)
    t0 = time.monotonic()
    try:
        g.compute()  # the connection stays failed: at once, never a hang
    except ConnectionLostError:
        print(f"again raised in {time.monotonic() - t0:.3f}", flush=True)
    g.close()  # frees the buffers on the lost server: no abort
    be.close()
print("closed", flush=True)
'''


def test_a_server_killed_mid_compute_raises_in_the_client_which_lives_on(fork_lib):
    """Issue 23 item 2 (patch rpc-lost-server): SIGKILL of the server while it computes a graph gives
    ConnectionLostError from Graph.compute within 10 s; closing the Graph and Backend afterwards does not abort;
    the interpreter exits 0. Before the patch the client aborted (SIGABRT) in get_tensor."""
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=120,
                         env=_env(fork_lib))
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    out = run.stdout
    assert "raised ConnectionLostError: graph compute failed on RPC" in out and "did not compute the graph" in out, out
    assert "computed\n" not in out and "read\n" not in out, out
    assert float(re.search(r"seconds after the kill ([\d.]+)", out).group(1)) < 10, out
    assert "computed nodes in the record 0" in out, out  # killed before the server finished the graph: mid-compute
    assert float(re.search(r"again raised in ([\d.]+)", out).group(1)) < 1, out
    assert out.rstrip().endswith("closed"), out
    assert "graph not computed by the RPC server" in run.stderr, run.stderr[-2000:]  # ggml-rpc's own word
    assert time.monotonic() - t0 < 60


def test_backend_names_an_rpc_server_by_endpoint(fork_lib):
    """Backend('RPC[host:port]') opens the server's first device; no server there, or a malformed name, is a
    clear error before any graph."""
    run = subprocess.run([sys.executable, "-c", (
        "from hotggml import rpc\nfrom hotggml.graph import Backend\n"
        "from hotggml.errors import BackendError, InputError\n"
        "for name in ('RPC[127.0.0.1:1]', 'RPC[nothing]', 'RPC[127.0.0.1:1', 'RPC[127.0.0.1:99999]'):\n"
        "    try:\n        Backend(name)\n    except (BackendError, InputError) as e:\n"
        "        print(type(e).__name__, e)\n"
        "with rpc.Server('CPU', n_threads=1) as s, Backend(s.device_name) as be:\n"
        "    print('opened', be.device_name, be.endpoint == s.endpoint, be.remote)\n")],
        capture_output=True, text=True, timeout=120, env=_env(fork_lib))
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("BackendError RPC server 127.0.0.1:1 refused: no RPC server answered"), lines
    assert lines[1].startswith("InputError endpoint must be 'host:port'"), lines
    assert lines[2].startswith("InputError an RPC device is named 'RPC[host:port]'"), lines
    assert lines[3].startswith("InputError endpoint '127.0.0.1:99999': a TCP port is in [1, 65535]"), lines
    assert lines[4] == "opened RPC0 True CPU", lines


SILENT = r'''
import os, socket, threading, time
from hotggml import rpc
from hotggml.errors import BackendError
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(4)  # takes connections, never answers
t0 = time.monotonic()
try:
    rpc.add_server(f"127.0.0.1:{listener.getsockname()[1]}")
except BackendError as e:
    print(f"refused after {time.monotonic() - t0:.1f} s:", e)
closer = socket.socket(); closer.bind(("127.0.0.1", 0)); closer.listen(4)  # takes a connection and closes it
threading.Thread(target=lambda: closer.accept()[0].close(), daemon=True).start()
try:
    rpc.add_server(f"127.0.0.1:{closer.getsockname()[1]}")
except BackendError as e:
    print("closed:", e)
full = socket.socket(); full.bind(("127.0.0.1", 0)); full.listen(0)  # never accepts: its queue fills
waiting = socket.create_connection(full.getsockname())  # the one connection the queue holds; later SYNs are dropped
t0 = time.monotonic()
try:
    rpc.add_server(f"127.0.0.1:{full.getsockname()[1]}")
except BackendError as e:
    print(f"unaccepted after {time.monotonic() - t0:.1f} s:", e)
with rpc.Server("CPU", n_threads=1) as s:  # the process connects again: nothing was left blocked
    print("devices", rpc.add_server(s.endpoint))
'''


def test_a_peer_that_never_answers_the_handshake_is_refused_in_time(fork_lib):
    """Patch rpc-hello-timeout: a listener that takes the connection and never answers, and one that never
    accepts it, are refused within
    GGML_RPC_HELLO_TIMEOUT_MS, named, and the process connects to a real server afterwards (before the patch the
    client blocked forever, holding ggml-rpc's connection lock). Without the variable, hotggml sets 30 s."""
    run = subprocess.run([sys.executable, "-c", SILENT], capture_output=True, text=True, timeout=120,
                         env={**_env(fork_lib), "GGML_RPC_HELLO_TIMEOUT_MS": "500"})
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    out = run.stdout
    refused, closed = out[:out.index("\nclosed: ")], out[out.index("\nclosed: "):out.index("\nunaccepted ")]
    unaccepted = out[out.index("\nunaccepted "):out.index("\ndevices ")]
    devices = out.splitlines()[-1]
    assert "refused: it sent nothing for GGML_RPC_HELLO_TIMEOUT_MS = 500 ms during the handshake" in refused, refused
    assert "refused: no RPC server answered" in closed and "sent nothing" not in closed, closed  # not a timeout
    assert float(re.search(r"refused after ([\d.]+) s", refused).group(1)) < 10, refused
    # a host that drops the connection request held the caller for the system's SYN retries (minutes)
    assert "refused: it did not accept the connection within GGML_RPC_HELLO_TIMEOUT_MS = 500 ms" in unaccepted, out
    assert float(re.search(r"unaccepted after ([\d.]+) s", unaccepted).group(1)) < 10, unaccepted
    assert devices == "devices 1", run.stdout
    env = {k: v for k, v in _env(fork_lib).items() if k != "GGML_RPC_HELLO_TIMEOUT_MS"}
    run = subprocess.run([sys.executable, "-c", (
        "import os\nfrom hotggml import rpc\nfrom hotggml.errors import BackendError\n"
        "try:\n    rpc.add_server('127.0.0.1:1')\nexcept BackendError:\n    pass\n"
        "print(os.environ['GGML_RPC_HELLO_TIMEOUT_MS'])\n")], capture_output=True, text=True, timeout=120, env=env)
    assert run.stdout.strip() == "30000", run.stdout + run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", (
        "from hotggml import rpc\nfrom hotggml.errors import InputError\n"
        "try:\n    rpc.add_server('127.0.0.1:1')\nexcept InputError as e:\n    print(e)\n")],
        capture_output=True, text=True, timeout=120, env={**env, "GGML_RPC_HELLO_TIMEOUT_MS": "30 s"})
    assert "GGML_RPC_HELLO_TIMEOUT_MS = '30 s' is not a number of milliseconds" in run.stdout, run.stdout + run.stderr


ZEROED = r'''
import numpy as np
from hotggml import rpc
from hotggml.graph import Backend, Graph
from hotggml.opt import AdamW, Optimizer

rng = np.random.default_rng(7)
x0, w0, y0 = (rng.standard_normal(s).astype(np.float32) for s in ((5, 8), (3, 8), (5, 3)))

def train(be):
    with Graph(be) as g:
        x = g.input(x0); w = g.param(w0)
        with Optimizer(g, x, g.mul_mat(w, x), loss="mse", adamw=AdamW(alpha=1e-1), opt_period=2) as opt:
            losses = [opt.step(x0, y0) for _ in range(4)]
            return losses, opt.read(w)

xb = rng.standard_normal((700, 600)).astype(np.float32)  # 1.6 MiB: the RPC memset's fill goes in 1 MiB chunks

def poisoned(be, scheduled=False):
    with Graph(be, scheduled=scheduled) as g:
        x = g.param(xb); y = g.mul(x, x); s = g.sum(y)
        g.build([y], s); g.compute(poison=[y]); return g.read(y).reshape(xb.shape), g.grad(x).reshape(xb.shape)

with rpc.Server("CPU", n_threads=1) as server:
    be = Backend(server.device_name); cpu = Backend("CPU")
    (l_rpc, w_rpc), (l_cpu, w_cpu) = train(be), train(cpu)
    print("trained", np.array_equal(w_rpc, w_cpu), l_rpc == l_cpu, bool(np.abs(w_rpc - w0).max() > 1e-3))
    (y_rpc, g_rpc), (y_cpu, g_cpu) = poisoned(be), poisoned(cpu)
    print("poisoned", np.array_equal(y_rpc, xb * xb), np.array_equal(g_rpc, 2 * xb), np.array_equal(g_rpc, g_cpu))
    with Graph(be) as g:  # a partial memset at an offset, over more than one chunk, read back byte for byte
        x = g.input(xb); g.build([g.add(x, x)]); g.compute()
        g.lib.ggml_backend_tensor_memset(x.ptr, 0x3F, 4000, 3 << 19)
        want = xb.copy().reshape(-1).view(np.uint8); want[4000:4000 + (3 << 19)] = 0x3F
        print("memset", np.array_equal(g.read(x).reshape(-1).view(np.uint8), want))
    meta = Backend.meta([be.device_name, "CPU"])
    print("meta poisoned", [np.array_equal(a, b) for a, b in zip(poisoned(meta, True), (xb * xb, 2 * xb))])
'''


def test_an_optimizer_and_poison_through_rpc_match_the_cpu(fork_lib):
    """Patch rpc-memset-tensor: ggml_opt_init zeroes the gradients with ggml_set_zero, which asserted on an RPC
    buffer (no memset_tensor: the process aborted), as did compute(poison=) on a meta device over an RPC one.
    Now: four AdamW micro-batches (opt_period 2) through a localhost server give the CPU's weights and losses
    bit for bit, the weights moved; poisoned nodes are recomputed, on RPC and on a meta device over RPC + CPU; a
    memset of 1.5 MiB at an offset (two fill chunks) reads back byte for byte."""
    run = subprocess.run([sys.executable, "-c", ZEROED], capture_output=True, text=True, timeout=180,
                         env=_env(fork_lib))
    assert run.returncode == 0, f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.splitlines() == ["trained True True True", "poisoned True True True", "memset True",
                                       "meta poisoned [True, True]"], run.stdout


DEAD = r'''
import sys, time
import numpy as np
from hotggml import rpc
from hotggml.errors import ConnectionLostError
from hotggml.graph import Backend, Graph
from hotggml.opt import Optimizer
def lost(what, fn):
    try:
        out = fn()
    except ConnectionLostError as e:
        print(what, "lost:", e)
    else:
        print(what, "gave", out)
def model(be):
    g = Graph(be); x = g.input(np.zeros((4, 3), np.float32)); w = g.param(np.full((2, 3), .1, np.float32))
    return g, x, w, g.mul_mat(w, x)
def killed(s):
    s.kill(); time.sleep(0.2)
data = (np.ones((4, 3), np.float32), np.ones((4, 2), np.float32))
s = rpc.Server("CPU", n_threads=1); be = Backend(s.device_name); g, x, w, y = model(be)
killed(s); lost("build", lambda: g.build([y]))
s = rpc.Server("CPU", n_threads=1); be = Backend(s.device_name); killed(s)
gs = Graph(be, scheduled=True); xs = gs.input(np.ones(3, np.float32)); lost("scheduled", lambda: gs.build([gs.cont(xs)]))
s = rpc.Server("CPU", n_threads=1); be = Backend(s.device_name); g, x, w, y = model(be); killed(s)
lost("optimizer", lambda: Optimizer(g, x, y, loss="mse"))
s = rpc.Server("CPU", n_threads=1); be = Backend(s.device_name); g, x, w, y = model(be)
opt = Optimizer(g, x, y, loss="mse"); print("first step", opt.step(*data)); killed(s)
lost("step", lambda: opt.step(*data)); lost("opt read", lambda: opt.read(w))
s = rpc.Server("CPU", n_threads=1); be = Backend(s.device_name); g, x, w, y = model(be); g.build([y]); g.compute()
killed(s); lost("read", lambda: g.read(y))
s = rpc.Server("CPU", n_threads=1); ep = s.endpoint; Backend(s.device_name).close(); killed(s)
def reopened(ep):
    g, x, w, y = model(Backend(f"RPC[{ep}]"))  # it opens: ggml keeps the endpoint's buffer type, asks nothing
    g.build([y])
lost("reopen", lambda: reopened(ep))
'''


def test_a_server_that_died_is_connection_lost_at_every_call(fork_lib):
    """After the server died: build() of a Graph whose Backend never allocated (GGML_ASSERT(buft): ggml-rpc makes
    the buffer type at its first use, NULL without a server), a scheduled Graph (ggml_backend_sched_new's assert),
    an Optimizer (its leaves), a step (ggml_opt_eval gives no status: the loss and weights were NaN), read()
    (NaN bytes) and a graph of a Backend reopened on the endpoint all raise ConnectionLostError."""
    run = subprocess.run([sys.executable, "-c", DEAD], capture_output=True, text=True, timeout=120, env=_env(fork_lib))
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    said = dict(line.split(" ", 1) for line in run.stdout.splitlines() if not line.startswith(("first step", "opt read")))
    assert set(said) == {"build", "scheduled", "optimizer", "step", "read", "reopen"}, run.stdout
    assert all(v.startswith("lost: ") and "RPC server at 127.0.0.1:" in v for v in said.values()), run.stdout
    assert "opt read lost: " in run.stdout, run.stdout
    assert abs(float(re.search(r"first step ([\d.]+)", run.stdout).group(1)) - 0.49) < 1e-6, run.stdout  # it trained


SHARED = r'''
import threading, time
import numpy as np
from hotggml import rpc
from hotggml.graph import Backend, Graph
with rpc.Server("CPU", n_threads=2) as server:
    big = Graph(Backend(server.device_name))
    x = big.input(np.random.default_rng(0).random((512, 512)).astype(np.float32) / 512)
    y = x
    for _ in range(24):
        y = big.mul_mat(x, y)
    big.build([y]); big.compute()
    errors = []
    def computes():
        try:
            for _ in range(3):
                big.compute()
        except Exception as e:
            errors.append(repr(e))
    th = threading.Thread(target=computes); th.start(); time.sleep(0.05)
    small = Graph(Backend(server.device_name))  # a second Backend of the endpoint: the same connection
    a = small.input(np.arange(6, dtype=np.float32)); b = small.add(a, a)
    small.build([b])
    for _ in range(20):
        small.compute(); assert (small.read(b) == 2 * np.arange(6)).all()
    th.join()
    big.compute()
    print("errors", errors)
'''


def test_two_backends_of_one_endpoint_in_two_threads(fork_lib):
    """ggml-rpc sends every Backend's commands to a server over one connection: a graph on a second Backend of
    the endpoint, computed while another thread computed on the first, interleaved their messages (the
    connection failed, every buffer on it lost). The Backends of an endpoint share one lock."""
    run = subprocess.run([sys.executable, "-c", SHARED], capture_output=True, text=True, timeout=300, env=_env(fork_lib))
    assert run.returncode == 0 and run.stdout.strip().endswith("errors []"), run.stdout + run.stderr[-2000:]
