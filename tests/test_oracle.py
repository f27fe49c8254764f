"""Tests for hotggml.oracle: the float64 NumPy attention reference.

Forward is checked against a naive per-row loop; backward against central
finite differences of L = sum(do*o) + sum(dlse*lse) in float64.  Every
gradient check is guarded against vacuity: the reference gradient must be
non-zero somewhere, and a deliberately wrong gradient must fail the same
tolerance.
"""

from __future__ import annotations

import math
import pathlib
import sys
import warnings

import numpy as np
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hotggml.oracle import attention_backward, attention_forward, masked_rows  # noqa: E402

B, NH, NKV, S, SKV, D, DV = 2, 4, 2, 5, 7, 3, 4
SCALE = 1.0 / math.sqrt(D)
RTOL, ATOL = 1e-6, 1e-8
FD_EPS = 1e-5


# --------------------------------------------------------------------------
# helpers


def _inputs(seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, NH, S, D)).astype(dtype)
    k = rng.standard_normal((B, NKV, SKV, D)).astype(dtype)
    v = rng.standard_normal((B, NKV, SKV, DV)).astype(dtype)
    do = rng.standard_normal((B, NH, S, DV))
    dlse = rng.standard_normal((B, NH, S))
    return q, k, v, do, dlse


def _causal(S2=S + 3, Bm=1):
    """Causal mask, diagonal shifted so query i sees keys j <= i + (SKV - S).

    Rows beyond S are padding (as ggml pads the mask) and hold garbage that the
    oracle must ignore.
    """
    m = np.zeros((Bm, S2, SKV), dtype=np.float32)
    i = np.arange(S)[:, None]
    j = np.arange(SKV)[None, :]
    m[:, :S, :][:, j > i + (SKV - S)] = -np.inf
    m[:, S:, :] = 123.0  # must never be read
    return m


def _bias(seed=7):
    rng = np.random.default_rng(seed)
    return (2.0 * rng.standard_normal((B, S, SKV))).astype(np.float32)


PAD_COLS = (3, SKV - 1)


def _padding():
    m = np.zeros((B, S, SKV), dtype=np.float16)
    for j in PAD_COLS:
        m[:, :, j] = -np.inf
    return m


DEAD = (0, 2)  # (batch, query row) fully masked


def _dead_row():
    m = _bias(11).astype(np.float32)
    m[:, :, 1] = -np.inf  # plus one masked key so P has exact zeros elsewhere too
    m[DEAD[0], DEAD[1], :] = -np.inf
    return m


MASKS = {
    "none": lambda: None,
    "causal": _causal,
    "bias": _bias,
    "padding": _padding,
    "dead_row": _dead_row,
}


def _naive_forward(q, k, v, mask, scale):
    """Per-row loop with plain Python math; no max subtraction (values are small)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    Bq, Nh, Sq, _ = q.shape
    Nkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Nh // Nkv
    o = np.zeros((Bq, Nh, Sq, Dv))
    lse = np.zeros((Bq, Nh, Sq))
    for b in range(Bq):
        for h in range(Nh):
            g = h // G
            for i in range(Sq):
                w = []
                for j in range(Skv):
                    s = scale * sum(float(q[b, h, i, d]) * float(k[b, g, j, d]) for d in range(q.shape[3]))
                    if mask is not None:
                        s += float(mask[b if mask.shape[0] > 1 else 0, i, j])
                    w.append(math.exp(s) if s != -math.inf else 0.0)
                tot = math.fsum(w)
                if tot == 0.0:
                    continue  # fully masked: o = 0, lse = 0
                lse[b, h, i] = math.log(tot)
                for j in range(Skv):
                    o[b, h, i] += (w[j] / tot) * v[b, g, j]
    return o, lse


def _loss(q, k, v, mask, scale, do, dlse):
    o, lse = attention_forward(q, k, v, mask, scale)
    return math.fsum((do * o).ravel()) + math.fsum((dlse * lse).ravel())


def _fd_grad(x, f, eps=FD_EPS):
    """Central differences of scalar f w.r.t. every entry of float64 array x."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        orig = x[idx]
        x[idx] = orig + eps
        fp = f()
        x[idx] = orig - eps
        fm = f()
        x[idx] = orig
        g[idx] = (fp - fm) / (2 * eps)
    return g


def _close(got, want):
    return bool(np.all(np.abs(got - want) <= ATOL + RTOL * np.abs(want)))


def _fd_all(q, k, v, mask, do, dlse):
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))

    def f():
        return _loss(q, k, v, mask, SCALE, do, dlse)

    return _fd_grad(q, f), _fd_grad(k, f), _fd_grad(v, f)


# --------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("name", sorted(MASKS))
def test_forward_matches_naive(name):
    q, k, v, _, _ = _inputs(1)
    mask = MASKS[name]()
    o, lse = attention_forward(q, k, v, mask, SCALE)
    assert o.shape == (B, NH, S, DV) and lse.shape == (B, NH, S)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    o_ref, lse_ref = _naive_forward(q, k, v, mask, SCALE)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-13)
    assert np.abs(o).max() > 1e-3


def test_forward_gqa_head_mapping():
    """Query head h must read kv head h // (Nh // Nkv), not h % Nkv."""
    q, k, v, _, _ = _inputs(2)
    o, lse = attention_forward(q, k, v, None, SCALE)
    G = NH // NKV
    for h in range(NH):
        o1, l1 = attention_forward(q[:, h : h + 1], k[:, h // G : h // G + 1], v[:, h // G : h // G + 1], None, SCALE)
        np.testing.assert_array_equal(o[:, h : h + 1], o1)
        np.testing.assert_array_equal(lse[:, h : h + 1], l1)
    # h % Nkv would differ for h = 1
    o_wrong, _ = attention_forward(q[:, 1:2], k[:, 1:2], v[:, 1:2], None, SCALE)
    assert not np.allclose(o[:, 1:2], o_wrong)


def test_forward_low_precision_inputs_are_upcast():
    q, k, v, _, _ = _inputs(3)
    for dt in (np.float16, np.float32):
        qc, kc, vc = (a.astype(dt) for a in (q, k, v))
        mask = _causal().astype(dt)
        o, lse = attention_forward(qc, kc, vc, mask, SCALE)
        assert o.dtype == np.float64 and lse.dtype == np.float64
        o64, lse64 = attention_forward(*(a.astype(np.float64) for a in (qc, kc, vc)), mask.astype(np.float64), SCALE)
        np.testing.assert_array_equal(o, o64)
        np.testing.assert_array_equal(lse, lse64)


def test_forward_stable_for_large_logits():
    q, k, v, _, _ = _inputs(4)
    scale = 400.0  # logits of order 1e3: exp would overflow without max subtraction
    with np.errstate(all="raise"):
        o, lse = attention_forward(q, k, v, None, scale)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    # lse is the max logit plus log of something in [1, Skv]
    kh = np.repeat(k, NH // NKV, axis=1)
    smax = (scale * np.einsum("bhid,bhjd->bhij", q, kh)).max(-1)
    assert np.all(lse >= smax - 1e-9) and np.all(lse <= smax + math.log(SKV) + 1e-9)


def test_mask_broadcast_and_padding_rows():
    q, k, v, _, _ = _inputs(5)
    m1 = _causal(S2=S + 3, Bm=1)
    mB = np.repeat(m1[:, :S], B, axis=0)
    oa, la = attention_forward(q, k, v, m1, SCALE)
    ob, lb = attention_forward(q, k, v, mB, SCALE)
    np.testing.assert_array_equal(oa, ob)
    np.testing.assert_array_equal(la, lb)
    # garbage (even NaN) in the unused padding rows is ignored
    m2 = m1.copy()
    m2[:, S:] = np.nan
    oc, lc = attention_forward(q, k, v, m2, SCALE)
    np.testing.assert_array_equal(oa, oc)
    np.testing.assert_array_equal(la, lc)


def test_fully_masked_row_forward_exact_zero_no_warnings():
    q, k, v, do, dlse = _inputs(6)
    mask = _dead_row()
    b, i = DEAD
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            o, lse = attention_forward(q, k, v, mask, SCALE)
            dq, dk, dv = attention_backward(q, k, v, mask, SCALE, do, dlse)
            rows = masked_rows(mask, B, S)
    assert np.all(o[b, :, i] == 0.0) and np.all(lse[b, :, i] == 0.0)
    assert np.all(dq[b, :, i] == 0.0)
    for a in (o, lse, dq, dk, dv):
        assert np.all(np.isfinite(a))
    expect = np.zeros((B, S), dtype=bool)
    expect[b, i] = True
    np.testing.assert_array_equal(rows, expect)
    # other rows are live
    assert np.abs(o[1 - b, :, i]).max() > 1e-3
    assert np.abs(dq[1 - b, :, i]).max() > 1e-3


def test_fully_masked_row_contributes_nothing_to_dk_dv():
    q, k, v, do, dlse = _inputs(7)
    mask = _dead_row()
    b, i = DEAD
    dq0, dk0, dv0 = attention_backward(q, k, v, mask, SCALE, do, dlse)
    do2, dlse2 = do.copy(), dlse.copy()
    do2[b, :, i] = 1e3 * np.random.default_rng(70).standard_normal((NH, DV))
    dlse2[b, :, i] = -1e3
    q2 = q.copy()
    q2[b, :, i] = 1e3  # the dead row's query must not matter either
    dq1, dk1, dv1 = attention_backward(q2, k, v, mask, SCALE, do2, dlse2)
    np.testing.assert_array_equal(dk0, dk1)
    np.testing.assert_array_equal(dv0, dv1)
    np.testing.assert_array_equal(np.delete(dq0, i, axis=2)[b], np.delete(dq1, i, axis=2)[b])
    # sanity: changing a live row's do does change dk/dv
    do3 = do.copy()
    do3[1 - b, :, i] += 1.0
    _, dk3, dv3 = attention_backward(q, k, v, mask, SCALE, do3, dlse)
    assert not np.array_equal(dv0, dv3) and not np.array_equal(dk0, dk3)


def test_masked_rows_helper():
    assert masked_rows(None, B, S).shape == (B, S) and not masked_rows(None, B, S).any()
    m = np.zeros((1, S + 2, SKV), dtype=np.float32)
    m[0, 1, :] = -np.inf
    m[0, S, :] = -np.inf  # padding row, ignored
    m[0, 3, :-1] = -np.inf  # not fully masked
    m[0, 4, :] = np.finfo(np.float32).min  # large finite negative is not "masked"
    r = masked_rows(m, B, S)
    expect = np.zeros((B, S), dtype=bool)
    expect[:, 1] = True
    np.testing.assert_array_equal(r, expect)


# --------------------------------------------------------------------------
# backward vs finite differences


@pytest.mark.parametrize("name", sorted(MASKS))
def test_backward_matches_finite_differences(name):
    q, k, v, do, dlse = _inputs(100 + sorted(MASKS).index(name), dtype=np.float32)
    mask = MASKS[name]()
    dq, dk, dv = attention_backward(q, k, v, mask, SCALE, do, dlse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == np.float64
    fq, fk, fv = _fd_all(q, k, v, mask, do, dlse)
    for nm, got, want in (("dq", dq, fq), ("dk", dk, fk), ("dv", dv, fv)):
        assert np.abs(want).max() > 1e-3, f"{nm}: vacuous reference gradient"
        assert _close(got, want), f"{nm}: max abs err {np.abs(got - want).max():.3e}"
    # the tolerance must be tight enough to catch a 1% error
    assert not _close(1.01 * dk, fk)
    assert not _close(1.01 * dv, fv)
    assert not _close(1.01 * dq, fq)

    if name == "padding":
        for j in PAD_COLS:
            assert np.all(dk[:, :, j] == 0.0) and np.all(dv[:, :, j] == 0.0)
        live = [j for j in range(SKV) if j not in PAD_COLS]
        assert np.abs(dk[:, :, live]).max() > 1e-3 and np.abs(dv[:, :, live]).max() > 1e-3
    if name == "dead_row":
        b, i = DEAD
        assert np.all(dq[b, :, i] == 0.0)
        assert np.all(dk[:, :, 1] == 0.0) and np.all(dv[:, :, 1] == 0.0)


def test_backward_dlse_none_equals_zero_and_dlse_matters():
    q, k, v, do, dlse = _inputs(8)
    mask = _causal()
    a = attention_backward(q, k, v, mask, SCALE, do)
    b = attention_backward(q, k, v, mask, SCALE, do, np.zeros((B, NH, S)))
    c = attention_backward(q, k, v, mask, SCALE, do, dlse)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(a[0], c[0]) and not np.allclose(a[1], c[1])
    np.testing.assert_array_equal(a[2], c[2])  # dv does not depend on dlse


def test_backward_lse_only_fd():
    """dlse alone (do = 0): exercises the dS += P*dlse term in isolation."""
    q, k, v, _, dlse = _inputs(9)
    do = np.zeros((B, NH, S, DV))
    mask = _bias()
    dq, dk, dv = attention_backward(q, k, v, mask, SCALE, do, dlse)
    fq, fk, _ = _fd_all(q, k, v, mask, do, dlse)
    assert np.abs(fq).max() > 1e-3 and np.abs(fk).max() > 1e-3
    assert _close(dq, fq) and _close(dk, fk)
    assert np.all(dv == 0.0)
    assert not _close(1.01 * dk, fk)


# --------------------------------------------------------------------------
# errors


def test_errors_name_the_argument():
    q, k, v, do, dlse = _inputs(10)
    cases = [
        (dict(q=q[0]), "q"),
        (dict(k=k[:1]), "k"),
        (dict(k=k[..., :2]), "k"),
        (dict(k=np.zeros((B, 3, SKV, D)), v=np.zeros((B, 3, SKV, DV))), "k"),  # 4 % 3 != 0
        (dict(v=v[:, :, :-1]), "v"),
        (dict(v=v[:, :1]), "v"),
        (dict(mask=np.zeros((S, SKV))), "mask"),
        (dict(mask=np.zeros((3, S, SKV))), "mask"),
        (dict(mask=np.zeros((1, S - 1, SKV))), "mask"),
        (dict(mask=np.zeros((1, S, SKV + 1))), "mask"),
        (dict(mask=np.full((1, S, SKV), np.inf)), "mask"),
        (dict(mask=np.full((1, S, SKV), np.nan)), "mask"),
        (dict(scale=float("nan")), "scale"),
        (dict(q=np.where(q > 1, np.nan, q)), "q"),
    ]
    base = dict(q=q, k=k, v=v, mask=None, scale=SCALE)
    for over, argname in cases:
        kw = {**base, **over}
        with pytest.raises(ValueError, match=rf"^{argname}:"):
            attention_forward(**kw)
        with pytest.raises(ValueError, match=rf"^{argname}:"):
            attention_backward(**kw, do=do)
    with pytest.raises(ValueError, match=r"^do:"):
        attention_backward(q, k, v, None, SCALE, do[..., :-1])
    with pytest.raises(ValueError, match=r"^dlse:"):
        attention_backward(q, k, v, None, SCALE, do, dlse[:, :, :-1])
    with pytest.raises(ValueError, match=r"^mask:"):
        masked_rows(np.zeros((3, S, SKV)), B, S)
    with pytest.raises(TypeError, match=r"^q:"):
        attention_forward(q.astype(np.int32), k, v, None, SCALE)
