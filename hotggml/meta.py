"""ggml's meta backend from Python: one device over several named devices (tensor parallelism), the split
of every leaf, and what the meta backend can split at this pin.

``ggml_backend_meta_device(devs, n, get_split_state, ud)`` (ggml-backend.h) makes a device that is in no
registry; each of its tensors lives on every simple device, whole (MIRRORED) or as a slice along one axis.
The split of a computed tensor is inferred from its sources by ggml-backend-meta.cpp; the split of a leaf
(a tensor in a static buffer: inputs, params, ggml-opt's momenta) is asked of ``get_split_state``. The
binding passes one callback, ``_split_state``, which answers from a registry that ``Graph.split`` fills
(tensor address -> split state) and says MIRRORED for everything else.

The training ops split by heads (patch flash-attn-train-meta): q, k, v split on ne[2] in whole GQA groups
(``heads_rule`` says when: Nkv divisible by the device count and every device's packed part a multiple of
4 floats), the mask mirrored, each device computing the packed result of its own heads. At this pin the
meta backend splits little else: ``check_graph`` refuses a graph whose split tensors reach any op but the
training ops and views of them (handle_generic's split-state check would abort the process), naming it.
"""

from __future__ import annotations

import re

from hotggml.errors import InputError
from hotggml.ffi import ffi, load

GGML_MAX_DIMS = 4
MAX_DEVICES = 16  # GGML_BACKEND_META_MAX_DEVICES
MAX_SEGMENTS = 16
AXIS_MIRRORED = 10  # enum ggml_backend_meta_split_axis
FLOATS_ALIGN = 4  # GGML_MEM_ALIGN / sizeof(float): the packed results' parts start at 16-byte boundaries

# tensor address -> (axis, per-device extents per segment (segment-major), repetitions per segment)
_SPLITS: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
_CALLBACK = None


def _key(ptr) -> int:
    return int(ffi.cast("uintptr_t", ptr))


def _split_state(tensor, userdata):
    """The get_split_state callback: the registered split of a leaf, MIRRORED for any other. Never raises
    (ggml would read a zeroed struct): an error returns MIRRORED through onerror."""
    out = ffi.new("struct ggml_backend_meta_split_state *")
    entry = _SPLITS.get(_key(tensor))
    if entry is None:
        out.axis, out.nr[0], out.n_segments = AXIS_MIRRORED, 1, 1
        return out[0]
    axis, ne, nr = entry
    out.axis = axis
    for i, n in enumerate(ne):
        out.ne[i] = n
    for i, n in enumerate(nr):
        out.nr[i] = n
    out.n_segments = len(nr)
    return out[0]


def _mirrored_on_error(exc_type, exc_value, tb):
    out = ffi.new("struct ggml_backend_meta_split_state *")
    out.axis, out.nr[0], out.n_segments = AXIS_MIRRORED, 1, 1
    return out[0]


def callback():
    """The one cffi callback every meta device of this process is made with (ggml caches meta devices by
    their simple devices and callback, so the same names give the same device)."""
    global _CALLBACK
    if _CALLBACK is None:
        load()
        _CALLBACK = ffi.callback("struct ggml_backend_meta_split_state(const struct ggml_tensor *, void *)",
                                 _split_state, onerror=_mirrored_on_error)
    return _CALLBACK


def parse_name(name: str) -> tuple[str, ...] | None:
    """The simple device names of a meta device name ``Meta(CPU,CPU)`` (spaces allowed), or None when the name
    is not of that form. Raises InputError for ``Meta(...)`` with an empty or nested device list."""
    m = re.fullmatch(r"\s*meta\s*\((.*)\)\s*", name, flags=re.IGNORECASE)
    if m is None:
        if re.match(r"\s*meta\s*\(", name, flags=re.IGNORECASE):
            raise InputError(f"a meta device name lists its devices in parentheses, e.g. Meta(CPU,CPU), got {name!r}")
        return None
    parts = tuple(p.strip() for p in m.group(1).split(","))
    if not m.group(1).strip() or any(not p or "(" in p or ")" in p for p in parts):
        raise InputError(f"a meta device name lists its devices, e.g. Meta(CPU,CPU), got {name!r}")
    return parts


def register(ptr, axis: int, ne: list[int], nr: list[int]) -> int:
    """Record the split of leaf ``ptr`` for the callback; returns the registry key (Graph drops it on close)."""
    key = _key(ptr)
    _SPLITS[key] = (int(axis), tuple(int(n) for n in ne), tuple(int(n) for n in nr))
    return key


def forget(keys) -> None:
    """Drop registry entries (a closed Graph's tensors: their addresses are reused by later contexts)."""
    for key in keys:
        _SPLITS.pop(key, None)


def equal_parts(n: int, parts: int) -> list[int]:
    """n split into ``parts`` equal extents; InputError unless parts divides n."""
    if n % parts:
        raise InputError(f"{n} does not split into {parts} equal parts")
    return [n // parts] * parts


def _gap(n: int) -> int:
    return (FLOATS_ALIGN - n % FLOATS_ALIGN) % FLOATS_ALIGN


def heads_rule(q_ne, k_ne, v_ne, n_devices: int, grads: str = "qkv") -> tuple[str, str]:
    """(rule, reason) for the training ops on ``n_devices`` devices at these shapes (ggml order):
    ('heads', ...) when q, k, v can be split by heads in whole GQA groups (Nkv divisible by the device count
    and every device's part of each packed result a multiple of 4 floats, so that the devices' alignment gaps
    make up the whole result's), else ('mirrored', why)."""
    D, S, Nh, B = q_ne
    Skv, Nkv = k_ne[1], k_ne[2]
    Dv = v_ne[0]
    if n_devices < 2:
        return "mirrored", "one device"
    if Nkv % n_devices:
        return "mirrored", f"Nkv {Nkv} is not divisible by {n_devices} devices"
    nkv = Nkv // n_devices
    nh = nkv * (Nh // Nkv)
    parts = {"O": Dv * nh * S * B}
    if "q" in grads:
        parts["dQ"] = D * S * nh * B
    if "k" in grads:
        parts["dK"] = D * Skv * nkv * B
    for name, n in parts.items():  # dV is last in its packed result: never padded
        if n % FLOATS_ALIGN and _gap(n) * n_devices != _gap(n * n_devices):
            return "mirrored", f"a device's {name} part ({n} floats) leaves alignment gaps the whole result lacks"
    return "heads", f"{nh} query / {nkv} kv heads per device"


def packed_forward_split(Dv: int, nh: list[int], S: int, B: int) -> tuple[list[int], list[int]]:
    """(ne, nr) of a packed forward-shaped tensor ([O | gap | LSE], e.g. the packed gradient d) split by the
    query heads ``nh`` per device, as flash-attn-train-meta splits the forward's result."""
    n_dev = len(nh)
    ne, nr = [Dv * h for h in nh], [S * B]
    gaps = [_gap(Dv * h * S * B) for h in nh]
    if sum(gaps) != _gap(Dv * sum(nh) * S * B):
        raise InputError("the devices' alignment gaps do not make up the packed tensor's: mirror it")
    if any(gaps):
        ne, nr = ne + gaps, nr + [1]
    ne, nr = ne + list(nh), nr + [S * B]
    assert len(ne) == n_dev * len(nr)
    return ne, nr


def gaps_add_up(parts: list[int]) -> bool:
    """Whether the devices' alignment gaps after their parts (floats each) make up the whole part's gap: then a
    packed result split by heads is the devices' packed results side by side (flash-attn-train-meta)."""
    return sum(_gap(n) for n in parts) == _gap(sum(parts))


# ops through which a split reaches the training ops, or their results reach the caller, without a rule that
# would abort: the training ops (flash-attn-train-meta), views (O, LSE, dQ, dK, dV), a permuted leaf (q as a view)
_SPLIT_OPS = ("FLASH_ATTN_TRAIN", "FLASH_ATTN_TRAIN_BACK", "VIEW", "PERMUTE")


def check_graph(nodes, is_split) -> None:
    """InputError naming the first node (in graph order) that a split tensor reaches and the meta backend
    cannot split at this pin. ``nodes``: the graph's node pointers in order; ``is_split(ptr)``: whether a leaf
    was split by Graph.split. The training ops' own operands are checked by hotggml.ops."""
    lib = load()
    allowed = {int(getattr(lib, f"GGML_OP_{name}")) for name in _SPLIT_OPS}
    split: set[int] = set()
    for ptr in nodes:
        srcs = [s for s in ptr.src if s != ffi.NULL]
        if any(_key(s) in split or is_split(s) for s in srcs):
            op = int(ptr.op)
            name = ffi.string(lib.ggml_op_name(ptr.op)).decode()
            if op not in allowed:
                raise InputError(
                    f"the meta backend cannot split {name} at this pin (a split tensor reaches it: ggml-backend-meta.cpp "
                    "splits the training ops by heads and views of them, and takes mirrored operands only for the "
                    f"generic ops); mirror its operands, or keep {name} out of the split part of the graph")
            split.add(_key(ptr))
