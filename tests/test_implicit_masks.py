"""Implicit causal and window masks (op_params, never stored): validation, inheritance by the autodiff
backward, and equality with the same masks stored. Parity against the float64 oracle, which gets them
made explicit, is in the smoke set (cases implicit-*)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hotggml import ops, parity
from hotggml.cases import Case
from hotggml.graph import Graph


def _fused(cpu, case):
    with Graph(cpu) as g:
        h = parity.build_fused(g, case, "f32")
        g.compute(poison=h.fused_nodes)
        implicit = [ops.get_implicit_mask(t) for t in h.fused_nodes]
        return parity.read_fused(g, case, h), implicit


@pytest.mark.parametrize("stored,implicit", [
    (Case("stored-causal", Nh=4, Nkv=2, D=16, S=13, Skv=40, mask="causal"),
     dict(mask="none", causal=True)),
    (Case("stored-band", Nh=2, Nkv=1, D=8, S=33, Skv=33, mask="band", band=3),
     dict(mask="none", window=3)),
])
def test_implicit_equals_stored_bitwise(cpu, stored, implicit):
    """0 or -INF from the indices is the same mask as 0 or -INF read from memory: the CPU results are
    bitwise equal, and not vacuously (the mask hides a part of every row but the last)."""
    a, _ = _fused(cpu, stored)
    b, flags = _fused(cpu, replace(stored, name="implicit", **implicit))
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.isneginf(stored.mask_array().astype(np.float32)).any() and np.abs(b.dk).max() > 0
    assert flags[0] == flags[1] == (implicit.get("causal", False), implicit.get("window"))


def test_mask_array_makes_implicit_masks_explicit():
    case = Case("x", S=3, Skv=5, mask="bias", causal=True, window=1)
    m = case.mask_array().astype(np.float32)[0]
    visible = ~np.isneginf(m)
    # i' = i + 2: causal j <= i', window |i' - j| <= 1 -> keys {1, 2}, {2, 3}, {3, 4}
    assert [list(np.nonzero(r)[0]) for r in visible] == [[1, 2], [2, 3], [3, 4]]
    assert np.array_equal(m[visible], case.stored_mask().astype(np.float32)[0][visible])  # the bias stays


def test_backward_inherits_implicit_masks(cpu):
    with Graph(cpu) as g:
        q = g.param(np.ones((1, 2, 4, 8), np.float32))
        k = g.param(np.ones((1, 1, 6, 8), np.float32))
        v = g.param(np.ones((1, 1, 6, 8), np.float32))
        fwd = ops.flash_attn_train(g, q, k, v, None, 0.5, causal=True, window=2)
        g.build([ops.get_o(fwd)], g.sum(ops.get_o(fwd)))
        back = g.find_nodes(ops.OP_FLASH_ATTN_TRAIN_BACK)[0]
        assert ops.get_implicit_mask(fwd) == ops.get_implicit_mask(back) == (True, 2)
        assert ops.get_implicit_mask(g.find_nodes(ops.OP_FLASH_ATTN_TRAIN)[0]) == (True, 2)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window=-1), ValueError, "window must be in"),
    (dict(window=2**31), ValueError, "window must be in"),
    (dict(window=2.0), TypeError, "window must be an int"),
    (dict(window=True), TypeError, "window must be an int"),
])
def test_implicit_mask_validation(cpu, kwargs, exc, match):
    with Graph(cpu) as g:
        q = g.input(np.zeros((1, 1, 4, 8), np.float32))
        k = g.input(np.zeros((1, 1, 4, 8), np.float32))
        with pytest.raises(exc, match=match):
            ops.flash_attn_train(g, q, k, k, None, 0.5, **kwargs)
        assert ops.get_implicit_mask(ops.flash_attn_train(g, q, k, k, None, 0.5)) == (False, None)
