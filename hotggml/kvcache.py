"""K and V caches in their stored types (SPEC §4): f16, bf16 and q8_0 tensors the training ops read as
they are (dequantized while a tile is staged), never converted to f32 in the graph.

``encode`` makes a cache's bytes with ggml's own converters (the library's fp32 -> f16 / bf16 row
conversions, ``ggml_quantize_chunk`` for q8_0); ``decode`` turns bytes back into float32 with NumPy alone,
as ggml's dequantizers do, so the float64 references see exactly the values the kernels read:

- f16: IEEE binary16;
- bf16: the high 16 bits of a binary32 (``ggml_bf16_to_fp32``);
- q8_0: blocks of 32 values, a binary16 scale d then 32 int8 q; x = q * d in f32 (``dequantize_row_q8_0``).

Shapes are NumPy order (ggml's ``ne`` reversed): the last axis is a row (D or Dv), whole q8_0 blocks.
"""

from __future__ import annotations

import numpy as np

from hotggml.errors import InputError, InputTypeError

TYPES = ("f32", "f16", "bf16", "q8_0")  # what ggml_flash_attn_train takes for K and V
QK8_0 = 32                              # values per q8_0 block
_BLOCK = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (QK8_0, 2 + QK8_0)}  # (values, bytes) per block


def check_type(type_name: str) -> None:
    """Raise InputError unless type_name is one of TYPES."""
    if type_name not in TYPES:
        raise InputError(f"K/V type must be one of {', '.join(TYPES)}, got {type_name!r}")


def check_row(type_name: str, n: int, what: str = "a row") -> None:
    """Raise InputError when rows of n values cannot be stored in type_name (q8_0: whole 32-value blocks; every
    type: at least one value, which ggml's quantizer needs)."""
    check_type(type_name)
    per_block = _BLOCK[type_name][0]
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise InputTypeError(f"{what}: a row's length is an int number of values, got {n!r}")
    if n < 1:
        raise InputError(f"{what} of {n} values cannot be {type_name}: a row holds at least one value")
    if n % per_block:
        raise InputError(f"{what} of {n} values cannot be {type_name}: its rows are blocks of {per_block} values")


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one row of n values in type_name (InputError when n is not whole blocks)."""
    check_row(type_name, n)
    per_block, size = _BLOCK[type_name]
    return n // per_block * size


def encode(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (float32 or convertible, any shape, last axis a row) in type_name, by ggml's converters: uint8 array
    of shape x.shape[:-1] + (row bytes,). NaN and inf are stored as ggml stores them. Raises InputTypeError
    for a non-real array, InputError for a type or a row length the type cannot hold."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiu" or x.ndim == 0:
        raise InputTypeError(f"encode takes a real array of at least one axis, got {x.dtype} of shape {x.shape}")
    check_row(type_name, x.shape[-1])
    src = np.ascontiguousarray(x, dtype=np.float32)
    if type_name == "f32":
        return src.view(np.uint8).reshape(x.shape[:-1] + (-1,)).copy()
    from hotggml.ffi import ffi, load

    lib = load()
    n, rows = x.shape[-1], src.size // max(x.shape[-1], 1)
    out = np.empty(x.shape[:-1] + (row_bytes(type_name, n),), dtype=np.uint8)
    sp, dp = ffi.cast("float *", ffi.from_buffer(src)), ffi.from_buffer(out)
    if type_name == "f16":
        lib.ggml_fp32_to_fp16_row(sp, ffi.cast("ggml_fp16_t *", dp), src.size)
    elif type_name == "bf16":
        lib.ggml_fp32_to_bf16_row(sp, ffi.cast("ggml_bf16_t *", dp), src.size)
    else:
        lib.ggml_quantize_chunk(lib.GGML_TYPE_Q8_0, sp, dp, 0, rows, n, ffi.NULL)
    return out


def decode(raw: np.ndarray, type_name: str, n: int) -> np.ndarray:
    """Bytes of rows of n values in type_name (encode's output, or a tensor's bytes) as float32, shape
    raw.shape[:-1] + (n,), in NumPy alone (the module docstring says how each type is read). Raises
    InputTypeError for raw that is not uint8 (bytes: values would be converted, not reinterpreted)."""
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise InputTypeError(f"raw must be a uint8 array of the rows' bytes, got "
                             f"{raw.dtype if isinstance(raw, np.ndarray) else type(raw).__name__}")
    raw = np.ascontiguousarray(raw)
    if raw.shape[-1] != row_bytes(type_name, n):
        raise InputError(f"{raw.shape[-1]} bytes per row are not {n} {type_name} values")
    lead = raw.shape[:-1]
    if type_name == "f32":
        return raw.view(np.float32).reshape(lead + (n,)).copy()
    if type_name == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(lead + (n,))
    if type_name == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(lead + (n,))
    blocks = raw.reshape(-1, _BLOCK["q8_0"][1])
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)        # (blocks, 1)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)                  # (blocks, 32)
    return (q * d).astype(np.float32).reshape(lead + (n,))


def stored(x: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values a cache of x in type_name holds: decode(encode(x))."""
    x = np.asarray(x)
    return decode(encode(x, type_name), type_name, x.shape[-1])


def _non_finite_in_block(x: np.ndarray, where: tuple) -> tuple | None:
    """The index of the first NaN or inf in the q8_0 block (32 values along the last axis) holding x[where]."""
    start = where[-1] // QK8_0 * QK8_0
    block = x[where[:-1]][start:start + QK8_0]
    bad = np.flatnonzero(~np.isfinite(block))
    return where[:-1] + (start + int(bad[0]),) if bad.size else None


def check_held(x: np.ndarray, raw: np.ndarray, type_name: str, what: str) -> None:
    """Raise InputError where ``raw`` (x encoded in type_name) holds inf or NaN for a finite value of x: a value
    beyond the type's range (f32 about 3.40e38 for a float64 x, f16 65504, bf16 about 3.39e38), or, in q8_0, a
    block whose scale (its largest magnitude / 127, stored as f16) overflows or that holds a non-finite value,
    which makes all 32 of its values NaN or inf; and where it holds a finite value for a NaN or inf of x (q8_0
    quantizes a non-finite value that does not make its block NaN to a finite one)."""
    x = np.asarray(x)  # as given: a float64 beyond float32's range is finite here and inf once stored
    if x.ndim == 0 or not isinstance(raw, np.ndarray) or raw.shape[:-1] != x.shape[:-1]:
        raise InputError(f"{what}: raw holds rows {getattr(raw, 'shape', None)} (bytes last) for values of shape "
                         f"{x.shape}: one row of bytes per row of values")
    held = decode(raw, type_name, x.shape[-1])
    lost = np.isfinite(x) & ~np.isfinite(held)
    if lost.any():
        where = tuple(int(i) for i in np.argwhere(lost)[0])
        cause = _non_finite_in_block(x, where) if type_name == "q8_0" else None
        if cause is not None:  # the block's scale is NaN or inf because of that value, not of this one
            raise InputError(f"{what}: q8_0 cannot hold the non-finite value {float(x[cause])!r} at {cause} (NumPy index): "
                             f"its block of {QK8_0} values (with the finite {float(x[where])!r} at {where}) would read "
                             f"as inf or NaN, since a q8_0 block is all finite or all NaN")
        raise InputError(f"{what}: {type_name} cannot hold the finite value {float(x[where])!r} at {where} (NumPy index): it "
                         f"would read as inf or NaN" + (" (a q8_0 block holds magnitudes below 65520 x 127, all finite)"
                                                        if type_name == "q8_0" else ""))
    hidden = ~np.isfinite(x) & np.isfinite(held)  # q8_0: a lone NaN in a finite block is quantized to 0
    if hidden.any():
        where = tuple(int(i) for i in np.argwhere(hidden)[0])
        raise InputError(f"{what}: {type_name} would hold the non-finite value {float(x[where])!r} at {where} (NumPy index) "
                         f"as the finite {float(held[where])!r}: a q8_0 block is all finite or all NaN")
