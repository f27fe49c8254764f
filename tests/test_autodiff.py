"""What ggml's autodiff cannot differentiate is refused in Python (hotggml.autodiff), by Graph.build with a
loss and by the Optimizer, before ggml_build_backward_expand aborts the interpreter. Each case runs in a
child interpreter (an abort would end this test, not the session) and must raise InputError naming the
reason; the op lists are read back from the patched ggml.c."""

from __future__ import annotations

import re
import textwrap

import pytest
import numpy as np
from _misuse import run_child

from hotggml import autodiff, paths
from hotggml.graph import Backend, Graph

PRELUDE = """
import numpy as np
from hotggml import ops
from hotggml.errors import InputError
from hotggml.graph import Backend, Graph
from hotggml.opt import Optimizer
be = Backend("CPU")
x = np.ones((1, 2, 3, 4), np.float32)
"""

CASES = {
    "no param on the loss's path": ("needs a param()", """
        g = Graph(be); q, k, v = g.input(x), g.input(x), g.input(x)
        g.param(np.zeros(3, np.float32))
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, None, 0.5))
        g.build([o], g.sum(o))
    """),
    "a param only an output depends on": ("needs a param() that the loss depends on", """
        g = Graph(be); a = g.input(np.ones(4, np.float32)); p = g.param(np.ones(4, np.float32))
        g.build([p], g.sum(a))
    """),
    "mul_mat's gradient through an f16 operand": ("OUT_PROD with a f16 operand", """
        g = Graph(be); a = g.input(np.ones((5, 32), np.float16)); w = g.param(np.ones((3, 32), np.float32))
        y = g.mul_mat(a, g.mul(g.input(np.ones((3, 32), np.float32)), w))
        g.build([y], g.sum(y))
    """),
    "the Optimizer over mul_mat's gradient through an f16 cache": ("OUT_PROD with a f16 operand", """
        g = Graph(be); x = g.input(np.ones((3, 32), np.float32)); w = g.param(np.ones((3, 32), np.float32))
        y = g.mul_mat(g.cache(np.ones((5, 32), np.float32), "f16"), g.mul(x, w))
        Optimizer(g, x, y, loss="mse")
    """),
    "a leaf as the loss": ("computed from the graph", """
        g = Graph(be); p = g.param(np.zeros(3, np.float32))
        g.build([p], g.input(np.ones(1, np.float32)))
    """),
    "a loss through the explicit backward": ("no backward for FLASH_ATTN_TRAIN_BACK", """
        g = Graph(be); q, k, v = g.param(x), g.input(x), g.input(x)
        f = ops.flash_attn_train(g, q, k, v, None, 0.5)
        dq = ops.get_dq(ops.flash_attn_train_back(g, f, ops.get_o(f), grads="q"))
        g.build([dq], g.sum(dq))
    """),
    "a flash_attn_train mask from a param": ("the mask of flash_attn_train", """
        g = Graph(be); q, k, v = g.input(x), g.param(x), g.input(x)
        bias = g.param(np.zeros((1, 1, 3, 3), np.float32))
        mask = g.add(g.input(np.zeros((1, 1, 3, 3), np.float16)), bias)
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, mask, 0.5))
        g.build([o], g.sum(o))
    """),
    "a soft_max mask from a param": ("the mask of soft_max_ext", """
        g = Graph(be); a = g.input(np.ones((2, 3), np.float32)); w = g.param(np.ones((2, 3), np.float32))
        s = g.soft_max_ext(g.mul(a, w), g.param(np.zeros((2, 3), np.float32)), 1.0)
        g.build([s], g.sum(s))
    """),
    "mul_mat's param broadcast over dim 3": ("broadcast in dim 3", """
        g = Graph(be); w = g.param(np.ones((1, 1, 2, 3), np.float32)); a = g.input(np.ones((3, 1, 4, 3), np.float32))
        y = g.cont(g.mul_mat(w, a))
        g.build([y], g.sum(y))
    """),
    "the Optimizer over a flash_attn_train mask from a param": ("the mask of flash_attn_train", """
        g = Graph(be); q, k, v = g.input(x), g.param(x), g.input(x)
        mask = g.add(g.input(np.zeros((1, 1, 3, 3), np.float16)), g.param(np.zeros((1, 1, 3, 3), np.float32)))
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, mask, 0.5))
        Optimizer(g, q, o, loss="sum")
    """),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_before_ggml_aborts(lib, name):
    text, body = CASES[name]
    run = run_child(PRELUDE, f"expect(InputError, {text!r}, lambda: exec({textwrap.dedent(body)!r}, globals()))\n")
    assert run.returncode == 0 and run.stdout.strip().endswith("alive"), run.stdout[-2000:] + run.stderr[-2000:]


def test_a_differentiable_graph_is_not_refused(lib):
    run = run_child(PRELUDE, """
        g = Graph(be); q, k, v = g.param(x), g.param(x), g.param(x)
        mask = g.input(np.zeros((1, 1, 3, 3), np.float16))   # a constant mask needs no gradient
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, mask, 0.5, causal=True))
        g.build([o], g.sum(o)); g.compute()
        assert np.isfinite(g.grad(q)).all()
    """)
    assert run.returncode == 0 and "alive" in run.stdout, run.stderr[-2000:]


def test_the_backward_op_list_is_ggml_compute_backward():
    """autodiff.BACKWARD_OPS / BACKWARD_UNARY / BACKWARD_GLU are the cases of ggml_compute_backward in the patched
    tree (a case added or dropped by a patch or a new pin shows here), and every NO_GRAD_SRC rule is one of
    its asserts."""
    source = paths.work_dir() / "ggml" / "src" / "ggml.c"
    if not source.is_file():
        pytest.skip(f"no patched tree at {source} (`hotggml patches apply` makes it)")
    text = source.read_text()
    start = text.index("static void ggml_compute_backward(")
    body = text[start:text.index("\n}\n", start)]
    cases = set(re.findall(r"case GGML_OP_(\w+):", body)) - {"COUNT"}
    assert cases == autodiff.BACKWARD_OPS
    assert set(re.findall(r"case GGML_UNARY_OP_(\w+):", body)) == autodiff.BACKWARD_UNARY
    assert set(re.findall(r"case GGML_GLU_OP_(\w+):", body)) == autodiff.BACKWARD_GLU
    for needle in ("backward pass for softmax mask not implemented", "gradients for freq factors not implemented",
                   "backward pass for labels not implemented", "backward pass for the mask of flash_attn_train"):
        assert needle in body


def test_a_cast_in_the_graph_is_walked_as_ggml_walks_it(lib):
    """ggml_cast sets its result's src[1] to the result itself (no data input): refusals() must not take it for
    a source (it raised KeyError), and the gradient flows through the cast as ggml's CPY case sends it."""
    with Backend("CPU") as be, Graph(be) as g:
        x = g.param(np.arange(6, dtype=np.float32).reshape(2, 3))
        y = g.wrap(g.lib.ggml_cast(g.ctx, x.ptr, g.lib.GGML_TYPE_F32))
        assert y.ptr.src[1] == y.ptr  # the shape of the graph this test is about
        loss = g.sum(g.mul(y, y))
        assert autodiff.refusals([loss.ptr]) == []
        g.build([y], loss)
        g.compute()
        np.testing.assert_array_equal(g.grad(x).reshape(2, 3), 2 * np.arange(6, dtype=np.float32).reshape(2, 3))
