"""What ggml's autodiff can differentiate, checked before ``ggml_build_backward_expand`` runs.

ggml_build_backward_expand aborts the interpreter (GGML_ASSERT / GGML_ABORT in ggml_compute_backward, ggml.c)
when a node that needs a gradient has an op without a backward case, or when a backward case meets what it
does not implement. ``check(roots)`` finds both in Python, by ggml_build_backward_expand's own rule for which
nodes need a gradient (a param(), or a non-I32 node with a source that needs one, ignored sources aside), and
raises InputError naming them. Graph.build (with a loss) and hotggml.opt.Optimizer call it.

The op lists are the cases of ggml_compute_backward in the patched tree (tests/test_opt.py reads them from
ggml.c); the extra rules are that function's asserts a valid forward graph can reach.
"""

from __future__ import annotations

from hotggml.errors import InputError
from hotggml.ffi import ffi, load
from hotggml.graph import FLAG_PARAM

# the cases of ggml_compute_backward (ggml.c) in the patched tree: a node that needs a gradient and whose op is
# not here makes ggml's autodiff abort ("unsupported ggml op for backward pass")
BACKWARD_OPS = frozenset("""NONE DUP ADD ADD1 ACC SUB MUL DIV SQR SQRT LOG SIN COS SUM SUM_ROWS MEAN REPEAT REPEAT_BACK
    RMS_NORM MUL_MAT SCALE SET CPY CONT RESHAPE VIEW PERMUTE TRANSPOSE GET_ROWS DIAG_MASK_INF DIAG_MASK_ZERO SOFT_MAX
    ROPE IM2COL POOL_2D WIN_PART WIN_UNPART UNARY CROSS_ENTROPY_LOSS GLU FLASH_ATTN_TRAIN""".split())
BACKWARD_UNARY = frozenset("ABS SGN NEG STEP RELU SILU EXP EXPM1 SOFTPLUS".split())
BACKWARD_GLU = frozenset({"SWIGLU"})
# sources whose gradient ggml_build_backward_expand ignores: (op name, source index)
IGNORED_SRC = {("IM2COL", 0), ("IM2COL_BACK", 0), ("CPY", 1), ("GET_ROWS", 1), ("GET_ROWS_BACK", 1), ("ROPE", 1)}
# sources a backward case asserts need no gradient: (op name, source index) -> what ggml says is missing
NO_GRAD_SRC = {
    ("SOFT_MAX", 1): "the mask of soft_max_ext",
    ("ROPE", 2): "rope's frequency factors",
    ("CROSS_ENTROPY_LOSS", 1): "the labels of cross_entropy_loss",
    ("FLASH_ATTN_TRAIN", 3): "the mask of flash_attn_train",
}


def op_name(lib, ptr) -> str:
    """ggml's op name of a node, with the unary or GLU op for those ('UNARY TANH', 'GLU GEGLU')."""
    name = ffi.string(lib.ggml_op_name(ptr.op)).decode()
    if name == "UNARY":
        return f"UNARY {ffi.string(lib.ggml_unary_op_name(lib.ggml_get_unary_op(ptr))).decode()}"
    if name == "GLU":
        return f"GLU {ffi.string(lib.ggml_glu_op_name(lib.ggml_get_glu_op(ptr))).decode()}"
    return name


def _key(ptr) -> int:
    return int(ffi.cast("uintptr_t", ptr))


def _post_order(roots) -> list:
    """The nodes reachable from roots, every source before its consumer, each once."""
    seen: set[int] = set()
    order, stack = [], [(r, False) for r in roots]
    while stack:
        ptr, done = stack.pop()
        if done:
            order.append(ptr)
            continue
        if _key(ptr) in seen:
            continue
        seen.add(_key(ptr))
        stack.append((ptr, True))
        stack.extend((src, False) for src in ptr.src if src != ffi.NULL)
    return order


def refusals(roots) -> list[str]:
    """Why ggml's autodiff would abort on the graph of ``roots`` (tensor pointers): one line per reason,
    sorted, each once; [] when it would not."""
    lib = load()
    needs: dict[int, bool] = {}
    reasons: set[str] = set()
    i32 = int(lib.GGML_TYPE_I32)
    for ptr in _post_order(roots):
        name = op_name(lib, ptr)
        op, _, sub = name.partition(" ")
        # a source that is the node itself (ggml_cast sets src[1] = the result) is no data input: no gradient
        src_needs = [src != ffi.NULL and _key(src) != _key(ptr) and needs[_key(src)] for src in ptr.src]
        if int(ptr.flags) & FLAG_PARAM:
            needs[_key(ptr)] = True
        else:
            needs[_key(ptr)] = int(ptr.type) != i32 and any(
                n and (op, j) not in IGNORED_SRC for j, n in enumerate(src_needs))
        if not needs[_key(ptr)]:
            continue
        if op not in BACKWARD_OPS or (op == "UNARY" and sub not in BACKWARD_UNARY) or (op == "GLU" and sub not in BACKWARD_GLU):
            reasons.add(f"ggml's autodiff has no backward for {name}")
        elif op == "GLU" and ptr.src[1] == ffi.NULL:
            reasons.add(f"ggml's autodiff has a backward for {name} only with gate and value split (two tensors)")
        for (rule_op, j), what in NO_GRAD_SRC.items():
            if op == rule_op and j < len(src_needs) and src_needs[j]:
                reasons.add(f"ggml's autodiff has no gradient for {what}, which here depends on a param()")
        if op == "FLASH_ATTN_TRAIN":  # SPEC section 4: a K or V in a stored type is a frozen cache (ggml asserts)
            for j, what in ((1, "k"), (2, "v")):
                if src_needs[j] and int(ptr.src[j].type) != int(lib.GGML_TYPE_F32):
                    type_name = ffi.string(lib.ggml_type_name(ptr.src[j].type)).decode()
                    reasons.add(f"ggml's autodiff has no gradient for a {type_name} {what} of flash_attn_train (a "
                                "stored K/V is a frozen cache), which here depends on a param()")
        if op == "MUL_MAT" and src_needs[0]:
            a, b = ptr.src[0], ptr.src[1]
            if (int(a.ne[2]), int(a.ne[3])) != (int(b.ne[2]), int(b.ne[3])) and int(b.ne[3]) != 1:
                reasons.add("ggml's autodiff cannot sum mul_mat's gradient over a broadcast in dim 3: make the "
                            f"param operand [.., {int(b.ne[2])}, {int(b.ne[3])}] or the other one's dim 3 equal 1")
        if op == "MUL_MAT" and src_needs[1] and int(ptr.src[0].type) in (int(lib.GGML_TYPE_F16), int(lib.GGML_TYPE_BF16)):
            # src1's gradient is OUT_PROD(src0, grad), which no backend runs on an f16/bf16 src0: ggml's scheduler
            # asserts (every backend refuses the node), a single backend fails at compute
            type_name = ffi.string(lib.ggml_type_name(ptr.src[0].type)).decode()
            reasons.add(f"the gradient of mul_mat's second operand through a {type_name} first one needs OUT_PROD "
                        f"with a {type_name} operand, which no ggml backend runs: make the first operand f32 (cast)")
    return sorted(reasons)


def check(roots) -> None:
    """Raise InputError listing ``refusals(roots)``, before ggml's autodiff would abort on them."""
    reasons = refusals(roots)
    if reasons:
        raise InputError("; ".join(reasons) + " (ggml would abort): change the graph or what is a param()")
