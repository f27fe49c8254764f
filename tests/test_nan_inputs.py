"""A NaN in q, k or v propagates to the outputs it reaches, and only to those: a NaN is a diverged training
run, and an attention op that turns it into finite values hides the divergence. Both NaN bit patterns a run
meets are checked: NumPy's quiet NaN (0x7FC00000) and the one CUDA arithmetic produces (0x7FFFFFFF), whose
mantissa a rounding by integer carry would push into the sign bit (-0.0).

The CUDA parameters (run through tools/gpu-run.sh) guard what a review found there once (notes/kernels.md
"NaN inputs"): a TF32 staging that rounded 0x7FFFFFFF to -0.0, and a query row whose scores are all NaN taken for
a fully masked row (O = 0, LSE = 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from hotggml import ops
from hotggml.graph import Backend, Graph, devices

B, NH, NKV, S = 1, 4, 2, 24
ROW, KEY, COL = 5, 9, 3  # the poisoned query row (head 0) or key (kv head 0), and the column it sits in
NAN_BITS = (0x7FC00000, 0x7FFFFFFF)


def _on_cuda(prec: str, d: int):
    return pytest.param(("CUDA0", prec, d), marks=pytest.mark.cuda, id=f"CUDA0-{prec}-D{d}")


@pytest.fixture(params=[pytest.param(("CPU", "f32", 16), id="CPU-f32-D16"), _on_cuda("default", 16),
                        _on_cuda("f32", 16), _on_cuda("default", 64), _on_cuda("default", 128),
                        _on_cuda("f32", 128), _on_cuda("default", 256),
                        # head sizes padded up to an instance (72 in 80, 160 in 192): zeros past D in the staged rows
                        _on_cuda("default", 72), _on_cuda("f32", 160)])
def where(request, lib):
    """(backend, prec, D): the CPU; CUDA0's register kernels at TF32 and f32 (3xTF32), at instances' head sizes
    and at sizes padded up to one."""
    name, prec, d = request.param
    if name != "CPU" and name not in [n for n, _ in devices()]:
        pytest.skip(f"no {name} in the loaded build (a CPU build, or no GPU here): runs through tools/gpu-run.sh")
    with Backend(name, n_threads=2 if name == "CPU" else None) as be:
        yield be, prec, d


def _forward(where, poison: str, bits: int):
    """O (B, S, Nh, D) and LSE (B, S, Nh) of a causal forward with one NaN (``bits``) in ``poison``."""
    be, prec, d = where
    rng = np.random.default_rng(3)
    x = {"q": rng.standard_normal((B, NH, S, d), dtype=np.float32),
         "k": rng.standard_normal((B, NKV, S, d), dtype=np.float32),
         "v": rng.standard_normal((B, NKV, S, d), dtype=np.float32)}
    at = (0, 0, ROW, COL) if poison == "q" else (0, 0, KEY, COL)
    x[poison][at] = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    with Graph(be) as g:
        t = {n: g.input(x[n]) for n in "qkv"}
        fwd = ops.flash_attn_train(g, t["q"], t["k"], t["v"], None, 1 / np.sqrt(d), prec=prec, causal=True)
        o, lse = ops.get_o(fwd), ops.get_lse(fwd)
        g.build([o, lse])
        g.compute()
        return g.read(o).reshape(B, S, NH, d), g.read(lse).reshape(B, S, NH)


@pytest.mark.parametrize("bits", NAN_BITS, ids=hex)
def test_nan_query_row(where, bits):
    o, lse = _forward(where, "q", bits)
    want = np.zeros((B, S, NH), dtype=bool)
    want[0, ROW, 0] = True
    assert np.array_equal(np.isnan(o).all(axis=-1), want), "the poisoned row is NaN everywhere, no other row is"
    assert np.array_equal(np.isnan(o).any(axis=-1), want)
    assert np.array_equal(np.isnan(lse), want)


@pytest.mark.parametrize("bits", NAN_BITS, ids=hex)
@pytest.mark.parametrize("poison", ["k", "v"])
def test_nan_key(where, poison, bits):
    """Key KEY of kv head 0 reaches query rows i >= KEY (causal) of the heads of its GQA group (0, 1)."""
    o, lse = _forward(where, poison, bits)
    want = np.zeros((B, S, NH), dtype=bool)
    want[0, KEY:, : NH // NKV] = True
    if poison == "k":  # the scores: every column of O and the LSE of the rows that see the key, and no other
        assert np.array_equal(np.isnan(o).any(axis=-1), want)
        assert np.array_equal(np.isnan(o).all(axis=-1), want) and np.array_equal(np.isnan(lse), want)
    else:
        # v: column COL of the rows that see the key; the rows the causal mask hides it from may get it too
        # (P = 0 times NaN, as in the exact chain's P V: the CPU kernel does), the other kv group may not
        assert np.isnan(o[..., COL])[want].all() and not np.isnan(lse).any()
        assert not np.isnan(o[:, :, NH // NKV:]).any()
        assert not np.isnan(np.delete(o, COL, axis=-1)).any()
