"""One Backend driven from several Python threads (issue 21): cffi releases the GIL during compute and ggml's
backends are not reentrant, so a Backend computes one graph at a time (its lock, held across every compute).
Graphs on one Backend computed from four threads give, bitwise, what they give one after another."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hotggml import ops
from hotggml.graph import Backend, Graph

N_GRAPHS, ROUNDS = 4, 20


def _graph(be: Backend, seed: int) -> tuple[Graph, object, object]:
    """Fused attention fwd + bwd, same shapes for every seed (the case where races gave wrong values)."""
    rng = np.random.default_rng(seed)
    g = Graph(be)
    q = g.param(rng.standard_normal((1, 4, 24, 32), dtype=np.float32))
    k = g.param(rng.standard_normal((1, 2, 40, 32), dtype=np.float32))
    v = g.param(rng.standard_normal((1, 2, 40, 32), dtype=np.float32))
    fwd = ops.flash_attn_train(g, q, k, v, None, 0.2, prec="f32", causal=True)
    o = ops.get_o(fwd)
    g.build([o], g.dot_loss([(o, rng.standard_normal((1, 24, 4, 32), dtype=np.float32))]))
    return g, o, q


def _run(g: Graph, o, q) -> tuple[np.ndarray, np.ndarray]:
    g.compute()
    return g.read(o), g.grad(q)


def test_graphs_on_one_backend_from_four_threads_match_the_serial_runs(lib):
    with Backend("CPU", n_threads=2) as be:
        graphs = [_graph(be, seed) for seed in range(N_GRAPHS)]
        try:
            serial = [_run(*h) for h in graphs]
            assert all(np.isfinite(o).all() and np.abs(dq).max() > 0 for o, dq in serial)
            with ThreadPoolExecutor(max_workers=N_GRAPHS) as pool:
                for _ in range(ROUNDS):
                    threaded = list(pool.map(lambda h: _run(*h), graphs))
                    for (o, dq), (o_ref, dq_ref) in zip(threaded, serial):
                        np.testing.assert_array_equal(o, o_ref)
                        np.testing.assert_array_equal(dq, dq_ref)
        finally:
            for g, _, _ in graphs:
                g.close()
