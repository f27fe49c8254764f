"""Backward cases with a strided incoming gradient (issue 9, patch backward-strided-grads): each op with a
backward case gets a permuted consumer (loss over cont(permute(op(...)))), and its gradients must equal those
of the same loss written without the permutation within 1e-6. Each op runs in a subprocess of its own: a
backward case that asserts a contiguous gradient aborts the process, and the test says which op did.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hotggml import paths

PRELUDE = '''
import numpy as np
from hotggml.ffi import ffi
from hotggml.graph import Backend, Graph
from hotggml import ops

rng = np.random.default_rng(3)
P = lambda *shape: rng.uniform(0.5, 1.5, shape).astype(np.float32)   # positive (sqrt, log, div)
N = lambda *shape: rng.uniform(-1.0, 1.0, shape).astype(np.float32)

def grads(build, permuted):
    with Backend("CPU") as be, Graph(be) as g:
        lib = g.lib
        rng_state = rng.bit_generator.state
        out, params = build(g, lib)
        rng.bit_generator.state = rng_state
        ne = out.ne
        w = np.random.default_rng(11).uniform(-1, 1, (ne[3], ne[2], ne[1], ne[0])).astype(np.float32)
        if permuted:
            t = g.wrap(lib.ggml_permute(g.ctx, out.ptr, 1, 0, 2, 3))
            loss = g.dot_loss([(t, w.swapaxes(-1, -2).copy())])
        else:
            loss = g.dot_loss([(out, w)])
        g.build([out], loss)
        g.compute()
        return [g.grad(p) for p in params]

def check(build):
    state = rng.bit_generator.state
    a = grads(build, True)
    rng.bit_generator.state = state
    b = grads(build, False)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x is not None and y is not None, f"param {i} got no gradient"
        assert np.abs(y).max() > 0, f"param {i}: zero reference gradient"
        err = np.abs(x - y).max() / np.abs(y).max()
        assert err <= 1e-6, f"param {i}: {err:.3g}"
    print("ok")
'''

BUILDERS = {
    "DUP": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_dup(g.ctx, x.ptr)), [x]",
    "ADD": "x, y = g.param(N(4, 6)), g.param(N(4, 6)); return g.add(x, y), [x, y]",
    "ADD1": "x, s = g.param(N(4, 6)), g.param(N(1)); return g.wrap(lib.ggml_add1(g.ctx, x.ptr, s.ptr)), [x, s]",
    "ACC": "x, y = g.param(N(4, 6)), g.param(N(2, 3)); "
           "return g.wrap(lib.ggml_acc(g.ctx, x.ptr, y.ptr, x.nb[1], x.nb[2], x.nb[3], 4)), [x, y]",
    "SUB": "x, y = g.param(N(4, 6)), g.param(N(4, 6)); return g.wrap(lib.ggml_sub(g.ctx, x.ptr, y.ptr)), [x, y]",
    "MUL": "x, y = g.param(N(4, 6)), g.param(N(4, 6)); return g.mul(x, y), [x, y]",
    "DIV": "x, y = g.param(N(4, 6)), g.param(P(4, 6)); return g.wrap(lib.ggml_div(g.ctx, x.ptr, y.ptr)), [x, y]",
    "SQR": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_sqr(g.ctx, x.ptr)), [x]",
    "SQRT": "x = g.param(P(4, 6)); return g.wrap(lib.ggml_sqrt(g.ctx, x.ptr)), [x]",
    "LOG": "x = g.param(P(4, 6)); return g.wrap(lib.ggml_log(g.ctx, x.ptr)), [x]",
    "SIN": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_sin(g.ctx, x.ptr)), [x]",
    "COS": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_cos(g.ctx, x.ptr)), [x]",
    "SUM": "x = g.param(N(4, 6)); s = g.sum(x); return g.wrap(lib.ggml_repeat(g.ctx, s.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "SUM_ROWS": "x = g.param(N(4, 6)); s = g.wrap(lib.ggml_sum_rows(g.ctx, x.ptr)); "
                "return g.wrap(lib.ggml_repeat(g.ctx, s.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "MEAN": "x = g.param(N(4, 6)); s = g.wrap(lib.ggml_mean(g.ctx, x.ptr)); "
            "return g.wrap(lib.ggml_repeat(g.ctx, s.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "REPEAT": "x = g.param(N(1, 6)); return g.wrap(lib.ggml_repeat(g.ctx, x.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "REPEAT_BACK": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_repeat_back(g.ctx, x.ptr, g.new_tensor((3, 2)).ptr)), [x]",
    "RMS_NORM": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_rms_norm(g.ctx, x.ptr, 1e-6)), [x]",
    "MUL_MAT": "a, b = g.param(N(4, 6)), g.param(N(5, 6)); return g.mul_mat(a, b), [a, b]",
    "SCALE": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_scale(g.ctx, x.ptr, 3.0)), [x]",
    "SET": "x, y = g.param(N(4, 6)), g.param(N(2, 3)); "
           "return g.wrap(lib.ggml_set(g.ctx, x.ptr, y.ptr, x.nb[1], x.nb[2], x.nb[3], 8)), [x, y]",
    "CPY": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_cpy(g.ctx, x.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "CONT": "x = g.param(N(4, 6)); return g.cont(g.permute(x, 1, 0, 2, 3)), [x]",
    "RESHAPE": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_reshape_2d(g.ctx, x.ptr, 8, 3)), [x]",
    "VIEW": "x = g.param(N(4, 6)); return g.cont(g.wrap(lib.ggml_view_2d(g.ctx, x.ptr, 3, 4, x.nb[1], 4))), [x]",
    "PERMUTE": "x = g.param(N(2, 4, 6)); return g.cont(g.permute(x, 0, 2, 1, 3)), [x]",
    "TRANSPOSE": "x = g.param(N(4, 6)); return g.cont(g.wrap(lib.ggml_transpose(g.ctx, x.ptr))), [x]",
    "GET_ROWS": "x = g.param(N(5, 6)); i = g.input(np.array([4, 0, 2], np.int32)); "
                "return g.wrap(lib.ggml_get_rows(g.ctx, x.ptr, i.ptr)), [x]",
    "DIAG_MASK_INF": "x = g.param(N(4, 4)); return g.wrap(lib.ggml_soft_max(g.ctx, lib.ggml_diag_mask_inf(g.ctx, x.ptr, 0))), [x]",
    "DIAG_MASK_ZERO": "x = g.param(N(4, 4)); return g.wrap(lib.ggml_diag_mask_zero(g.ctx, x.ptr, 0)), [x]",
    "SOFT_MAX": "x = g.param(N(4, 6)); return g.soft_max_ext(x, None, 0.7), [x]",
    "ROPE": "x = g.param(N(3, 2, 8)); p = g.input(np.arange(3, dtype=np.int32)); "
            "return g.wrap(lib.ggml_rope(g.ctx, x.ptr, p.ptr, 8, 0)), [x]",
    "UNARY-ABS": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_abs(g.ctx, x.ptr)), [x]",
    "UNARY-NEG": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_neg(g.ctx, x.ptr)), [x]",
    "UNARY-RELU": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_relu(g.ctx, x.ptr)), [x]",
    "UNARY-SILU": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_silu(g.ctx, x.ptr)), [x]",
    "UNARY-EXP": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_exp(g.ctx, x.ptr)), [x]",
    "UNARY-SOFTPLUS": "x = g.param(N(4, 6)); return g.wrap(lib.ggml_softplus(g.ctx, x.ptr)), [x]",
    "GLU-SWIGLU": "x, y = g.param(N(4, 6)), g.param(N(4, 6)); "
                  "return g.wrap(lib.ggml_swiglu_split(g.ctx, x.ptr, y.ptr)), [x, y]",  # the backward is the split form's
    "CROSS_ENTROPY_LOSS": "x = g.param(N(4, 6)); t = g.input(np.eye(4, 6, dtype=np.float32)); "
                          "l = g.wrap(lib.ggml_cross_entropy_loss(g.ctx, x.ptr, t.ptr)); "
                          "return g.wrap(lib.ggml_repeat(g.ctx, l.ptr, g.new_tensor((6, 4)).ptr)), [x]",
    "IM2COL": "k, x = g.input(N(1, 2, 3, 3)), g.param(N(1, 2, 5, 6)); "
              "return g.wrap(lib.ggml_im2col(g.ctx, k.ptr, x.ptr, 1, 1, 1, 1, 1, 1, True, lib.GGML_TYPE_F32)), [x]",
    "POOL_2D": "x = g.param(N(1, 2, 4, 6)); "
               "return g.wrap(lib.ggml_pool_2d(g.ctx, x.ptr, lib.GGML_OP_POOL_AVG, 2, 2, 2, 2, 0.0, 0.0)), [x]",
    "WIN_PART": "x = g.param(N(1, 6, 6, 4)); return g.wrap(lib.ggml_win_part(g.ctx, x.ptr, 3)), [x]",
    "WIN_UNPART": "x = g.param(N(4, 3, 3, 4)); return g.wrap(lib.ggml_win_unpart(g.ctx, x.ptr, 6, 6, 3)), [x]",
    "FLASH_ATTN_TRAIN": "q, k, v = g.param(N(1, 2, 5, 8)), g.param(N(1, 1, 4, 8)), g.param(N(1, 1, 4, 8)); "
                        "return ops.get_o(ops.flash_attn_train(g, q, k, v, None, 0.35, prec='f32')), [q, k, v]",
}


def _run(name: str) -> subprocess.CompletedProcess:
    body = "def build(g, lib):\n    " + BUILDERS[name] + "\ncheck(build)\n"
    return subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_permuted_consumer_gives_the_same_gradients(lib, name):
    run = _run(name)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), \
        f"{name}: exit {run.returncode}\n{run.stdout[-1500:]}\n{run.stderr[-2500:]}"


def test_coverage_of_the_backward_cases():
    """The op kinds above, against the backward cases of ggml_compute_backward: all 40 in the patched tree
    (UNARY and GLU counted once; their sub-ops with a backward case each have a case)."""
    kinds = {name.split("-")[0] for name in BUILDERS}
    print(f"{len(kinds)} ops with a backward case covered by a permuted consumer ({len(BUILDERS)} cases)")
    assert len(kinds) >= 40
