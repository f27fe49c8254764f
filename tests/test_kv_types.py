"""K and V in stored types (issue 20, SPEC §4): a frozen f16, bf16 or q8_0 cache the ops read as it is stored.

The references dequantize in NumPy alone (hotggml.kvcache.decode); these tests check that decoding against
the formats' own definitions, the binding's refusals by name, the parity of every type pair on the CPU, and
that the graph holds no converted copy of a cache."""

from __future__ import annotations

import numpy as np
import pytest

from hotggml import cases, kvcache, ops, parity
from hotggml.errors import InputError, InputTypeError
from hotggml.graph import Backend, Graph

RNG = np.random.default_rng(7)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """bf16 by definition: the f32 bits rounded to the high 16, to nearest, ties to even (finite x)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def test_f16_and_bf16_caches_hold_the_formats_roundings(lib):
    x = (RNG.standard_normal((3, 64)) * 10).astype(np.float32)
    np.testing.assert_array_equal(kvcache.stored(x, "f16"), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(kvcache.stored(x, "bf16"), _bf16_round(x))
    assert not np.array_equal(kvcache.stored(x, "bf16"), x)  # the rounding is there to see


def test_q8_0_blocks_decode_to_their_scale_times_int8(lib):
    x = (RNG.standard_normal((5, 96)) * 3).astype(np.float32)
    raw = kvcache.encode(x, "q8_0")
    assert raw.shape == (5, 3 * 34)
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8)
    assert q.min() >= -127 and q.max() <= 127 and np.all(np.abs(q).max(axis=1) == 127)  # each block's amax -> 127
    got = kvcache.decode(raw, "q8_0", 96).reshape(-1, 32)
    np.testing.assert_array_equal(got, q.astype(np.float32) * d)
    # within half a step of the values, the step being the block's amax / 127, plus the scale's rounding to f16
    # (relative 2^-11) times the largest |q|, 127
    step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(got - x.reshape(-1, 32)) <= (0.5 + 127 * 2.0**-11) * step * (1 + 1e-3))


@pytest.mark.parametrize("kind", ["q4_0", "f64", "", None])
def test_unknown_types_are_refused_by_name(lib, kind):
    with Backend("CPU") as be, Graph(be) as g, pytest.raises(InputError, match="K/V type must be one of"):
        g.cache(np.zeros((1, 2, 8, 32), np.float32), kind)


def test_a_q8_0_row_must_be_whole_blocks(lib):
    with Backend("CPU") as be, Graph(be) as g, pytest.raises(InputError, match="blocks of 32 values"):
        g.cache(np.zeros((1, 2, 8, 48), np.float32), "q8_0", "k")
    with pytest.raises(InputTypeError):
        with Backend("CPU") as be, Graph(be) as g:
            g.cache(np.array([["a"] * 32]), "f16")


def _graph(g: Graph, k_type: str, v_type: str, D: int = 32, S: int = 8, Skv: int = 40):
    q = g.param(RNG.standard_normal((1, 4, S, D)).astype(np.float32), "q")
    k = g.cache(RNG.standard_normal((1, 2, Skv, D)).astype(np.float32), k_type, "k")
    v = g.cache(RNG.standard_normal((1, 2, Skv, D)).astype(np.float32), v_type, "v")
    fwd = ops.flash_attn_train(g, q, k, v, None, 1 / np.sqrt(D), prec="f32", causal=True)
    return q, k, v, fwd


def test_no_gradient_is_asked_for_a_cache(lib):
    with Backend("CPU") as be, Graph(be) as g:
        q, k, v, fwd = _graph(g, "q8_0", "bf16")
        d = g.input(np.ones((1, 8, 4, 32), np.float32))
        for grads in ("qk", "v", "qkv"):
            with pytest.raises(InputError, match="cache: a K/V in a stored type takes no gradient"):
                ops.flash_attn_train_back(g, fwd, d, grads)
        back = ops.flash_attn_train_back(g, fwd, d, "q")
        assert back.ne[0] * 4 == q.ptr.nb[3] * q.ne[3]  # the packed result is dQ alone: no dK / dV, no copy


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("f16", "bf16"), ("q8_0", "f32")])
def test_the_graph_holds_no_converted_copy_of_a_cache(lib, k_type, v_type):
    """Every tensor of the autodiff graph is the cache itself or smaller than an f32 copy of it would be."""
    with Backend("CPU") as be, Graph(be) as g:
        q, k, v, fwd = _graph(g, k_type, v_type, D=64, Skv=256)
        o = ops.get_o(fwd)
        g.build([o], g.dot_loss([(o, RNG.standard_normal((1, 8, 4, 64)).astype(np.float32))]))
        for cache in (t for t in (k, v) if t.type_name != "f32"):
            f32_bytes = int(np.prod(cache.ne)) * 4
            copies = [t for t in g.nodes() if t.ptr != cache.ptr and t.ne == cache.ne]
            assert not copies, f"{[c.op_name for c in copies]} in the shape of the {cache.type_name} cache"
            assert all(t.ptr.nb[3] * t.ne[3] < f32_bytes for t in g.nodes() if t.ptr != cache.ptr), cache.type_name
        g.compute()
        assert np.max(np.abs(g.grad(q))) > 0
        assert g.grad(k) is None and g.grad(v) is None  # caches (inputs, not params) get no gradient


def test_set_stores_a_new_cache(lib):
    """set() on a q8_0 cache re-quantizes with ggml's converter: three caches, three float64-checked answers."""
    with Backend("CPU") as be, Graph(be) as g:
        q, k, v, fwd = _graph(g, "q8_0", "f16")
        o = ops.get_o(fwd)
        g.build([o])
        for seed in range(3):
            rng = np.random.default_rng(seed)
            kx, vx = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(2))
            g.set(k, kx)
            g.set(v, vx)
            g.compute()
            ks, vs = kvcache.stored(kx, "q8_0"), kvcache.stored(vx, "f16")
            ref = _reference_o(g.read(q), ks, vs, 1 / np.sqrt(32))
            assert parity.rel_err(g.read(o).transpose(0, 2, 1, 3), ref) < 1e-5, seed


def _reference_o(q, k, v, scale):
    """Causal (Skv - S tail) attention in float64, GQA by repetition: O in (B, Nh, S, Dv)."""
    B, Nh, S, D = q.shape
    Skv = k.shape[2]
    G = Nh // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1).astype(np.float64), np.repeat(v, G, axis=1).astype(np.float64)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), kk) * scale
    i, j = np.arange(S)[:, None], np.arange(Skv)[None, :]
    s = np.where(j <= i + Skv - S, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", p / p.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("case", cases.TYPES, ids=lambda c: c.id)
def test_types_case(lib, case):
    result = parity.run_case(case, "CPU", threads=[1, 2])
    assert result.passed, f"{case.id} ({case.shape}): " + "; ".join(result.failures)
    assert result.checks["grads_only_for_f32_kv"] is True
    compared = set(result.errors["fused~oracle"])
    assert {"O", "LSE", "dQ"} <= compared
    assert ("dK" in compared) == (case.k_type == "f32") and ("dV" in compared) == (case.v_type == "f32")


def test_d_i_is_checked_apart_and_sees_a_wrong_o(lib):
    """The tiny-dO case reports D_i = dO . O - dLSE on its own; an O off by 1e-3 of its size (a mistake a tiny
    dQ would not show) fails it, and the case's dQ is well above the floor its relative error uses."""
    import dataclasses

    case = next(c for c in cases.TYPES if "d_i" in c.tags)
    result = parity.run_case(case, "CPU")
    assert result.passed and "D_i" in result.errors["fused~oracle"], result.failures
    assert result.checks["dQ_ref_above_floor"] is True
    ref = parity.run_oracle(case)
    live = np.ones((case.B, case.S), dtype=bool)
    wrong = dataclasses.replace(ref, o=ref.o * (1 + 1e-3))
    assert parity._d_i_error(case, ref, ref, live) == 0.0
    assert parity._d_i_error(case, wrong, ref, live) > parity.BARS["f32"]
