"""Attention cases: shapes in the field's terms and the masks they use (SPEC §6, §7).

A Case is a frozen record with a stable id (the pytest id and the ``-p`` filter target).
Correctness sets (``smoke``, ``real``) and perf sets are separate registries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hotggml import kvcache
from hotggml.errors import InputError

MASKS = ("none", "causal", "band", "padding", "bias")


@dataclass(frozen=True)
class Case:
    """One attention geometry. B batch, Nh query heads, Nkv kv heads, D (and Dv) head dims,
    S queries, Skv keys; mask one of MASKS; band half-width for 'band'; pad_keys masked keys
    at the end (per batch b: pad_keys + b) for 'padding'; masked_rows query rows made fully
    -INF; masked_keys key columns made -INF for every row; mask_rows_extra adds rows to the mask
    beyond S (S' > S); q_view builds q as a permuted, non-contiguous view; lse_loss adds LSE to the
    loss (checks the dLSE path).

    Numerical rules (SPEC §4): qk_gain multiplies q and k (a large gain saturates the softmax into
    one-hot rows, where dQ = dK = 0 exactly); v = v_offset + v_spread * N(0, 1) (near-constant V
    when the spread is small); garbage puts NaN into k and v at every key masked for all rows (the
    kernels must never let them reach a result; the references get the finite values). Cases
    tagged 'cancel' measure dQ and dK against their natural magnitude (parity.natural_magnitudes),
    since the reference is ~0 there.

    Implicit masks (never stored; the fused op decides them from indices): ``causal`` hides key j from
    query i when j > i + Skv - S, ``window`` when |i + Skv - S - j| > window. ``mask`` is the stored
    additive mask the fused op reads; mask_array() is everything together, made explicit, which the
    references (oracle, exact chain) use."""

    name: str
    B: int = 1
    Nh: int = 1
    Nkv: int = 1
    D: int = 64
    S: int = 16
    Skv: int = 16
    Dv: int | None = None
    mask: str = "none"
    band: int = 128
    pad_keys: int = 0
    mask_per_batch: bool = False
    masked_rows: tuple[int, ...] = ()
    masked_keys: tuple[int, ...] = ()
    mask_rows_extra: int = 0
    q_view: bool = False
    lse_loss: bool = False
    qk_gain: float = 1.0
    v_offset: float = 0.0
    v_spread: float = 1.0
    garbage: bool = False
    causal: bool = False
    window: int | None = None
    seed: int = 0
    tags: tuple[str, ...] = field(default=())
    k_type: str = "f32"  # K and V in a stored type (hotggml.kvcache.TYPES): a frozen cache, no dK / dV
    v_type: str = "f32"
    frozen_kv: bool = False  # f32 K and V as inputs without gradient (dQ alone: the f32 twin of a frozen cache)
    do_scale: float = 1.0  # dO (the loss weights of O) times this: a tiny dO probes absolute thresholds

    def __post_init__(self):
        if self.mask not in MASKS:
            raise InputError(f"case {self.name}: mask must be one of {MASKS}, got {self.mask!r}")
        if self.Nh % self.Nkv:
            raise InputError(f"case {self.name}: Nh % Nkv != 0")
        if any(r >= self.S for r in self.masked_rows):
            raise InputError(f"case {self.name}: masked row beyond S")
        if any(j >= self.Skv for j in self.masked_keys):
            raise InputError(f"case {self.name}: masked key beyond Skv")
        if self.window is not None and self.window < 0:
            raise InputError(f"case {self.name}: window must be >= 0 or None")
        if self.q_view and (self.Nh == 1 or self.S == 1):
            raise InputError(f"case {self.name}: q_view needs Nh > 1 and S > 1 (else the permuted view is contiguous)")

    @property
    def id(self) -> str:
        return self.name

    @property
    def dv(self) -> int:
        return self.Dv or self.D

    @property
    def scale(self) -> float:
        return 1.0 / float(np.sqrt(self.D))

    @property
    def shape(self) -> str:
        implicit = ("+causal" if self.causal else "") + (f"+window{self.window}" if self.window is not None else "")
        return (f"B{self.B} Nh{self.Nh} Nkv{self.Nkv} D{self.D}" + (f" Dv{self.dv}" if self.Dv else "") +
                f" S{self.S} Skv{self.Skv} {self.mask}{implicit}")

    def kv_trained(self, name: str) -> bool:
        """Whether the fused op's autodiff asks a gradient for ``name`` ('k' or 'v'): an f32 K / V that the
        case does not freeze; a cache in a stored type never gets one (SPEC §4)."""
        return getattr(self, f"{name}_type") == "f32" and not self.frozen_kv

    def has_mask(self) -> bool:
        """Whether the fused op reads a stored mask (implicit masks are not stored)."""
        return self.mask != "none" or bool(self.masked_rows) or bool(self.masked_keys)

    def has_implicit(self) -> bool:
        return self.causal or self.window is not None

    def mask_array(self) -> np.ndarray | None:
        """Every mask of the case made explicit: float16 (Bm, S', Skv), Bm in {1, B}, -inf where masked;
        None when there is none. The references use this; the fused op reads stored_mask()."""
        stored = self.stored_mask()
        if not self.has_implicit():
            return stored
        m = stored.astype(np.float32) if stored is not None else np.zeros((1, self.S, self.Skv), np.float32)
        i = np.arange(m.shape[1])[:, None] + (self.Skv - self.S)
        j = np.arange(self.Skv)[None, :]
        hidden = np.zeros(m.shape[1:], dtype=bool)
        if self.causal:
            hidden |= j > i
        if self.window is not None:
            hidden |= np.abs(i - j) > self.window
        m[:, hidden] = -np.inf
        return m.astype(np.float16)

    def stored_mask_shape(self) -> tuple[int, int, int] | None:
        """The shape (Bm, S', Skv) of stored_mask(), computed without it; None when there is none."""
        if not self.has_mask():
            return None
        batches = self.B if (self.mask_per_batch or self.mask == "padding") else 1
        return batches, self.S + self.mask_rows_extra, self.Skv

    def mask_array_shape(self) -> tuple[int, int, int] | None:
        """The shape of mask_array(), computed without it; None when there is none."""
        stored = self.stored_mask_shape()
        return stored if stored is not None or not self.has_implicit() else (1, self.S, self.Skv)

    def stored_mask(self) -> np.ndarray | None:
        """The additive mask the fused op reads, float16 (Bm, S', Skv) with Bm in {1, B}, or None."""
        if not self.has_mask():
            return None
        rng = np.random.default_rng(self.seed + 1000)
        Bm, S2, _ = self.stored_mask_shape()
        i = np.arange(S2)[:, None]
        j = np.arange(self.Skv)[None, :]
        m = np.zeros((Bm, S2, self.Skv), dtype=np.float32)
        if self.mask == "causal":
            # query i sees keys j <= i + Skv - S (the causal tail when Skv > S)
            m[:, j > i + (self.Skv - self.S)] = -np.inf
        elif self.mask == "band":
            m[:, np.abs(i - j) > self.band] = -np.inf
        elif self.mask == "padding":
            for b in range(Bm):
                n_pad = self.pad_keys + b
                if n_pad:
                    m[b, :, self.Skv - n_pad:] = -np.inf
        elif self.mask == "bias":
            m[:] = rng.uniform(-3.0, 3.0, size=m.shape)
            if self.mask_per_batch:
                m[:, :, 0] = -np.inf  # a masked key column in a finite-bias mask
        for r in self.masked_rows:
            m[:, r, :] = -np.inf
        for j in self.masked_keys:
            m[:, :, j] = -np.inf
        return m.astype(np.float16)

    def dead_keys(self) -> np.ndarray:
        """bool (B, Skv): True where key j of batch b is masked for every one of the S query rows."""
        mask = self.mask_array()
        if mask is None:
            return np.zeros((self.B, self.Skv), dtype=bool)
        dead = np.all(np.isneginf(mask[:, : self.S].astype(np.float32)), axis=1)  # (Bm, Skv)
        return np.broadcast_to(dead, (self.B, self.Skv)).copy()

    def input_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """The NumPy shapes of inputs()' arrays (None where it has none), computed without them."""
        B, Nh, Nkv, S, Skv, D, Dv = self.B, self.Nh, self.Nkv, self.S, self.Skv, self.D, self.dv
        return {"q": (B, Nh, S, D), "k": (B, Nkv, Skv, D), "v": (B, Nkv, Skv, Dv), "do": (B, S, Nh, Dv),
                "dlse": (B, S, Nh) if self.lse_loss else None}

    def placeholders(self) -> dict[str, np.ndarray | None]:
        """inputs()' arrays as zero-stride views of one float32 zero (np.broadcast_to): their shapes and dtype
        at no memory, for a Graph that only measures (Graph(reserve_only=True))."""
        return {name: None if shape is None else np.broadcast_to(np.float32(0), shape)
                for name, shape in self.input_shapes().items()}

    def inputs(self, with_garbage: bool = False) -> dict[str, np.ndarray]:
        """Seeded f32 inputs in NumPy (batch-first) layout and the loss weights (dO, dLSE).

        with_garbage: for a ``garbage`` case, k and v hold NaN at every key masked for all rows
        (what the fused arm gets); the references always get the finite values.
        """
        rng = np.random.default_rng(self.seed)
        shape = self.input_shapes()
        gain = np.float32(self.qk_gain)
        out = {
            "q": rng.standard_normal(shape["q"], dtype=np.float32) * gain,
            "k": rng.standard_normal(shape["k"], dtype=np.float32) * gain,
            "v": (np.float32(self.v_offset) +
                  np.float32(self.v_spread) * rng.standard_normal(shape["v"], dtype=np.float32)),
            # dO in the O layout of the op, [Dv, Nh, S, B] -> NumPy (B, S, Nh, Dv)
            "do": rng.standard_normal(shape["do"], dtype=np.float32) * np.float32(self.do_scale),
            "dlse": rng.standard_normal(shape["dlse"], dtype=np.float32) if self.lse_loss else None,
        }
        # a cache in a stored type holds what ggml's converter makes of the values: every arm sees those
        for name, kind in (("k", self.k_type), ("v", self.v_type)):
            if kind != "f32":
                out[name] = kvcache.stored(out[name], kind)
        if with_garbage and self.garbage:
            for b, j in zip(*np.nonzero(self.dead_keys())):
                out["k"][b, :, j] = np.nan
                out["v"][b, :, j] = np.nan
        return out


SMOKE = [
    Case("tiny", D=4, S=2, Skv=3),  # S = Skv = 1 has a constant softmax: dQ = dK = 0, a vacuous case
    Case("odd-causal-cross", Nh=3, Nkv=3, D=5, Dv=7, S=13, Skv=29, mask="causal", mask_rows_extra=3),
    Case("gqa-band", Nh=4, Nkv=2, D=8, S=33, Skv=65, mask="band", band=5),
    Case("mqa-causal", Nh=4, Nkv=1, D=16, S=20, Skv=20, mask="causal"),
    Case("q-view-bias", Nh=2, Nkv=1, D=12, S=17, Skv=23, mask="bias", q_view=True),
    Case("batch-padding-cross", B=2, Nh=4, Nkv=2, D=16, S=24, Skv=40, mask="padding", pad_keys=3),
    Case("batch-bias-per-batch", B=2, Nh=2, Nkv=2, D=8, S=9, Skv=11, mask="bias", mask_per_batch=True),
    Case("masked-rows", Nh=2, Nkv=1, D=8, S=19, Skv=21, mask="bias", masked_rows=(0, 7, 18)),
    Case("tiles", B=2, Nh=2, Nkv=1, D=32, S=70, Skv=150, mask="band", band=40, q_view=True),
    Case("lse-loss", Nh=4, Nkv=2, D=16, S=21, Skv=35, mask="causal", lse_loss=True),
    Case("no-mask-gqa", B=2, Nh=6, Nkv=3, D=24, S=31, Skv=47),
    # head dims that are not multiples of the CPU kernels' 32-column register blocks (SIMD + remainder)
    Case("dv-ne-d-remainders", B=1, Nh=4, Nkv=2, D=48, Dv=80, S=45, Skv=77, mask="causal"),
    # odd Dv > D with a GQA group: CUDA sums dK/dV in parts B Nkv Skv max(D, Dv) floats apart (an odd count here),
    # whose rows its vector stores need aligned
    Case("dv-odd-gqa-parts", Nh=2, Nkv=1, D=4, Dv=5, S=9, Skv=33),
    # numerical rules (SPEC §4): garbage (NaN) K/V at masked keys never reaches a result, whatever the
    # tile alignment (key 40 alone inside a 32-key tile; padding slots of a batch); dS cancels exactly
    # on saturated (one-hot) rows and no worse than the exact chain with near-constant V
    Case("nan-masked-key", D=16, S=8, Skv=64, masked_keys=(40,), garbage=True),
    Case("nan-padding-keys", B=2, Nh=4, Nkv=2, D=16, S=24, Skv=40, mask="padding", pad_keys=3, garbage=True),
    Case("one-hot-rows", Nh=2, Nkv=1, D=16, S=17, Skv=17, qk_gain=100.0, seed=1, tags=("cancel", "one-hot")),
    Case("near-constant-v", Nh=2, Nkv=1, D=16, S=33, Skv=47, v_offset=3.0, v_spread=1e-3, tags=("cancel",)),
    # the same at a larger head size, and rows that see one key by a window of 0 (no saturation needed): on the
    # CUDA register kernels (TF32, and the compensated 3xTF32 product of the f32 mode) dS cancels to f32 rounding
    # of the natural magnitude there, as the exact chain does (parity's one_key_dQ_dK_cancel)
    Case("one-hot-rows-d64", Nh=2, Nkv=1, D=64, S=17, Skv=40, qk_gain=100.0, seed=1, tags=("cancel", "one-hot")),
    Case("one-key-window0-d64", Nh=4, Nkv=2, D=64, S=40, Skv=40, window=0, tags=("cancel", "one-hot")),
    Case("near-constant-v-d64", Nh=2, Nkv=1, D=64, S=33, Skv=47, v_offset=3.0, v_spread=1e-3, tags=("cancel",)),
    # head sizes with register kernels on CUDA (D = Dv in {64, 128}): partial tiles, q as a view (no float4
    # rows), padding keys holding NaN, and a causal tail with S != Skv under GQA 4
    Case("reg-view-padding", B=2, Nh=4, Nkv=2, D=64, S=70, Skv=90, mask="padding", pad_keys=3, q_view=True,
         garbage=True),
    Case("reg-causal-tail", Nh=4, Nkv=1, D=128, S=40, Skv=100, mask="causal"),
    # implicit masks (no stored mask; the references get them made explicit): a causal tail under GQA, a
    # window over an additive bias, causal + window + stored padding with NaN padding keys (register
    # kernels' D on CUDA), and the causal tail at D = 128
    Case("implicit-causal-tail", Nh=4, Nkv=2, D=16, S=13, Skv=40, causal=True),
    Case("implicit-window-bias", Nh=2, Nkv=1, D=8, S=33, Skv=33, mask="bias", window=4),
    Case("implicit-causal-window-padding", B=2, Nh=4, Nkv=2, D=64, S=70, Skv=90, mask="padding", pad_keys=3,
         causal=True, window=20, garbage=True),
    Case("implicit-causal-d128", Nh=4, Nkv=1, D=128, S=40, Skv=100, causal=True),
]

# SPEC §7 shapes that fit the CPU (the window and causal masks stored: ids apart from the field set's implicit ones)
REAL = [
    Case("dit-self-band-625", Nh=16, Nkv=8, D=128, S=625, Skv=625, mask="band", band=128),
    Case("dit-self-band-1250", Nh=16, Nkv=8, D=128, S=1250, Skv=1250, mask="band", band=128),
    Case("dit-self-full-625", Nh=16, Nkv=8, D=128, S=625, Skv=625),
    Case("dit-self-full-1250", Nh=16, Nkv=8, D=128, S=1250, Skv=1250),
    Case("dit-cross-1250x1877", Nh=16, Nkv=8, D=128, S=1250, Skv=1877, mask="padding", pad_keys=200),
    Case("lm-causal-stored-1024", Nh=16, Nkv=8, D=128, S=1024, Skv=1024, mask="causal"),
]

# every SPEC §7 geometry (what users train at): for probe and for benchmarks on a device, not for the
# CPU parity gate (the oracle would need tens of GB at the largest). Causal and window masks are implicit
# here, as a trainer would pass them (no S x Skv mask in memory); REAL keeps them stored
FIELD = [
    *(Case(f"dit-self-window-{s}", Nh=16, Nkv=8, D=128, S=s, Skv=s, window=128) for s in (625, 1250, 3000)),
    *(Case(f"dit-self-full-{s}", Nh=16, Nkv=8, D=128, S=s, Skv=s) for s in (625, 1250, 3000)),
    Case("dit-cross-1250x1877", Nh=16, Nkv=8, D=128, S=1250, Skv=1877, mask="padding", pad_keys=200),
    Case("dit-cross-1250x640", Nh=16, Nkv=8, D=128, S=1250, Skv=640, mask="padding", pad_keys=64),
    *(Case(f"lm-causal-{s}", Nh=16, Nkv=8, D=128, S=s, Skv=s, causal=True) for s in (1024, 2113, 3500)),
    *(Case(f"lm4b-causal-{s}", Nh=32, Nkv=8, D=128, S=s, Skv=s, causal=True) for s in (1024, 2113, 3500)),
    Case("chunk-27b-2048x75520", Nh=24, Nkv=4, D=256, S=2048, Skv=75520, causal=True),
    # the same chunk against a frozen cache (dQ alone): K and V stored as q8_0, and its f32 twin
    Case("chunk-27b-q8_0-2048x75520", Nh=24, Nkv=4, D=256, S=2048, Skv=75520, causal=True, k_type="q8_0", v_type="q8_0"),
    Case("chunk-27b-frozen-2048x75520", Nh=24, Nkv=4, D=256, S=2048, Skv=75520, causal=True, frozen_kv=True),
    # head sizes other than 128 / 256 (SPEC §7): DiT-XL, a 1B-class LM's 64, UNet blocks, Phi-class LMs, 112 / 160,
    # MLA-style 192 / 128, and DiT self-attention in batches of 4 with key padding
    Case("dit-d72-full-4096", Nh=16, Nkv=16, D=72, S=4096, Skv=4096),
    Case("lm1b-d64-causal-4096", Nh=32, Nkv=8, D=64, S=4096, Skv=4096, causal=True),
    Case("unet-d80-full-2048", Nh=20, Nkv=20, D=80, S=2048, Skv=2048),
    Case("lm-d96-causal-4096", Nh=32, Nkv=8, D=96, S=4096, Skv=4096, causal=True),
    Case("d112-full-2048", Nh=16, Nkv=16, D=112, S=2048, Skv=2048),
    Case("d160-full-2048", Nh=8, Nkv=8, D=160, S=2048, Skv=2048),
    Case("mla-d192v128-causal-4096", Nh=16, Nkv=16, D=192, Dv=128, S=4096, Skv=4096, causal=True),
    Case("dit-b4-padding-1250", B=4, Nh=16, Nkv=8, D=128, S=1250, Skv=1250, mask="padding", pad_keys=100),
]

# shapes a device may refuse by name (CUDA takes D, Dv <= 256): parity and probe must fail naming the op,
# never fall back to the CPU
LIMITS = [Case("d512-refused", Nh=2, Nkv=1, D=512, S=8, Skv=8)]

# K and V in stored types (SPEC §4: a frozen cache read as it is stored, no dK / dV for it): every type pair
# at GQA, S != Skv, Dv != D, key padding with NaN in the padded K/V rows and a q view; then the causal tail
# with both q8_0, near-constant V in q8_0, and the register kernels' D with q8_0 K and f16 V
_KV_TYPES = ("f32", "f16", "bf16", "q8_0")
TYPES = [
    *(Case(f"kv-{kt}-{vt}", B=2, Nh=4, Nkv=2, D=32, Dv=64, S=24, Skv=45, mask="padding", pad_keys=3, garbage=True,
           q_view=True, k_type=kt, v_type=vt, seed=3)
      for kt in _KV_TYPES for vt in _KV_TYPES if (kt, vt) != ("f32", "f32")),
    Case("kv-q8_0-causal-tail", Nh=4, Nkv=2, D=64, S=13, Skv=70, causal=True, k_type="q8_0", v_type="q8_0"),
    Case("kv-q8_0-near-constant-v", Nh=2, Nkv=1, D=32, S=33, Skv=47, v_offset=3.0, v_spread=1e-3, k_type="q8_0",
         v_type="q8_0", tags=("cancel",)),
    Case("kv-q8_0-f16-d128", Nh=8, Nkv=2, D=128, S=40, Skv=100, mask="causal", k_type="q8_0", v_type="f16"),
    # many key tiles per block on every backend (CUDA: 32-64 keys a tile, two stages): stored-mask tiles that are
    # mixed and, at the padded end, dead with NaN in their K/V, and a partial last tile; the chunk's head size
    # with its implicit causal tail
    Case("kv-q8_0-f16-long-padding", Nh=4, Nkv=2, D=64, S=96, Skv=700, mask="padding", pad_keys=150, garbage=True,
         k_type="q8_0", v_type="f16", seed=5),
    Case("kv-q8_0-d256-causal-tail", Nh=6, Nkv=1, D=256, S=64, Skv=600, causal=True, k_type="q8_0", v_type="q8_0"),
    # CUDA's q8_0 blocks take several query heads of a GQA group as their rows (5 and 8 here): heads that leave
    # rows of a block idle, a partial last block, a window, fully masked query rows
    Case("kv-q8_0-gqa5-window", B=2, Nh=10, Nkv=2, D=64, S=70, Skv=150, window=20, q_view=True, k_type="q8_0",
         v_type="q8_0", seed=7),
    Case("kv-q8_0-gqa8-masked-rows", Nh=8, Nkv=1, D=128, S=50, Skv=90, mask="causal", masked_rows=(3, 41),
         k_type="q8_0", v_type="q8_0", seed=8),
    # the field's tiny gradient: dO at 1e-4 of its usual size; dQ, LSE and D_i = dO . O each checked on its own
    Case("kv-q8_0-tiny-do", Nh=4, Nkv=2, D=64, S=29, Skv=77, mask="causal", do_scale=1e-4, k_type="q8_0",
         v_type="q8_0", tags=("d_i",)),
]

SETS = {"smoke": SMOKE, "real": REAL, "types": TYPES, "field": FIELD, "limits": LIMITS}


def select(set_names: list[str], pattern: str | None = None) -> list[Case]:
    """Cases of the named sets whose id matches the regex ``pattern`` (all when None)."""
    import re

    out, seen = [], set()
    for name in set_names:
        if name not in SETS:
            raise InputError(f"unknown case set {name!r}: choose from {sorted(SETS)}")
        for c in SETS[name]:  # a case in two of the sets (or a set named twice) runs once
            if (pattern is None or re.search(pattern, c.id)) and c.id not in seen:
                seen.add(c.id)
                out.append(c)
    return out
