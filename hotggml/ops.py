"""Thin, validated wrappers for the fused flash-attention training ops (SPEC §4).

Every check that ggml would make with GGML_ASSERT (which kills the interpreter) is made here
first and raises ValueError (shapes) or TypeError (dtypes) naming the argument.

Shapes in ggml order: q [D, S, Nh, B] f32, k [D, Skv, Nkv, B] and v [Dv, Skv, Nkv, B] each f32, f16,
bf16 or q8_0 (a frozen cache in its stored type: Graph.cache; no gradient), any strides with the rows
contiguous, mask [Skv, S', 1, 1 or B] f16 contiguous with S' >= S, or None.
"""

from __future__ import annotations

import numpy as np

from hotggml import kvcache
from hotggml.ffi import ffi
from hotggml.graph import FLAG_PARAM, Graph, Tensor, check_scale
from hotggml.errors import InputError, InputTypeError

PREC = {"default": 0, "f32": 10}  # enum ggml_prec: GGML_PREC_DEFAULT (TF32 on CUDA sm_80+), GGML_PREC_F32
PREC_NAME = {v: k for k, v in PREC.items()}


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """Raise TypeError/ValueError unless q, k, v, mask satisfy the op contract (SPEC §4)."""
    if q.type_name != "f32":
        raise InputTypeError(f"q must be float32, got {q.type_name}")
    if q.nb[0] != 4:
        raise InputError(f"q rows must be contiguous (nb[0] == 4), got nb {q.nb}")
    for name, t in (("k", k), ("v", v)):
        if t.type_name not in kvcache.TYPES:
            raise InputTypeError(f"{name} must be one of {', '.join(kvcache.TYPES)} (a cache: Graph.cache), got {t.type_name}")
        if t.type_name != "f32" and int(t.ptr.flags) & FLAG_PARAM:
            raise InputTypeError(f"{name} is a {t.type_name} param: a K/V in a stored type is a frozen cache and takes "
                                 "no gradient; make it f32 to train it")
        kvcache.check_row(t.type_name, t.ne[0], f"{name}: a row")
        if t.nb[0] != kvcache.row_bytes(t.type_name, kvcache.QK8_0 if t.type_name == "q8_0" else 1):
            raise InputError(f"{name} rows must be contiguous in {t.type_name}, got nb {t.nb}")
    D, S, Nh, B = q.ne
    if k.ne[0] != D:
        raise InputError(f"k: D = {k.ne[0]} differs from q's D = {D}")
    if v.ne[1:3] != k.ne[1:3]:
        raise InputError(f"v: [Skv, Nkv] = {v.ne[1:3]} differs from k's {k.ne[1:3]}")
    if Nh % k.ne[2]:
        raise InputError(f"GQA needs Nh % Nkv == 0, got Nh = {Nh}, Nkv = {k.ne[2]}")
    if k.ne[3] != B or v.ne[3] != B:
        raise InputError(f"batch differs: q {B}, k {k.ne[3]}, v {v.ne[3]}")
    if mask is not None:
        if mask.type_name != "f16":  # by type name: a bf16 or q8_0 tensor has no NumPy dtype to name
            raise InputTypeError(f"mask must be f16, got {mask.type_name}")
        if not mask.is_contiguous():
            raise InputError("mask must be contiguous")
        Skv = k.ne[1]
        if mask.ne[0] != Skv or mask.ne[1] < S or mask.ne[2] != 1 or mask.ne[3] not in (1, B):
            raise InputError(f"mask must be [Skv={Skv}, S'>={S}, 1, 1 or {B}], got {mask.ne}")


def head_split(g: Graph, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[int, ...] | None:
    """The query heads per device when q, k, v are split by heads on a meta backend (Graph.split on ne[2]), or
    None when every operand is mirrored. Raises InputError for anything else flash-attn-train-meta would abort
    on: q, k, v not all split on axis 2 in whole GQA groups (Nh_j = Nh/Nkv * Nkv_j), a split mask, or devices'
    parts whose alignment gaps do not add up (meta.heads_rule picks shapes that split)."""
    from hotggml import meta

    if not g.backend.is_meta:
        return None
    sq, sk, sv = (g.split_of(t) for t in (q, k, v))
    sm = g.split_of(mask) if mask is not None else None
    if sq is None and sk is None and sv is None and sm is None:
        return None
    G = q.ne[2] // k.ne[2]
    ok = sm is None and all(s is not None and s[0] == 2 and s[2] == (1,) for s in (sq, sk, sv))
    ok = ok and sk[1] == sv[1] and all(a == G * b for a, b in zip(sq[1], sk[1]))
    if not ok:
        def name(s):
            return "mirrored" if s is None else f"axis {s[0]} {list(s[1])}"
        raise InputError(f"on {g.backend.device_name} flash_attn_train takes q, k, v split by heads in whole GQA groups "
                         f"(Graph.split(t, 2) with {G} query heads per kv head on each device) and the mask mirrored, or "
                         f"every operand mirrored; got q {name(sq)}, k {name(sk)}, v {name(sv)}, mask {name(sm)}")
    nh = sq[1]
    D, S, _, B = q.ne
    if not meta.gaps_add_up([v.ne[0] * h * S * B for h in nh]):
        raise InputError(f"on {g.backend.device_name}: a device's part of O (Dv * its heads * S * B floats) is not a "
                         "multiple of 4 floats, so the packed result cannot be split by heads: mirror q, k, v")
    return nh


def _check_prec(prec: str) -> int:
    """enum ggml_prec of a precision name; InputTypeError / InputError for anything else (before any C call)."""
    if not isinstance(prec, str):
        raise InputTypeError(f"precision must be a str, one of {sorted(PREC)}, got {type(prec).__name__}")
    if prec not in PREC:
        raise InputError(f"precision must be one of {sorted(PREC)}, got {prec!r}")
    return PREC[prec]


def get_prec(t: Tensor) -> str:
    """Requested precision of a flash_attn_train(_back) node: 'default' or 'f32'."""
    if not isinstance(t, Tensor):
        raise InputTypeError(f"get_prec needs a flash_attn_train(_back) node (a hotggml Tensor), got {type(t).__name__}")
    if t.op not in (op_id("FLASH_ATTN_TRAIN"), op_id("FLASH_ATTN_TRAIN_BACK")):
        raise InputError(f"get_prec needs a flash_attn_train(_back) node, got a {t.op_name} node")
    return PREC_NAME.get(int(t.graph.lib.ggml_flash_attn_train_get_prec(t.ptr)), "unknown")


WINDOW_MAX = 2**31 - 1  # the window is an int32 op_param


def flash_attn_train(g: Graph, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     prec: str = "default", causal: bool = False, window: int | None = None) -> Tensor:
    """Packed forward: O [Dv, Nh, S, B] at 0 and LSE [Nh, S, B] after it (views: get_o, get_lse).

    LSE_i = log sum_j exp(scale*q_i.k_j + mask_ij) (natural log). prec: 'default' (TF32 tensor cores on
    CUDA sm_80+) or 'f32' (f32 accuracy: on CUDA sm_80+ at D = Dv in {64, 128, 256} a compensated 3xTF32
    product, elsewhere scalar f32; the CPU is f32 either way).
    Implicit masks (ggml.h, never stored), with i' = i + Skv - S: ``causal`` shows key j to query i
    iff j <= i'; ``window`` (an int >= 0) iff |i' - j| <= window. They combine with each other and with
    ``mask``: an entry is visible iff every one allows it. The autodiff backward inherits them.
    """
    g.own(q, k, v, *([mask] if mask is not None else []))
    check_attention_inputs(q, k, v, mask)
    scale = check_scale("flash_attn_train", scale)
    prec_id = _check_prec(prec)
    if mask is not None:  # a leaf's values are at hand before compute: +INF and NaN refused by name
        g.mark_mask(mask, "mask")
    if not isinstance(causal, (bool, np.bool_)):
        raise InputTypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
            raise InputTypeError(f"window must be an int or None, got {type(window).__name__}")
        if not 0 <= window <= WINDOW_MAX:
            raise InputError(f"window must be in [0, {WINDOW_MAX}] (or None for no window), got {window}")
    head_split(g, q, k, v, mask)  # on a meta backend: split by heads or mirrored, else InputError before C
    t = Tensor(g, g.lib.ggml_flash_attn_train(g.ctx, q.ptr, k.ptr, v.ptr, mask.ptr if mask else ffi.NULL, float(scale)))
    g.lib.ggml_flash_attn_train_set_prec(t.ptr, prec_id)
    if causal or window is not None:
        g.lib.ggml_flash_attn_train_set_implicit_mask(t.ptr, bool(causal), -1 if window is None else int(window))
    return t


def get_implicit_mask(t: Tensor) -> tuple[bool, int | None]:
    """(causal, window or None) of a flash_attn_train(_back) node, as its op_params say."""
    if not isinstance(t, Tensor):
        raise InputTypeError(f"get_implicit_mask needs a flash_attn_train(_back) node (a hotggml Tensor), got {type(t).__name__}")
    if t.op not in (op_id("FLASH_ATTN_TRAIN"), op_id("FLASH_ATTN_TRAIN_BACK")):
        raise InputError(f"get_implicit_mask needs a flash_attn_train(_back) node, got a {t.op_name} node")
    window = int(t.graph.lib.ggml_flash_attn_train_get_window(t.ptr))
    return bool(t.graph.lib.ggml_flash_attn_train_get_causal(t.ptr)), (None if window < 0 else window)


def op_id(name: str) -> int:
    """The enum ggml_op value of GGML_OP_<name> in the loaded library's declarations (generated from its
    headers: the patch appends the training ops, so their ids are the built tree's, not literals)."""
    from hotggml.ffi import load

    try:
        return int(getattr(load(), f"GGML_OP_{name}"))
    except AttributeError:
        raise InputError(f"the loaded ggml has no GGML_OP_{name}") from None


def __getattr__(name: str) -> int:
    """OP_FLASH_ATTN_TRAIN, OP_FLASH_ATTN_TRAIN_BACK (and any OP_<NAME>): op ids read when first used."""
    if name.startswith("OP_"):
        try:
            return op_id(name[3:])
        except InputError as exc:  # an attribute lookup: hasattr() and getattr(..., default) expect AttributeError
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {exc}") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _need_op(t: Tensor, op: int, what: str) -> None:
    if t.op != op:
        want = "flash_attn_train" if op == op_id("FLASH_ATTN_TRAIN") else "flash_attn_train_back"
        raise InputError(f"{what} must be a {want} node, got a {t.op_name} node")


def _view(node: Tensor, op: int, what: str, getter: str) -> Tensor:
    """One of the C view getters of a packed node, after checking the node's op (ggml asserts it)."""
    if not isinstance(node, Tensor):
        raise InputTypeError(f"{what} must be a hotggml Tensor, got {type(node).__name__}")
    node.graph.own(node)  # a view is a tensor object: ggml aborts where the context has no room for it
    _need_op(node, op, what)
    return Tensor(node.graph, getattr(node.graph.lib, getter)(node.graph.ctx, node.ptr))


def get_o(fwd: Tensor) -> Tensor:
    """View O [Dv, Nh, S, B] of a packed forward."""
    return _view(fwd, op_id("FLASH_ATTN_TRAIN"), "fwd", "ggml_flash_attn_train_get_o")


def get_lse(fwd: Tensor) -> Tensor:
    """View LSE [Nh, S, B] of a packed forward."""
    return _view(fwd, op_id("FLASH_ATTN_TRAIN"), "fwd", "ggml_flash_attn_train_get_lse")


# the gradients a backward node computes: ggml's GGML_FA_TRAIN_GRAD_* bits, by letter
GRAD_BITS = {"q": 1, "k": 2, "v": 4}


def flash_attn_train_back(g: Graph, fwd: Tensor, d: Tensor, grads: str = "qkv") -> Tensor:
    """Packed fused backward of a forward node: the gradients named in ``grads`` (letters of "qkv", each at
    most once), packed in q, k, v order; d is dO [Dv, Nh, S, B] or the packed gradient [O | LSE].

    A gradient not asked for gets neither memory nor work (a frozen K/V cache: ``grads="q"``). Precision,
    scale and implicit masks are copied from fwd. Views: get_dq, get_dk, get_dv (each raises InputError for a
    gradient the node does not compute). Raises InputError / InputTypeError for bad arguments.
    """
    if not isinstance(grads, str) or not grads or any(c not in GRAD_BITS for c in grads) or len(set(grads)) != len(grads):
        raise InputError(f"grads must name some of q, k, v once each (e.g. 'qkv', 'q'), got {grads!r}")
    g.own(fwd, d)
    _need_op(fwd, op_id("FLASH_ATTN_TRAIN"), "fwd")
    q, k, v, mask = (fwd.ptr.src[i] for i in range(4))
    for letter, t in (("k", k), ("v", v)):
        if letter in grads and t.type != g.lib.GGML_TYPE_F32:
            kind = ffi.string(g.lib.ggml_type_name(t.type)).decode()
            raise InputError(f"grads names {letter}, but {letter} is a {kind} cache: a K/V in a stored type takes no gradient")
    if d.dtype != np.float32 or not d.is_contiguous():
        raise InputTypeError("d must be contiguous float32")
    o_ne = (int(v.ne[0]), int(q.ne[2]), int(q.ne[1]), int(q.ne[3]))  # [Dv, Nh, S, B]
    if d.ne != o_ne and d.ne != fwd.ne:
        raise InputError(f"d must be shaped like O {o_ne} or like the packed forward {fwd.ne}, got {d.ne}")
    bits = sum(GRAD_BITS[c] for c in grads)
    if g.backend.is_meta:
        _check_back_split(g, fwd, d, grads)
    return Tensor(g, g.lib.ggml_flash_attn_train_back_ext(g.ctx, q, k, v, mask, fwd.ptr, d.ptr, bits))


def _check_back_split(g: Graph, fwd: Tensor, d: Tensor, grads: str) -> None:
    """On a meta backend, InputError unless d is split as the forward's heads are (dO on axis 1; the packed
    gradient as meta.packed_forward_split) and the gradients' parts split (their alignment gaps add up)."""
    from hotggml import meta

    q, k, v, mask = (Tensor(g, fwd.ptr.src[i]) if fwd.ptr.src[i] != ffi.NULL else None for i in range(4))
    nh = head_split(g, q, k, v, mask)
    got = g.split_of(d)
    if nh is None:
        if got is not None:
            raise InputError(f"d is split but the forward's q, k, v are mirrored on {g.backend.device_name}: mirror d")
        return
    D, S, Nh, B = q.ne
    if d.ne == fwd.ne:
        ne, nr = meta.packed_forward_split(v.ne[0], list(nh), S, B)
        want = (0, tuple(ne), tuple(nr))
    else:
        want = (1, tuple(nh), (1,))
    if got != want:
        raise InputError(f"d must be split by the forward's heads on {g.backend.device_name}: "
                         f"{'Graph._split_state(d, 0, *meta.packed_forward_split(..))' if d.ne == fwd.ne else 'Graph.split(d, 1, parts)'}"
                         f" with {want[1]}, got {'mirrored' if got is None else got}")
    G = Nh // k.ne[2]
    nkv = [h // G for h in nh]
    parts = {"q": [D * S * h * B for h in nh], "k": [D * k.ne[1] * h * B for h in nkv]}
    padded = [c for c in "qkv" if c in grads][:-1]  # packed in q, k, v order: every part but the last is padded
    for letter in padded:
        if letter in parts and not meta.gaps_add_up(parts[letter]):
            raise InputError(f"on {g.backend.device_name}: a device's part of d{letter.upper()} is not a multiple of 4 "
                             "floats, so the packed gradients cannot be split by heads: mirror q, k, v")


def back_grads(back: Tensor) -> str:
    """The gradients a backward node computes, as letters of "qkv" (autodiff asks only for those of q, k, v
    that need one). Raises InputError / InputTypeError when back is not a flash_attn_train_back node."""
    if not isinstance(back, Tensor):
        raise InputTypeError(f"back must be a hotggml Tensor, got {type(back).__name__}")
    _need_op(back, op_id("FLASH_ATTN_TRAIN_BACK"), "back")
    bits = int(back.graph.lib.ggml_flash_attn_train_back_get_grads(back.ptr))
    return "".join(c for c, b in GRAD_BITS.items() if bits & b)


def _grad_view(back: Tensor, which: str) -> Tensor:
    if not isinstance(back, Tensor):
        raise InputTypeError(f"back must be a hotggml Tensor, got {type(back).__name__}")
    back.graph.own(back)  # a view is a tensor object: ggml aborts where the context has no room for it
    if which not in back_grads(back):  # ggml asserts it
        raise InputError(f"this backward node does not compute d{which.upper()} (it computes: "
                         f"{', '.join('d' + c.upper() for c in back_grads(back))})")
    return Tensor(back.graph, getattr(back.graph.lib, f"ggml_flash_attn_train_back_get_d{which}")(back.graph.ctx, back.ptr))


def get_dq(back: Tensor) -> Tensor:
    """View dQ (contiguous, shape of q) of a packed backward that computes it."""
    return _grad_view(back, "q")


def get_dk(back: Tensor) -> Tensor:
    """View dK (contiguous, shape of k) of a packed backward that computes it."""
    return _grad_view(back, "k")


def get_dv(back: Tensor) -> Tensor:
    """View dV (contiguous, shape of v) of a packed backward that computes it."""
    return _grad_view(back, "v")
