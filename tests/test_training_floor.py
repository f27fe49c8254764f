"""Training memory at its floor (issue 9 item 6): autodiff hands the fused backward dO alone when only the O
view has a gradient (no packed zeros, no acc), and the backward computes only the gradients that are needed
(a frozen K/V cache gets no dK/dV: neither memory nor work). Values against the float64 oracle, on the CPU
and, where the build has one, on CUDA0 at both precisions (D = 128 and 256: the register kernels' paths
that skip dQ, or dK/dV, or store one of them only)."""

from __future__ import annotations

import numpy as np
import pytest

from hotggml import oracle, ops
from hotggml.bench import DIT_FULL, arena_bytes
from hotggml.errors import InputError
from hotggml.graph import Backend, Graph, devices
from hotggml.parity import BARS

B, NH, NKV, S = 2, 4, 2, 40


def _on_cuda(prec: str, d: int):
    return pytest.param(("CUDA0", prec, d), marks=pytest.mark.cuda, id=f"CUDA0-{prec}-D{d}")


@pytest.fixture(params=[pytest.param(("CPU", "f32", 16), id="CPU-f32-D16"), _on_cuda("f32", 128),
                        _on_cuda("default", 128), _on_cuda("default", 256)])
def where(request, lib):
    """(backend, prec, D, bar): the CPU at f32, and CUDA0's register kernels at f32 (the compensated
    3xTF32 product) and TF32."""
    name, prec, d = request.param
    if name != "CPU":
        if name not in [n for n, _ in devices()]:
            pytest.skip(f"no {name} in the loaded build (a CPU build, or no GPU here): runs through tools/gpu-run.sh")
    with Backend(name, n_threads=2 if name == "CPU" else None) as be:
        yield be, prec, d, BARS["f32" if prec == "f32" else "tf32"]


def _rel(x, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(x - ref)) / max(float(np.max(np.abs(ref))), 1e-5))


def _data(D: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    return {
        "D": D,
        "q": rng.standard_normal((B, NH, S, D), dtype=np.float32),
        "k": rng.standard_normal((B, NKV, S, D), dtype=np.float32),
        "v": rng.standard_normal((B, NKV, S, D), dtype=np.float32),
        "w": rng.standard_normal((B, S, NH, D), dtype=np.float32),    # dL/dO, NumPy order of O [Dv, Nh, S, B]
        "w2": rng.standard_normal((B, S, NH, D), dtype=np.float32),
        "wl": rng.standard_normal((B, S, NH), dtype=np.float32),      # dL/dLSE, NumPy order of LSE [Nh, S, B]
    }


@pytest.fixture
def data(where):
    return _data(where[2])


@pytest.fixture
def cpu_data():
    return _data(16)


def _graph(where, data, params: str, extra=None, compute=True):
    """q, k, v (params where named in ``params``, else inputs), causal fused forward, loss sum(O * w) plus
    the terms ``extra(g, fwd)`` returns; built, and computed unless ``compute`` is false."""
    be, prec = where[0], where[1]
    g = Graph(be)
    t = {n: (g.param if n in params else g.input)(data[n]) for n in "qkv"}
    fwd = ops.flash_attn_train(g, t["q"], t["k"], t["v"], None, 1 / np.sqrt(data["D"]), prec=prec, causal=True)
    o = ops.get_o(fwd)
    terms = [(o, data["w"])] + (extra(g, fwd) if extra else [])
    g.build([o], g.dot_loss(terms))
    if compute:
        g.compute()
    return g, t


def _oracle(data, do, dlse=None):
    mask = np.triu(np.full((S, S), -np.inf), 1)[None]
    return oracle.attention_backward(data["q"], data["k"], data["v"], mask, 1 / np.sqrt(data["D"]), do, dlse)


def _do(w):
    return w.transpose(0, 2, 1, 3).astype(np.float64)  # (B, S, Nh, D) -> (B, Nh, S, D)


def _back(g):
    (back,) = g.find_nodes(ops.OP_FLASH_ATTN_TRAIN_BACK)
    return back


def _check_grads(g, t, want: str, refs, bar: float):
    for name, ref in zip("qkv", refs):
        if name in want:
            assert np.max(np.abs(ref)) > 0  # a vacuous reference would pass anything
            assert _rel(g.grad(t[name]), ref) < bar, name


def test_o_alone_reaches_the_backward_as_do(where, data):
    g, t = _graph(where, data, "qkv")
    with g:
        back = _back(g)
        assert back.ptr.op_params[1] == 0, "the backward got the packed [O | LSE] gradient, not dO alone"
        d = back.ptr.src[5]
        assert tuple(d.ne[i] for i in range(4)) == (data["D"], NH, S, B)
        assert not {"SCALE", "ACC"} & {n.op_name for n in g.nodes()}, "packed zeros / acc are still built"
        _check_grads(g, t, "qkv", _oracle(data, _do(data["w"])), where[3])


def test_lse_gradient_still_packed(where, data):
    def lse_term(g, fwd):
        return [(ops.get_lse(fwd), data["wl"])]

    g, t = _graph(where, data, "qkv", lse_term)
    with g:
        assert _back(g).ptr.op_params[1] == 1  # dLSE in the packed gradient
        _check_grads(g, t, "qkv", _oracle(data, _do(data["w"]), data["wl"].transpose(0, 2, 1)), where[3])


def test_two_o_views_add(where, data):
    def second_o(g, fwd):
        return [(ops.get_o(fwd), data["w2"])]

    g, t = _graph(where, data, "qkv", second_o)
    with g:
        assert _back(g).ptr.op_params[1] == 0
        assert "ACC" not in {n.op_name for n in g.nodes()}
        _check_grads(g, t, "qkv", _oracle(data, _do(data["w"]) + _do(data["w2"])), where[3])


def test_part_of_o_expands_to_the_packed_gradient(where, data):
    half = S // 2

    def first_rows(g, fwd):  # a view of O's first half of the query rows, batch 0: not the O view
        f = fwd.ptr
        D = data["D"]
        view = g.wrap(g.lib.ggml_view_3d(g.ctx, f, D, NH, half, D * 4, D * NH * 4, 0))
        return [(view, data["w2"][0, :half])]

    g, t = _graph(where, data, "qkv", first_rows)
    with g:
        do = _do(data["w"])
        do[0, :, :half] += _do(data["w2"][:1, :half])[0]
        _check_grads(g, t, "qkv", _oracle(data, do), where[3])


@pytest.mark.parametrize("params,want", [("q", "q"), ("kv", "kv"), ("qv", "qv"), ("k", "k")])
def test_backward_computes_only_what_is_needed(where, data, params, want):
    g, t = _graph(where, data, params)
    with g:
        back = _back(g)
        assert ops.back_grads(back) == want
        sizes = {"q": data["q"].nbytes, "k": data["k"].nbytes, "v": data["v"].nbytes}
        # packed parts in q, k, v order, each but the last padded to 32 bytes (GGML_MEM_ALIGN >= 16)
        parts = [sizes[c] for c in want]
        assert sum(parts) <= int(g.lib.ggml_nbytes(back.ptr)) <= sum(parts) + 32 * (len(parts) - 1)
        _check_grads(g, t, want, _oracle(data, _do(data["w"])), where[3])


def test_frozen_kv_arena_smaller(where, data):
    arenas = {}
    for params in ("qkv", "q"):
        g, _ = _graph(where, data, params, compute=False)
        with g:
            arenas[params] = g.arena_bytes()
    # dK and dV (and their gradient sums) are gone: at least their bytes
    assert arenas["qkv"] - arenas["q"] >= data["k"].nbytes + data["v"].nbytes


def test_back_views_refuse_gradients_not_computed(cpu, cpu_data):
    data = cpu_data
    with Graph(cpu) as g:
        tq, tk, tv = (g.input(data[n]) for n in "qkv")
        fwd = ops.flash_attn_train(g, tq, tk, tv, None, 0.25)
        do = g.input(data["w"])
        back = ops.flash_attn_train_back(g, fwd, do, grads="q")
        assert ops.back_grads(back) == "q"
        ops.get_dq(back)
        for getter in (ops.get_dk, ops.get_dv):
            with pytest.raises(InputError, match="does not compute"):
                getter(back)
        for bad in ("", "qq", "x", "qkvx"):
            with pytest.raises(InputError, match="grads must name"):
                ops.flash_attn_train_back(g, fwd, do, grads=bad)


def test_fused_arena_at_s3000_under_9_percent_of_chain():
    from dataclasses import replace

    fused, chain = arena_bytes(replace(DIT_FULL, S=3000, Skv=3000))
    assert fused <= 0.09 * chain, f"fused {fused / 2**20:.1f} MiB is {fused / chain:.1%} of the chain's {chain / 2**20:.1f} MiB"


def test_grad_of_the_packed_forward_is_refused_by_name(cpu, cpu_data):
    # autodiff keeps the packed forward's gradient as dO alone (another shape) in memory it reuses
    g, t = _graph((cpu, "f32", 16, BARS["f32"]), cpu_data, "qkv")
    with g:
        (fwd,) = g.find_nodes(ops.OP_FLASH_ATTN_TRAIN)
        with pytest.raises(InputError, match="FLASH_ATTN_TRAIN .* is not kept"):
            g.grad(fwd)
        assert g.grad(t["q"]) is not None
