"""Misuses of the binding that used to kill the interpreter (SIGSEGV / SIGABRT) or return memory the
allocator reused: each runs in a subprocess (a regression would take pytest down with it otherwise) and
must raise a Python exception naming the problem, after which the interpreter carries on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hotggml import paths

PRELUDE = """
import numpy as np
from hotggml import ops
from hotggml.graph import Backend, Graph
be = Backend("CPU")
def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{type(e).__name__}: {e}"
        print("raised", type(e).__name__)
    else:
        raise SystemExit("no exception")
"""


def _run(body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('alive')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), **(env or {})})


CASES = {
    "tensor after close": """
        g = Graph(be); q = g.input(np.zeros((1, 1, 4, 8), np.float32)); k = g.input(np.zeros((1, 1, 4, 8), np.float32))
        fwd = ops.flash_attn_train(g, q, k, k, None, 0.5); g.close()
        expect(RuntimeError, "Graph is closed", lambda: q.ne)
        expect(RuntimeError, "Graph is closed", lambda: ops.get_o(fwd))
        expect(RuntimeError, "Graph is closed", lambda: g.input(np.zeros(3, np.float32)))
        expect(RuntimeError, "Graph is closed", lambda: be.supports_op(fwd))
    """,
    "loss without params": """
        g = Graph(be); x = g.input(np.ones((2, 3), np.float32))
        expect(ValueError, "at least one param()", lambda: g.build([x], g.sum(x)))
        p = g.param(np.ones((2, 3), np.float32))  # refused before anything was built: still usable
        g.build([p], g.sum(p)); g.compute()
        assert (g.grad(p) == 1).all()
    """,
    "read of a tensor that is not kept": """
        g = Graph(be); x = g.param(np.arange(6, dtype=np.float32).reshape(2, 3))
        y = g.mul(x, x); z = g.sum(y)
        g.build([z], z); g.compute()
        expect(ValueError, "not an input, a parameter, an output or a gradient", lambda: g.read(y))
        assert float(g.read(z).ravel()[0]) == 55.0 and g.read(x).shape[-2:] == (2, 3)
    """,
    "backend closed under a graph": """
        g = Graph(be); x = g.param(np.ones(3, np.float32)); g.build([x], g.sum(x))
        be.close()
        expect(RuntimeError, "backend CPU is closed", g.compute)
    """,
    "grad of another graph's tensor": """
        g1 = Graph(be); x = g1.param(np.ones(3, np.float32)); g1.build([x], g1.sum(x)); g1.compute()
        g2 = Graph(be); y = g2.param(np.ones(3, np.float32)); g2.build([y], g2.sum(y)); g2.compute()
        expect(TypeError, "another Graph", lambda: g2.grad(x))
    """,
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_and_the_interpreter_survives(lib, name):
    run = _run(CASES[name])
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-2000:]}"
    assert run.stdout.strip().endswith("alive") and "raised" in run.stdout


def test_lib_dir_that_does_not_hold_the_library_is_an_error(lib, tmp_path):
    run = _run("", env={"HOTGGML_LIB_DIR": str(tmp_path / "nowhere")})
    assert run.returncode != 0 and "alive" not in run.stdout
    assert f"HOTGGML_LIB_DIR={tmp_path / 'nowhere'} holds no libggml" in run.stderr



def test_graphs_and_backends_never_closed_are_freed_when_collected(lib):
    """A Graph or Backend that is never closed is freed when the collector takes it (each Graph holds
    ~20 MiB of ggml context: leaked, a loop of graphs grew the process by that much per graph)."""
    import gc

    import numpy as np

    from hotggml.graph import Backend, Graph

    def unclosed_graph(be):
        g = Graph(be)
        x = g.param(np.ones((64, 64), np.float32))
        g.build([x], g.sum(x))
        g.compute()
        return g._finalizer, g._native

    be = Backend("CPU")
    made = [unclosed_graph(be) for _ in range(20)]
    backends = [Backend("CPU")._finalizer for _ in range(5)]
    gc.collect()
    assert not any(fin.alive for fin, _ in made) and not any(fin.alive for fin in backends)
    assert all(native.ctx is None and native.ctx_in is None for _, native in made)  # ggml_free ran
    g = Graph(be)
    g.close()
    g.close()  # closing twice frees once
    be.close()
    with pytest.raises(RuntimeError, match="backend CPU is closed"):
        Graph(be)
