"""Every op ggml's allocator may compute in place (ggml_op_can_inplace), with its result placed over each
source it may reuse, on the CPU: the result must equal the same op computed into memory of its own.

A source is offered for reuse by making it an intermediate node (scale(input, 1): one consumer, not an
output) while the other sources stay inputs (external memory, never reused); the reference graph marks
that node an output, which the allocator never reuses. The test asserts `dst->data == src->data` in the
first graph, so the aliasing really happened. The values of soft_max_back's example (issue 9) are checked
against float64 as well.
"""

from __future__ import annotations

import numpy as np
import pytest

from hotggml.ffi import ffi
from hotggml.graph import Backend, Graph

RNG = np.random.default_rng(7)
X = RNG.uniform(0.5, 2.0, (4, 8)).astype(np.float32)     # ggml [8, 4]: positive (sqrt, log)
Y = RNG.uniform(-1.0, 1.0, (4, 8)).astype(np.float32)
SQ = RNG.uniform(-1.0, 1.0, (8, 8)).astype(np.float32)   # square (diag masks)
ROPE_X = RNG.uniform(-1.0, 1.0, (3, 2, 8)).astype(np.float32)  # ggml [8 dims, 2 heads, 3 tokens]
POS = np.arange(3, dtype=np.int32)


def _softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _unary_cases(lib):
    return {f"unary-{i}": ([X], lambda g, s, i=i: lib.ggml_unary(g.ctx, s[0], i))
            for i in range(lib.GGML_UNARY_OP_COUNT)}


def cases(lib):
    """name -> (source arrays, builder(g, source pointers) -> result pointer)."""
    c = {
        "fill": ([X], lambda g, s: lib.ggml_fill(g.ctx, s[0], 0.25)),
        "scale": ([X], lambda g, s: lib.ggml_scale(g.ctx, s[0], 3.0)),
        "diag_mask_zero": ([SQ], lambda g, s: lib.ggml_diag_mask_zero(g.ctx, s[0], 2)),
        "diag_mask_inf": ([SQ], lambda g, s: lib.ggml_diag_mask_inf(g.ctx, s[0], 2)),
        "add": ([X, Y], lambda g, s: lib.ggml_add(g.ctx, s[0], s[1])),
        "add1": ([X, np.array([0.5], np.float32)], lambda g, s: lib.ggml_add1(g.ctx, s[0], s[1])),
        "sub": ([X, Y], lambda g, s: lib.ggml_sub(g.ctx, s[0], s[1])),
        "mul": ([X, Y], lambda g, s: lib.ggml_mul(g.ctx, s[0], s[1])),
        "div": ([X, X[::-1].copy()], lambda g, s: lib.ggml_div(g.ctx, s[0], s[1])),
        "sqr": ([Y], lambda g, s: lib.ggml_sqr(g.ctx, s[0])),
        "sqrt": ([X], lambda g, s: lib.ggml_sqrt(g.ctx, s[0])),
        "log": ([X], lambda g, s: lib.ggml_log(g.ctx, s[0])),
        "rope": ([ROPE_X, POS], lambda g, s: lib.ggml_rope(g.ctx, s[0], s[1], 8, 0)),
        "rope_back": ([ROPE_X, POS], lambda g, s: lib.ggml_rope_ext_back(
            g.ctx, s[0], s[1], ffi.NULL, 8, 0, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)),
        "silu_back": ([Y, X], lambda g, s: lib.ggml_silu_back(g.ctx, s[0], s[1])),
        "rms_norm": ([Y], lambda g, s: lib.ggml_rms_norm(g.ctx, s[0], 1e-6)),
        "rms_norm_back": ([Y, X], lambda g, s: lib.ggml_rms_norm_back(g.ctx, s[0], s[1], 1e-6)),
        "soft_max": ([Y], lambda g, s: lib.ggml_soft_max(g.ctx, s[0])),
        "soft_max_back": ([Y, _softmax(X)], lambda g, s: lib.ggml_soft_max_ext_back(g.ctx, s[0], s[1], 1.0, 0.0)),
        "add_id": ([RNG.uniform(-1, 1, (3, 2, 8)).astype(np.float32), RNG.uniform(-1, 1, (4, 8)).astype(np.float32),
                    np.array([[0, 3], [1, 2], [3, 3]], np.int32)],
                   lambda g, s: lib.ggml_add_id(g.ctx, s[0], s[1], s[2])),
    }
    c.update(_unary_cases(lib))
    return c


def _run(lib, arrays, build, offered: int | None):
    """The op's result, and whether it took the memory of source `offered` (an intermediate node the
    allocator may reuse); offered None is the reference: every float source a node marked output."""
    with Backend("CPU") as be, Graph(be) as g:
        leaves = [g.input(a) for a in arrays]
        srcs = [g.wrap(lib.ggml_scale(g.ctx, t.ptr, 1.0)) if a.dtype == np.float32 and offered in (None, i) else t
                for i, (t, a) in enumerate(zip(leaves, arrays))]
        out = g.wrap(build(g, [s.ptr for s in srcs]))
        kept = [s for s, leaf in zip(srcs, leaves) if s is not leaf] if offered is None else []
        g.build([out, *kept])
        if not be.supports_op(out):
            return None, None, out.op
        g.compute()
        aliased = offered is not None and ffi.cast("uintptr_t", out.ptr.data) == ffi.cast("uintptr_t", srcs[offered].ptr.data)
        return g.read(out), aliased, out.op


@pytest.fixture(scope="module")
def all_cases(lib):
    return cases(lib)


def test_every_inplace_capable_op_is_covered(lib, all_cases):
    capable = {ffi.string(lib.ggml_op_name(op)).decode() for op in range(lib.GGML_OP_COUNT) if lib.ggml_op_can_inplace(op)}
    covered = set()
    for arrays, build in all_cases.values():
        covered.add(ffi.string(lib.ggml_op_name(_run(lib, arrays, build, None)[2])).decode())
    assert capable <= covered, f"in-place capable ops without a case: {sorted(capable - covered)}"
    print(f"{len(capable)} in-place capable ops covered ({len(all_cases)} cases)")


def test_results_placed_over_a_source_equal_results_in_their_own_memory(lib, all_cases):
    failures, checked = [], 0
    for name, (arrays, build) in all_cases.items():
        ref, _, _ = _run(lib, arrays, build, None)
        if ref is None:
            continue  # the CPU backend does not take this op
        for i, a in enumerate(arrays):
            if a.dtype != np.float32 or (1,) * (4 - a.ndim) + a.shape != ref.shape:
                continue  # a source of another layout (or an int one) is never reused
            got, aliased, _ = _run(lib, arrays, build, i)
            assert aliased, f"{name}: the allocator did not place the result over source {i}"
            checked += 1
            if not np.array_equal(got, ref, equal_nan=True):
                failures.append(f"{name} over src[{i}]: worst {np.nanmax(np.abs(got - ref)):.3g}")
    print(f"{checked} (op, source) placements checked")
    assert checked >= 40 and not failures, failures


def test_soft_max_back_example_from_the_issue(lib):
    """y = softmax(a) computed in the graph, dx = soft_max_ext_back(dy, y) as the output (y may be reused)."""
    a = np.array([0.1, 0.5, -0.3, 1.2], np.float32)
    dy = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    with Backend("CPU") as be, Graph(be) as g:
        y = g.soft_max_ext(g.input(a), None, 1.0)
        dx = g.wrap(lib.ggml_soft_max_ext_back(g.ctx, g.input(dy).ptr, y.ptr, 1.0, 0.0))
        g.build([dx])
        g.compute()
        got = g.read(dx)
    np.testing.assert_allclose(got.ravel(), [-0.031499, -0.772785, -0.075468, 0.879752], atol=2e-6)
