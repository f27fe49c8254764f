"""Float64 NumPy reference ("oracle") for attention forward and backward.

This module is deliberately independent of the rest of hotggml: it imports
only NumPy and the standard library, so it can be used to check the binding
without sharing any code (or bugs) with it.

Layout (NumPy C order, batch first -- ggml's ``ne`` order reversed)::

    q     (B, Nh,  S,   D)
    k     (B, Nkv, Skv, D)
    v     (B, Nkv, Skv, Dv)
    mask  None or (Bm, S2, Skv), Bm in {1, B}, S2 >= S; additive; only the
          first S rows are read (ggml pads the mask's row count)
    o     (B, Nh,  S,   Dv)
    lse   (B, Nh,  S)

Grouped-query attention: ``Nh % Nkv == 0`` and query head ``h`` reads kv head
``h // (Nh // Nkv)``.  The mask is shared by all heads and broadcast over the
batch when ``Bm == 1``.

Inputs may be float16, float32 or float64 (any real floating dtype); every
computation is done in float64 and every result is float64.

Math (per batch b, query head h, kv head g = h // (Nh // Nkv))::

    S_ij  = scale * q_i . k_j + M_ij
    lse_i = log sum_j exp(S_ij)          natural log, mask included,
                                         computed as m_i + log sum_j exp(S_ij - m_i)
                                         with m_i = max_j S_ij
    P_ij  = exp(S_ij - lse_i)
    o_i   = sum_j P_ij v_j

Backward of L = sum(dO * O) + sum(dlse * lse), following FlashAttention-2
(T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", 2023, arXiv:2307.08691, Algorithm 2), extended with the lse
cotangent (d lse_i / d S_ij = P_ij)::

    dV  = P^T dO
    dP  = dO V^T
    D_i = rowsum(dO_i * O_i)
    dS  = P * (dP - D_i + dlse_i)
    dQ  = scale * dS K
    dK  = scale * dS^T Q

For GQA, dK and dV of a kv head are the sum over the query heads that read it.

Fully masked query rows: a row is "fully masked" when every mask entry it
reads is ``-inf`` (only ``-inf`` counts; a large finite negative such as
-65504 or -FLT_MAX is an ordinary additive bias).  For such a row this module
defines ``o = 0`` and ``lse = 0`` exactly; the row's P is 0, so its dq is 0
exactly and it contributes exactly nothing to dk/dv.  No NaN is produced and
no floating-point warning is emitted.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

from hotggml.errors import InputError, InputTypeError

__all__ = ["attention_forward", "attention_backward", "masked_rows"]


# --------------------------------------------------------------------------
# validation helpers


def _as_float_array(x, name: str, ndim: int, layout: str) -> np.ndarray:
    """Return ``x`` as a float64 ndarray after checking dtype and rank."""
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise InputTypeError(f"{name}: expected a real floating dtype (float16/float32/float64), got {a.dtype}")
    if a.ndim != ndim:
        raise InputError(f"{name}: expected {ndim}-D array {layout}, got shape {a.shape}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise InputError(f"{name}: contains NaN or inf")
    return a


def _check_scale(scale) -> float:
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (Real, np.floating, np.integer)):
        raise InputTypeError(f"scale: expected a real number, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise InputError(f"scale: must be finite, got {s}")
    return s


def _check_mask(mask, B: int, S: int, Skv: int | None) -> np.ndarray | None:
    """Validate the mask and return its used part, float64, shape (Bm, S, Skv)."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if not np.issubdtype(m.dtype, np.floating):
        raise InputTypeError(f"mask: expected a real floating dtype, got {m.dtype}")
    if m.ndim != 3:
        raise InputError(f"mask: expected 3-D array (Bm, S2, Skv), got shape {m.shape}")
    Bm, S2, Skm = m.shape
    if Bm not in (1, B):
        raise InputError(f"mask: batch dim Bm={Bm} must be 1 or B={B} (shape {m.shape})")
    if S2 < S:
        raise InputError(f"mask: row count S2={S2} must be >= S={S} (shape {m.shape})")
    if Skv is not None and Skm != Skv:
        raise InputError(f"mask: last dim {Skm} must equal Skv={Skv} (shape {m.shape})")
    m = m[:, :S, :].astype(np.float64)
    if np.any(np.isnan(m)) or np.any(m == np.inf):
        raise InputError("mask: entries must be finite or -inf (found NaN or +inf in the first S rows)")
    return m


def _check_qkv(q, k, v):
    q = _as_float_array(q, "q", 4, "(B, Nh, S, D)")
    k = _as_float_array(k, "k", 4, "(B, Nkv, Skv, D)")
    v = _as_float_array(v, "v", 4, "(B, Nkv, Skv, Dv)")
    B, Nh, S, D = q.shape
    Bk, Nkv, Skv, Dk = k.shape
    Bv, Nkv_v, Skv_v, _Dv = v.shape
    if Bk != B:
        raise InputError(f"k: batch dim {Bk} != q batch dim {B} (q {q.shape}, k {k.shape})")
    if Dk != D:
        raise InputError(f"k: head dim {Dk} != q head dim {D} (q {q.shape}, k {k.shape})")
    if Nkv < 1 or Nh % Nkv != 0:
        raise InputError(f"k: kv head count Nkv={Nkv} must divide q head count Nh={Nh}")
    if Skv < 1:
        raise InputError(f"k: Skv must be >= 1, got shape {k.shape}")
    if (Bv, Nkv_v, Skv_v) != (B, Nkv, Skv):
        raise InputError(f"v: shape {v.shape} must be (B, Nkv, Skv, Dv) = ({B}, {Nkv}, {Skv}, Dv) to match k {k.shape}")
    return q, k, v


# --------------------------------------------------------------------------
# core


def _mm(a, b):
    """Batched float64 matmul (BLAS; einsum would not use it). Products of tiny probabilities may
    underflow to 0: benign, far below the sum's resolution."""
    with np.errstate(under="ignore"):
        return np.matmul(a, b)


def _probs(q, k, mask, scale):
    """Return (P, lse, fully_masked) in float64 for validated inputs.

    P (B, Nh, S, Skv), lse (B, Nh, S), fully_masked (B, 1, S) broadcastable.
    """
    B, Nh, S, _ = q.shape
    G = Nh // k.shape[1]
    kh = np.repeat(k, G, axis=1)  # head h -> kv head h // G
    s = scale * _mm(q, kh.swapaxes(-1, -2))
    if mask is not None:
        s = s + mask[:, None, :, :]  # (Bm, 1, S, Skv) broadcast over heads (and batch if Bm == 1)
    m = s.max(axis=-1, keepdims=True)  # (B, Nh, S, 1); -inf exactly for fully masked rows
    dead = np.isneginf(m)
    m_safe = np.where(dead, 0.0, m)
    with np.errstate(under="ignore"):  # flushing tiny weights to 0 is benign
        e = np.exp(s - m_safe)  # exp(-inf) = 0, no warning; never computes -inf - -inf
    l = e.sum(axis=-1, keepdims=True)  # >= 1 for live rows, 0 for dead rows
    l_safe = np.where(dead, 1.0, l)
    p = e / l_safe  # dead rows: 0 / 1 = 0
    lse = (m_safe + np.log(l_safe))[..., 0]  # dead rows: 0 + log 1 = 0
    return p, lse, dead[..., 0]


def attention_forward(q, k, v, mask, scale):
    """Attention forward in float64.

    Args:
      q: (B, Nh, S, D), float16/32/64.
      k: (B, Nkv, Skv, D), float16/32/64; ``Nh % Nkv == 0``.
      v: (B, Nkv, Skv, Dv), float16/32/64.
      mask: None or (Bm, S2, Skv) additive mask, Bm in {1, B}, S2 >= S; only
        rows ``[:S]`` are read; entries finite or ``-inf``.
      scale: finite real; scores are ``scale * q.k + mask``.

    Returns:
      (o, lse): o (B, Nh, S, Dv) float64, lse (B, Nh, S) float64 with
      ``lse_i = log sum_j exp(scale*q_i.k_j + mask_ij)`` (natural log, mask
      included, max-subtracted).  Fully masked rows give o = 0, lse = 0 exactly.

    Raises:
      ValueError: inconsistent shapes, Nh not divisible by Nkv, Skv == 0,
        non-finite q/k/v/scale, NaN or +inf in the used mask rows; the
        message names the offending argument.
      TypeError: non-floating array dtype or non-real scale.
    """
    q, k, v = _check_qkv(q, k, v)
    scale = _check_scale(scale)
    B, Nh, S, _ = q.shape
    mask = _check_mask(mask, B, S, k.shape[2])
    p, lse, _dead = _probs(q, k, mask, scale)
    G = Nh // k.shape[1]
    o = _mm(p, np.repeat(v, G, axis=1))
    return o, lse


def attention_forward_backward(q, k, v, mask, scale, do, dlse=None):
    """The forward and the gradients of ``L = sum(do * o) + sum(dlse * lse)`` w.r.t. q, k, v, in float64.

    (o, lse) is ``attention_forward(q, k, v, mask, scale)``, computed once for both.
    Formulas: FlashAttention-2 (Dao 2023, arXiv:2307.08691, Alg. 2) with the
    lse cotangent added::

        P = softmax(scale*Q K^T + M); dV = P^T dO; dP = dO V^T
        D_i = rowsum(dO_i * O_i); dS = P * (dP - D_i + dlse_i)
        dQ = scale * dS K; dK = scale * dS^T Q

    GQA: dK/dV of a kv head are summed over its ``Nh // Nkv`` query heads.
    Fully masked query rows have P = 0, so their dq is exactly 0 and they
    contribute exactly 0 to dk/dv (their do/dlse are ignored).

    Args:
      q, k, v, mask, scale: as in :func:`attention_forward`.
      do: (B, Nh, S, Dv) cotangent of o, float16/32/64.
      dlse: None (treated as zeros) or (B, Nh, S) cotangent of lse.

    Returns:
      (o, lse, dq, dk, dv): o and lse as in :func:`attention_forward`, then float64 arrays of
      shapes (B, Nh, S, D), (B, Nkv, Skv, D), (B, Nkv, Skv, Dv) -- the layouts of q, k, v.

    Raises:
      ValueError: as in :func:`attention_forward`, plus ``do`` / ``dlse``
        shape mismatch or non-finite entries (message names the argument).
      TypeError: non-floating array dtype or non-real scale.
    """
    q, k, v = _check_qkv(q, k, v)
    scale = _check_scale(scale)
    B, Nh, S, _ = q.shape
    _, Nkv, Skv, Dv = v.shape
    G = Nh // Nkv
    mask = _check_mask(mask, B, S, Skv)
    do = _as_float_array(do, "do", 4, "(B, Nh, S, Dv)")
    if do.shape != (B, Nh, S, Dv):
        raise InputError(f"do: shape {do.shape} must equal o's shape {(B, Nh, S, Dv)}")
    if dlse is None:
        dlse = np.zeros((B, Nh, S), dtype=np.float64)
    else:
        dlse = _as_float_array(dlse, "dlse", 3, "(B, Nh, S)")
        if dlse.shape != (B, Nh, S):
            raise InputError(f"dlse: shape {dlse.shape} must equal lse's shape {(B, Nh, S)}")

    kh = np.repeat(k, G, axis=1)
    vh = np.repeat(v, G, axis=1)
    p, lse, _dead = _probs(q, k, mask, scale)
    o = _mm(p, vh)

    dv_h = _mm(p.swapaxes(-1, -2), do)  # P^T dO, per query head
    dp = _mm(do, vh.swapaxes(-1, -2))  # dO V^T
    Di = np.sum(do * o, axis=-1)  # rowsum(dO * O)
    ds = p * (dp - Di[..., None] + dlse[..., None])  # dead rows: 0 * finite = 0
    dq = scale * _mm(ds, kh)
    dk_h = scale * _mm(ds.swapaxes(-1, -2), q)

    # head h = g * G + r reads kv head g: sum over r
    dk = dk_h.reshape(B, Nkv, G, Skv, -1).sum(axis=2)
    dv = dv_h.reshape(B, Nkv, G, Skv, Dv).sum(axis=2)
    return o, lse, dq, dk, dv


def attention_backward(q, k, v, mask, scale, do, dlse=None):
    """Gradients ``(dq, dk, dv)`` of ``L = sum(do * o) + sum(dlse * lse)``: :func:`attention_forward_backward`
    without the forward's results (same arguments, shapes and errors)."""
    return attention_forward_backward(q, k, v, mask, scale, do, dlse)[2:]


def masked_rows(mask, B, S):
    """Which query rows are fully masked.

    Args:
      mask: None or (Bm, S2, Skv) with Bm in {1, B} and S2 >= S.
      B: batch size; S: query length (only mask rows ``[:S]`` are read).

    Returns:
      bool ndarray (B, S): True where every entry of the row is ``-inf``
      (Bm == 1 is broadcast over the batch).  All False when mask is None.

    Raises:
      ValueError: inconsistent mask shape, or NaN / +inf in the used rows.
      TypeError: non-floating mask dtype.
    """
    B = int(B)
    S = int(S)
    if B < 0 or S < 0:
        raise InputError(f"B, S: must be >= 0, got B={B}, S={S}")
    m = _check_mask(mask, B, S, None)
    if m is None:
        return np.zeros((B, S), dtype=bool)
    dead = np.all(np.isneginf(m), axis=-1)  # (Bm, S)
    return np.broadcast_to(dead, (B, S)).copy()
