"""Parity of the fused attention training ops against two independent references (SPEC §6).

Arms, each at the same case:
  fused   ggml_flash_attn_train (+ its autodiff backward) on the requested backend
  chain   mul_mat -> soft_max_ext -> mul_mat differentiated by ggml's autodiff (GQA heads expanded)
  oracle  float64 NumPy (hotggml.oracle, which imports nothing of ours)
O, LSE, dQ, dK, dV are compared separately as worst relative error
``max|x - ref| / max(max|ref|, floor)``. The loss is L = sum(O * dO) (+ sum(LSE * dLSE)) with
seeded dO, and dL/dL is seeded with 1.0; a zero reference gradient fails the case (vacuous).
Fully masked query rows are checked directly (O = LSE = dQ = 0 exactly) and excluded from the
chain (soft_max_ext gives NaN there); fully masked key columns must give dK = dV = 0 exactly.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from hotggml import meta, ops, oracle
from hotggml.cases import Case
from hotggml.errors import BackendError, InputError
from hotggml.ffi import library_info
from hotggml.graph import Backend, Graph
from hotggml.probe import probe

BARS = {"f32": 1e-4, "tf32": 5e-3}
FLOOR = 1e-5
OUTPUTS = ("O", "LSE", "dQ", "dK", "dV")


def natural_magnitudes(case: Case) -> dict[str, float]:
    """Each output's natural magnitude at the case's inputs (SPEC §4), the error denominator where the
    reference is ~0 (cases tagged 'cancel'): |O| ~ |v|, dV ~ |dO| (P <= 1), dQ ~ scale |dO| |v| |k|,
    dK ~ scale |dO| |v| |q| (maxima over the inputs)."""
    x = case.inputs()
    amax = {name: float(np.max(np.abs(x[name]))) for name in ("q", "k", "v", "do")}
    return {"O": amax["v"], "dV": amax["do"],
            "dQ": case.scale * amax["do"] * amax["v"] * amax["k"],
            "dK": case.scale * amax["do"] * amax["v"] * amax["q"]}


def rel_err(x: np.ndarray, ref: np.ndarray, floor: float = FLOOR) -> float:
    """max|x - ref| / max(max|ref|, floor); inf when x has NaN/Inf where ref is finite."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise InputError(f"shape mismatch {x.shape} vs {ref.shape}")
    if x.size == 0:
        return 0.0
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), floor))


@dataclass
class ArmResult:
    """Values of one arm in the oracle's layouts: o (B,Nh,S,Dv), lse (B,Nh,S), dq/dk/dv like q/k/v."""

    o: np.ndarray
    lse: np.ndarray | None
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    lse_gap_zero: bool = True
    seconds: float = 0.0
    placement: dict = field(default_factory=dict)  # fused op name -> device the scheduler ran it on
    n_splits: int = 0


@dataclass
class CaseResult:
    """One record per case: what ran where, errors per output per reference, and the verdict."""

    case: str
    shape: str
    backend: str
    precision: str
    pin: str
    series_hash: str
    threads: list
    kernel: str = ""                                 # the kernel the fused nodes ran (Backend.fa_train_kernel)
    errors: dict = field(default_factory=dict)       # "fused~oracle" -> {output: err}
    checks: dict = field(default_factory=dict)       # named exact checks -> bool
    bar: float = 0.0
    chain_bar: float = 0.0
    passed: bool = False
    failures: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)    # fused op name -> device it ran on (the scheduler's word)
    n_splits: int = 0
    split: str = ""                                  # on a meta device: the rule the fused arm ran ('heads: ...')


def _o_layout(o_ggml: np.ndarray) -> np.ndarray:
    """O read from ggml [Dv, Nh, S, B] (NumPy (B, S, Nh, Dv)) -> oracle (B, Nh, S, Dv)."""
    return o_ggml.transpose(0, 2, 1, 3)


def _leaf_q(g: Graph, case: Case, q: np.ndarray):
    """q as a param; for q_view, the param is (B, S, Nh, D) and q a permuted non-contiguous view of it."""
    if not case.q_view:
        t = g.param(q, "q")
        return t, t
    base = g.param(q.transpose(0, 2, 1, 3), "q_base")  # ggml [D, Nh, S, B] (input() makes it contiguous)
    view = g.permute(base, 0, 2, 1, 3)                                          # ggml [D, S, Nh, B]
    assert not view.is_contiguous()
    return base, view


def _q_grad(g: Graph, case: Case, leaf) -> np.ndarray:
    grad = g.grad(leaf)
    return grad.transpose(0, 2, 1, 3) if case.q_view else grad


@dataclass
class FusedGraph:
    """Handles of a built fused fwd+bwd graph."""

    q_leaf: object
    k: object
    v: object
    fwd: object
    o: object
    lse: object
    fused_nodes: list


def _kv_leaf(g: Graph, case: Case, x: np.ndarray, name: str):
    """K or V of the fused arm: a param where the case trains it (dK / dV), an f32 input where it freezes it,
    and a frozen cache in its stored type otherwise (no gradient)."""
    kind = getattr(case, f"{name}_type")
    if kind != "f32":
        return g.cache(x, kind, name)
    return g.param(x, name) if case.kv_trained(name) else g.input(x, name)


def _inputs(g: Graph, case: Case, with_garbage: bool = False) -> dict:
    """The case's inputs, or for a reserve-only Graph their placeholders (shapes, no data)."""
    return case.placeholders() if g.reserve_only else case.inputs(with_garbage=with_garbage)


def _mask_placeholder(shape: tuple[int, ...] | None) -> np.ndarray | None:
    """A reserve-only Graph's mask: a zero-stride float16 view of that shape (None: no mask)."""
    return None if shape is None else np.broadcast_to(np.float16(0), shape)


def build_fused(g: Graph, case: Case, prec: str = "default") -> FusedGraph:
    """Fused forward + autodiff backward of L = sum(O*dO) (+ sum(LSE*dLSE)) at the case's shape, with
    its stored mask and its implicit masks (with NaN in k and v at the masked keys of a ``garbage`` case)."""
    x = _inputs(g, case, with_garbage=True)
    mask = _mask_placeholder(case.stored_mask_shape()) if g.reserve_only else case.stored_mask()
    q_leaf, q = _leaf_q(g, case, x["q"])
    k, v = (_kv_leaf(g, case, x[name], name) for name in ("k", "v"))
    m = g.input(mask[:, None], "mask") if mask is not None else None
    fwd = ops.flash_attn_train(g, q, k, v, m, case.scale, prec, causal=case.causal, window=case.window)
    o, lse = ops.get_o(fwd), ops.get_lse(fwd)
    terms = [(o, x["do"])] + ([(lse, x["dlse"])] if case.lse_loss else [])
    g.build([o, lse], g.dot_loss(terms))
    fused = g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN")) + g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN_BACK"))
    if len(fused) != 2:
        raise BackendError(f"expected one fused forward and one fused backward node, found {len(fused)}")
    return FusedGraph(q_leaf, k, v, fwd, o, lse, fused)


def run_fused(case: Case, backend: Backend, prec: str = "default", backward_on: str | None = None) -> ArmResult:
    """Fused forward + autodiff backward through ggml's scheduler over [backend, CPU], as a trainer
    runs it; poisons the fused outputs before compute and records where each fused node ran.

    ``backward_on``: pin the backward node to that backend (e.g. 'CPU' for the split test: the
    forward on the device, its bytes copied across the split to the backward).
    """
    with Graph(backend, scheduled=True) as g:
        h = build_fused(g, case, prec)
        if backward_on is not None:
            g.assign(h.fused_nodes[1], backward_on)
        secs = g.compute(poison=h.fused_nodes)
        res = read_fused(g, case, h, secs)
        where = dict((t.ptr, d) for t, d in g.placement())
        res.placement = {t.op_name: where[t.ptr] for t in h.fused_nodes}
        res.n_splits = g.n_splits
        return res


def read_fused(g: Graph, case: Case, h: FusedGraph, seconds: float = 0.0) -> ArmResult:
    """The computed fused arm's values in the oracle's layouts, and whether the O|LSE gap is zero."""
    packed = g.read(h.fwd).reshape(-1)
    n_o = int(np.prod(h.o.ne))
    lse_offs = h.lse.ptr.view_offs // 4
    return ArmResult(
        o=_o_layout(g.read(h.o)), lse=g.read(h.lse)[0].transpose(0, 2, 1),
        dq=_q_grad(g, case, h.q_leaf), dk=g.grad(h.k), dv=g.grad(h.v),
        lse_gap_zero=bool(np.all(packed[n_o:lse_offs] == 0)), seconds=seconds)


def run_fused_meta(case: Case, backend: Backend, prec: str = "default") -> tuple[ArmResult, str]:
    """The fused arm on a meta device (Backend.meta), and the rule it ran ('heads: ...' or 'mirrored: why').

    q, k, v are split by heads in whole GQA groups where meta.heads_rule allows (Nkv divisible by the device
    count), else mirrored. The loss's reduction (sum(O * dO)) is no op the meta backend splits at this pin, so
    the backward node is built as autodiff builds it for that loss: d = dO (the packed [dO | 0 | dLSE] with an
    LSE term), the gradients q, k, v need; the results are read from its views.
    """
    with Graph(backend, scheduled=True) as g:
        x = case.inputs(with_garbage=True)
        mask = case.stored_mask()
        q_leaf, q = _leaf_q(g, case, x["q"])
        k, v = (_kv_leaf(g, case, x[name], name) for name in ("k", "v"))
        m = g.input(mask[:, None], "mask") if mask is not None else None
        grads = "q" + "".join(name for name in "kv" if case.kv_trained(name))
        rule, why = meta.heads_rule(q.ne, k.ne, v.ne, backend.n_devices, grads)
        nh = [case.Nh // backend.n_devices] * backend.n_devices
        if rule == "heads":
            g.split(q_leaf, 1 if case.q_view else 2)  # q_base is [D, Nh, S, B]
            g.split(k, 2)
            g.split(v, 2)
        o_ne = (case.dv, case.Nh, case.S, case.B)
        if case.lse_loss:
            n_o = int(np.prod(o_ne))
            lse_at = -(-n_o // meta.FLOATS_ALIGN) * meta.FLOATS_ALIGN
            packed = np.zeros(lse_at + case.Nh * case.S * case.B, np.float32)
            packed[:n_o], packed[lse_at:] = x["do"].reshape(-1), x["dlse"].reshape(-1)
            d = g.input(packed, "d")
            if rule == "heads":
                g._split_state(d, 0, *meta.packed_forward_split(case.dv, nh, case.S, case.B))
        else:
            d = g.input(x["do"], "dO")
            if rule == "heads":
                g.split(d, 1)
        fwd = ops.flash_attn_train(g, q, k, v, m, case.scale, prec, causal=case.causal, window=case.window)
        o, lse = ops.get_o(fwd), ops.get_lse(fwd)
        back = ops.flash_attn_train_back(g, fwd, d, grads)
        views = {name: getattr(ops, f"get_d{name}")(back) for name in grads}
        g.build([o, lse, *views.values()])
        secs = g.compute(poison=[fwd, back])
        packed_fwd = g.read(fwd).reshape(-1)
        n_o, lse_offs = int(np.prod(o.ne)), lse.ptr.view_offs // 4
        res = ArmResult(o=_o_layout(g.read(o)), lse=g.read(lse)[0].transpose(0, 2, 1),
                        dq=g.read(views["q"]), dk=g.read(views["k"]) if "k" in views else None,
                        dv=g.read(views["v"]) if "v" in views else None,
                        lse_gap_zero=bool(np.all(packed_fwd[n_o:lse_offs] == 0)), seconds=secs)
        where = dict((t.ptr, dev) for t, dev in g.placement())
        res.placement = {t.op_name: where[t.ptr] for t in (fwd, back)}
        res.n_splits = g.n_splits
        return res, f"{rule}: {why}"


def _expand_gqa(g: Graph, t, Nh: int):
    """[d, Skv, Nkv, B] -> [d, Skv, Nh, B] with head h reading kv head h // (Nh/Nkv) (repeat, not tile)."""
    d, skv, nkv, b = t.ne
    if nkv == Nh:
        return t
    flat = g.reshape(t, (d * skv, 1, nkv, b))
    rep = g.repeat(flat, g.new_tensor((d * skv, Nh // nkv, nkv, b)))
    return g.reshape(rep, (d, skv, Nh, b))


@dataclass
class ChainGraph:
    q_leaf: object
    k: object
    v: object
    o: object


def build_chain(g: Graph, case: Case) -> ChainGraph:
    """Exact chain mul_mat -> soft_max_ext -> mul_mat, differentiated by ggml's autodiff.

    Fully masked rows are unmasked for the chain and their dO rows zeroed (soft_max_ext gives NaN
    there); they are excluded from O/dQ diffs, and contribute nothing to dK/dV either way.
    """
    x = _inputs(g, case)
    mask = _mask_placeholder(case.mask_array_shape()) if g.reserve_only else case.mask_array()
    do = x["do"].copy() if not g.reserve_only else x["do"]
    if mask is not None and not g.reserve_only:
        dead = oracle.masked_rows(mask, case.B, case.S)
        if dead.any():
            mask = mask.copy()
            for b, i in zip(*np.nonzero(dead)):
                mask[b if mask.shape[0] > 1 else 0, i, :] = 0
                do[b, i] = 0
    q_leaf, q = _leaf_q(g, case, x["q"])
    k, v = g.param(x["k"], "k"), g.param(x["v"], "v")
    m = g.input(mask[:, None], "mask") if mask is not None else None
    ke = _expand_gqa(g, k, case.Nh)
    ve = _expand_gqa(g, v, case.Nh)
    kq = g.mul_mat(ke, q)                                   # [Skv, S, Nh, B]
    p = g.soft_max_ext(kq, m, case.scale)
    vt = g.cont(g.permute(ve, 1, 0, 2, 3))                  # [Skv, Dv, Nh, B]
    kqv = g.mul_mat(vt, p)                                  # [Dv, S, Nh, B]
    o = g.cont(g.permute(kqv, 0, 2, 1, 3))                  # [Dv, Nh, S, B]
    g.build([o], g.dot_loss([(o, do)]))
    return ChainGraph(q_leaf, k, v, o)


def run_chain(case: Case, backend: Backend) -> ArmResult:
    """The exact chain on ``backend`` (see build_chain)."""
    with Graph(backend) as g:
        h = build_chain(g, case)
        secs = g.compute()
        return ArmResult(o=_o_layout(g.read(h.o)), lse=None, dq=_q_grad(g, case, h.q_leaf),
                         dk=g.grad(h.k), dv=g.grad(h.v), seconds=secs)


def run_oracle(case: Case, progress: Callable[[str], None] | None = None) -> ArmResult:
    """The float64 reference, one query head at a time (hotggml.oracle on a single head and its kv
    head), so memory holds one head's (S, Skv) matrices: the long-context chunk fits. Heads run on a
    thread pool (NumPy releases the GIL in BLAS and ufuncs) sized by cores and free memory; dK/dV of a
    kv head are the sum over its query heads, added in head order whatever the completion order.
    ``progress`` is told of each head as it is collected (the chunk's heads take most of a minute each on 2 cores)."""
    x = case.inputs()
    mask = case.mask_array()
    dlse = None if x["dlse"] is None else x["dlse"].transpose(0, 2, 1)
    do = x["do"].transpose(0, 2, 1, 3)
    q, k, v = x["q"], x["k"], x["v"]
    B, Nh, S, _ = q.shape
    G = Nh // k.shape[1]

    def head(h: int):
        one, kv = slice(h, h + 1), slice(h // G, h // G + 1)
        return oracle.attention_forward_backward(q[:, one], k[:, kv], v[:, kv], mask, case.scale, do[:, one],
                                                 None if dlse is None else dlse[:, one])

    t0 = time.perf_counter()
    per_head = []
    with ThreadPoolExecutor(max_workers=_oracle_workers(case)) as pool:
        for h, result in enumerate(pool.map(head, range(Nh)), start=1):
            per_head.append(result)
            if progress is not None:
                progress(f"oracle head {h}/{Nh} ({time.perf_counter() - t0:.0f} s)")
    o = np.concatenate([r[0] for r in per_head], axis=1)
    lse = np.concatenate([r[1] for r in per_head], axis=1)
    dq = np.concatenate([r[2] for r in per_head], axis=1)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    for h, r in enumerate(per_head):
        dk[:, h // G: h // G + 1] += r[3]
        dv[:, h // G: h // G + 1] += r[4]
    return ArmResult(o=o, lse=lse, dq=dq, dk=dk, dv=dv, seconds=time.perf_counter() - t0)


def _oracle_workers(case: Case) -> int:
    """Threads for run_oracle: one per core, fewer when ~10 float64 (B, S, Skv) matrices per head would
    not fit in the memory available now."""
    per_head = 10 * 8 * case.B * case.S * case.Skv
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = per_head
    return max(1, min(os.cpu_count() or 1, case.Nh, int(0.7 * free) // per_head))


def _compare(arm: ArmResult, ref: ArmResult, live: np.ndarray, grads: bool = True,
             floors: dict[str, float] | None = None) -> dict[str, float]:
    """Errors per output over live (not fully masked) rows; LSE only when both arms have it;
    gradients only when both arms differentiated the same loss (``grads``). ``floors``: per-output
    denominators for references that are ~0 (natural_magnitudes)."""
    floors = floors or {}
    live_o = live[:, None, :]  # (B, 1, S) broadcast over heads
    errs = {"O": rel_err(np.where(live_o[..., None], arm.o, 0), np.where(live_o[..., None], ref.o, 0))}
    if grads:
        errs["dQ"] = rel_err(np.where(live_o[..., None], arm.dq, 0), np.where(live_o[..., None], ref.dq, 0),
                             floors.get("dQ", FLOOR))
        if arm.dk is not None and ref.dk is not None:  # a K cache in a stored type has no dK
            errs["dK"] = rel_err(arm.dk, ref.dk, floors.get("dK", FLOOR))
        if arm.dv is not None and ref.dv is not None:
            errs["dV"] = rel_err(arm.dv, ref.dv)
    if arm.lse is not None and ref.lse is not None:
        errs["LSE"] = rel_err(np.where(live_o, arm.lse, 0), np.where(live_o, ref.lse, 0))
    return errs


def _d_i_error(case: Case, arm: ArmResult, ref: ArmResult, live: np.ndarray) -> float:
    """Error of D_i = dO_i . O_i - dLSE_i (the row term of dS = P (dP - D_i)) formed from the arm's O against
    the oracle's, over live rows: the O the backward reads, weighted as the backward weighs it, checked apart
    from dQ (a tiny dO makes dQ's own error tiny in absolute terms, whatever D_i does)."""
    x = case.inputs()
    do = x["do"].transpose(0, 2, 1, 3).astype(np.float64)  # (B, Nh, S, Dv), the oracle's O layout
    dlse = 0.0 if x["dlse"] is None else x["dlse"].transpose(0, 2, 1).astype(np.float64)
    live_o = live[:, None, :]
    d_arm, d_ref = (np.sum(do * np.asarray(o, np.float64), axis=-1) - dlse for o in (arm.o, ref.o))
    return rel_err(np.where(live_o, d_arm, 0), np.where(live_o, d_ref, 0))


# kernels whose dS = P (dP - D_i) cancels exactly on a row with one visible key (D_i summed like dP); the others
# (TF32, the compensated f32 product) cancel to f32 rounding: within ONE_KEY_CANCEL of the natural magnitude
EXACT_CANCEL_KERNELS = ("f32-cpu", "f32-scalar")
ONE_KEY_CANCEL = 1e-6


def _zeros(grad: np.ndarray | None, index) -> bool:
    """Whether grad[index] is all zeros; True for a gradient the op does not compute (a frozen cache's)."""
    return grad is None or bool(np.all(grad[index] == 0))


def _exact_checks(case: Case, fused: ArmResult, ref: ArmResult, kernel: str) -> dict[str, bool]:
    mask = case.mask_array()
    checks = {"lse_gap_zero": fused.lse_gap_zero,
              # a K or V in a stored type is a frozen cache (as is a frozen f32 one): autodiff asks no gradient
              # for it, a trained f32 one gets its own
              "grads_only_for_f32_kv": (fused.dk is None) != case.kv_trained("k") and (fused.dv is None) != case.kv_trained("v")}
    # a 'cancel' case's dQ and dK are ~0 by construction; its dV still guards against vacuity
    for name in (("dV",) if "cancel" in case.tags else ("dQ", "dK", "dV")):
        checks[f"{name}_ref_nonzero"] = bool(np.max(np.abs(getattr(ref, name.lower()))) > 0)
    if "one-hot" in case.tags:
        # every row sees one key (or a saturated softmax makes it so): dQ = dK = 0, exactly where D_i is summed
        # like dP, to f32 rounding of the natural magnitude on the other kernels, as the exact chain does (SPEC §4)
        tol = 0.0 if kernel in EXACT_CANCEL_KERNELS else ONE_KEY_CANCEL
        nat = natural_magnitudes(case)
        checks["one_key_dQ_dK_cancel"] = bool(np.max(np.abs(fused.dq)) <= tol * nat["dQ"]
                                               and (fused.dk is None or np.max(np.abs(fused.dk)) <= tol * nat["dK"]))
    if case.garbage:
        checks["garbage_keys_dK_dV_zero"] = bool(all(
            _zeros(fused.dk, (b, slice(None), j)) and _zeros(fused.dv, (b, slice(None), j))
            for b, j in zip(*np.nonzero(case.dead_keys()))))
    if mask is None:
        return checks
    dead = oracle.masked_rows(mask, case.B, case.S)
    if dead.any():
        b, i = np.nonzero(dead)
        checks["masked_rows_O_zero"] = bool(np.all(fused.o[b, :, i] == 0))
        checks["masked_rows_LSE_zero"] = bool(np.all(fused.lse[b, :, i] == 0))
        checks["masked_rows_dQ_zero"] = bool(np.all(fused.dq[b, :, i] == 0))
    m = mask[:, : case.S]
    dead_cols = np.all(np.isneginf(m.astype(np.float32)), axis=1)  # (Bm, Skv)
    if dead_cols.any():
        bm, j = np.nonzero(dead_cols)
        bs = range(case.B) if mask.shape[0] == 1 else None
        for b_m, jj in zip(bm, j):
            for b in (bs if bs is not None else [b_m]):
                checks.setdefault("masked_cols_dK_dV_zero", True)
                ok = _zeros(fused.dk, (b, slice(None), jj)) and _zeros(fused.dv, (b, slice(None), jj))
                checks["masked_cols_dK_dV_zero"] &= ok
    return checks


def run_case(case: Case, device: str = "CPU", threads: list[int] | None = None, prec: str = "f32",
             with_chain: bool = True, progress: Callable[[str], None] | None = None, server=None) -> CaseResult:
    """All arms of one case; the fused arm runs once per CPU thread count (twice on another device)
    and every run must be bitwise identical. ``progress`` is told of each arm as it ends (and of the oracle's
    heads): one case of the field set runs for minutes on a CPU.

    ``device`` 'RPC[host:port]' runs the arms on that RPC server's first device. ``server``: the
    hotggml.rpc.Server behind it, whose own record must then hold one FLASH_ATTN_TRAIN and one
    FLASH_ATTN_TRAIN_BACK computed per fused run (check ``fused_nodes_in_server_record``): the client's placement
    alone cannot tell, as RPC's supports_op says yes to every op. Raises InputTypeError / UsageError for a
    ``server`` that is not an open Server, InputError when it does not serve ``device``."""
    say = progress or (lambda text: None)
    if server is not None:
        from hotggml import rpc

        rpc.need_server(server)
        if device != server.device_name:
            raise InputError(f"server serves {server.device_name}, not the device {device!r}")
    threads = threads or ([None] if device.upper() == "CPU" else [None, None])
    info = library_info()
    with Backend(device) as be:  # fail fast, by name, before any arm runs; the path the library reports
        path = probe(case, be, "f32" if prec == "f32" else "default")
        device_name = be.device_name
        on_cpu = device_name == "CPU" or be.remote == "CPU"  # a CPU served over RPC by this process
    mark = len(server.computed_ops()) if server is not None else 0
    res = CaseResult(case.id, case.shape, device, path.precision, info["pin"], info["series_hash"],
                     threads=list(threads), kernel=path.kernel, bar=BARS[path.precision])
    ref = run_oracle(case, progress)
    res.seconds["oracle"] = ref.seconds
    say(f"oracle done ({ref.seconds:.1f} s)")
    fused_runs = []
    simple = meta.parse_name(device)  # a meta device: the fused arm split by heads (or mirrored), once per run
    for n in threads:
        with Backend(device, n_threads=n) as be:
            if simple is None:
                fused_runs.append(run_fused(case, be, "f32" if prec == "f32" else "default"))
            else:
                run, res.split = run_fused_meta(case, be, "f32" if prec == "f32" else "default")
                fused_runs.append(run)
        say(f"fused{'' if n is None else f' at {n} thread(s)'} done ({fused_runs[-1].seconds:.1f} s)")
    fused = fused_runs[0]
    res.seconds["fused"] = fused.seconds
    res.placement, res.n_splits = fused.placement, fused.n_splits
    live = ~oracle.masked_rows(case.mask_array(), case.B, case.S)
    floors = natural_magnitudes(case) if "cancel" in case.tags else None
    if case.do_scale != 1.0:  # gradients scale with dO: so does the absolute floor under their relative errors
        floors = {name: FLOOR * case.do_scale for name in ("dQ", "dK", "dV")}
    res.errors["fused~oracle"] = _compare(fused, ref, live, floors=floors)
    extra_checks = {}
    if "d_i" in case.tags:
        res.errors["fused~oracle"]["D_i"] = _d_i_error(case, fused, ref, live)
        # a tiny dO's dQ is measured against its own size, not against rel_err's floor
        extra_checks["dQ_ref_above_floor"] = bool(np.max(np.abs(ref.dq)) >= 10 * (floors or {}).get("dQ", FLOOR))
    if simple is not None:
        # the claim of a meta device: its results are one device's, bit for bit (the first of its devices, the
        # fused arm as a trainer runs it there: autodiff's backward)
        with Backend(simple[0], n_threads=threads[-1]) as be:
            one = run_fused(case, be, "f32" if prec == "f32" else "default")
        say(f"fused on one {simple[0]} done ({one.seconds:.1f} s)")
    if with_chain:
        # on a meta device the chain (a reference, not the claim) runs on its first device: the meta backend
        # reads no strided gradient, and the chain's q_view gradient is one
        with Backend(device if simple is None else simple[0], n_threads=threads[-1]) as be:
            chain = run_chain(case, be)
        res.seconds["chain"] = chain.seconds
        say(f"chain done ({chain.seconds:.1f} s)")
        # the chain has no LSE: with an LSE term in the loss only its O is comparable
        res.errors["chain~oracle"] = _compare(chain, ref, live, grads=not case.lse_loss, floors=floors)
        res.errors["fused~chain"] = _compare(fused, chain, live, grads=not case.lse_loss, floors=floors)
    res.checks = _exact_checks(case, fused, ref, path.kernel) | extra_checks
    # a node the device refuses would run on the CPU without an error: prove where they ran
    res.checks["fused_nodes_on_backend"] = all(
        sorted(run.placement) == ["FLASH_ATTN_TRAIN", "FLASH_ATTN_TRAIN_BACK"]
        and set(run.placement.values()) == {device_name} for run in fused_runs)
    if server is not None:  # the server's own word: each fused run's two nodes were computed there
        computed = server.computed_ops(since=mark)
        res.checks["fused_nodes_in_server_record"] = (computed.count("FLASH_ATTN_TRAIN") == len(fused_runs)
                                                      and computed.count("FLASH_ATTN_TRAIN_BACK") == len(fused_runs))
    if simple is not None:
        res.checks["bitwise_vs_one_device"] = all(
            _same(getattr(run, f), getattr(one, f)) for run in fused_runs for f in ("o", "lse", "dq", "dk", "dv"))
    if len(fused_runs) > 1:
        res.checks["bitwise_across_runs"] = all(
            all(np.array_equal(getattr(a, f), getattr(fused, f)) for f in ("o", "lse", "dq", "dk", "dv"))
            for a in fused_runs[1:])
    # the chain is a reference too: it must itself agree with the oracle, at the f32 bar on the CPU and at
    # the TF32 bar elsewhere (ggml's CUDA mul_mat multiplies f32 on TF32 tensor cores, ~5e-4 seen on an H200)
    # (a CPU served over RPC is a CPU; a meta device's chain ran on its first device)
    res.chain_bar = BARS["f32"] if (on_cpu if simple is None else simple[0].upper() == "CPU") else BARS["tf32"]
    bars = {"fused~oracle": res.bar, "fused~chain": max(res.bar, res.chain_bar), "chain~oracle": res.chain_bar}
    res.failures = [f"{arm} {out} {err:.2e} > {bars[arm]:.0e}" for arm, errs in res.errors.items()
                    for out, err in errs.items() if not err <= bars[arm]]
    res.failures += [f"check {name} failed" for name, ok in res.checks.items() if not ok]
    res.passed = not res.failures
    return res


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Bitwise equality of two arm outputs (both None where the arm computes no such gradient)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def table(results: list[CaseResult]) -> str:
    """Fixed-width table: one line per case, worst fused~oracle error per output, checks, verdict."""
    head = (f"{'case':<24} {'shape':<44} {'kernel':<24} " + " ".join(f"{o:>8}" for o in OUTPUTS)
            + f" {'chain':>8}  result")
    lines = [head, "-" * len(head)]
    for r in results:
        fo = r.errors.get("fused~oracle", {})
        co = r.errors.get("chain~oracle", {})
        chain_worst = f"{max(co.values()):8.1e}" if co else f"{'-':>8}"  # '-': run without the chain arm
        cells = " ".join(f"{fo[o]:8.1e}" if o in fo else f"{'-':>8}" for o in OUTPUTS)
        lines.append(f"{r.case:<24} {r.shape:<44} {r.kernel:<24} {cells} {chain_worst}  "
                     + ("PASS" if r.passed else "FAIL: " + "; ".join(r.failures)))
    return "\n".join(lines + legend(results))


def legend(results: list[CaseResult]) -> list[str]:
    """What the table's columns are, and the bars and threads that applied (printed under it)."""
    if not results:
        return []
    bars = sorted({(r.precision, r.bar) for r in results})
    chain_bars = sorted({r.chain_bar for r in results if r.errors.get("chain~oracle")})
    threads = sorted({"default" if n is None else str(n) for r in results for n in r.threads})
    return [
        "",
        "O, LSE, dQ, dK, dV: worst relative error of the fused op against the float64 oracle, max|x - ref| /",
        f"  max(max|ref|, {FLOOR:g}); chain: the exact chain's worst against the oracle; '-': not computed.",
        "kernel: what the fused nodes ran, as the library reports it (precision-family[-instance-shared-memory class]).",
        "bars: fused " + ", ".join(f"{prec} {bar:g}" for prec, bar in bars)
        + (f"; chain {', '.join(f'{b:g}' for b in chain_bars)}" if chain_bars else "")
        + "; a case also needs its exact checks (bitwise reruns, placement, zeros where masked).",
        f"backend {', '.join(sorted({r.backend for r in results}))}; CPU threads per run: {', '.join(threads)}.",
    ] + ([f"meta device: the fused arm split by heads in whole GQA groups where Nkv divides by the device count, "
          f"else mirrored ({sum(r.split.startswith('heads') for r in results)} of {len(results)} cases by heads); "
          "bitwise_vs_one_device: every output equal, bit for bit, to the fused arm on one device."]
         if any(r.split for r in results) else [])


def to_json(results: list[CaseResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=1)
