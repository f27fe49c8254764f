"""The cffi binding: validation before C, backends, gradients, precision, the direct backward,
stale-library refusal and determinism.

Right values come from the float64 oracle (hotggml.oracle), never from the code under test.
Layouts: NumPy shapes are ggml's ``ne`` reversed; q (B, Nh, S, D), k (B, Nkv, Skv, D),
v (B, Nkv, Skv, Dv); O is read from ggml [Dv, Nh, S, B] as (B, S, Nh, Dv).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from hotggml import ffi as hffi
from hotggml import ops, oracle
from hotggml.errors import BackendError, InputError, LibraryError, UsageError
from hotggml.graph import Backend, Graph, Tensor
from hotggml.parity import rel_err

BAR = 1e-4  # SPEC §6: f32 worst relative error


def _inputs(B=1, Nh=2, Nkv=1, S=5, Skv=7, D=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Nh, S, D)).astype(np.float32),
            rng.standard_normal((B, Nkv, Skv, D)).astype(np.float32),
            rng.standard_normal((B, Nkv, Skv, Dv)).astype(np.float32))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# -- validation: Python raises before ggml's GGML_ASSERT would kill the interpreter ------------

def _qkv(g: Graph, q_shape=(1, 2, 5, 8), k_shape=(1, 1, 7, 8), v_shape=(1, 1, 7, 6), q_dtype=np.float32):
    return (g.input(np.zeros(q_shape, q_dtype), "q"), g.input(np.zeros(k_shape, np.float32), "k"),
            g.input(np.zeros(v_shape, np.float32), "v"))


@pytest.mark.parametrize("q_shape,k_shape,v_shape,q_dtype,exc,match", [
    ((1, 2, 5, 8), (1, 1, 7, 8), (1, 1, 7, 6), np.float16, TypeError, "q must be float32"),
    ((1, 2, 5, 8), (1, 1, 7, 9), (1, 1, 7, 6), np.float32, ValueError, "D"),
    ((1, 3, 5, 8), (1, 2, 7, 8), (1, 2, 7, 6), np.float32, ValueError, "Nh % Nkv"),
    ((2, 2, 5, 8), (1, 1, 7, 8), (1, 1, 7, 6), np.float32, ValueError, "batch"),
    ((1, 2, 5, 8), (2, 1, 7, 8), (2, 1, 7, 6), np.float32, ValueError, "batch"),
    ((1, 2, 5, 8), (1, 1, 7, 8), (1, 1, 6, 6), np.float32, ValueError, "Skv"),
], ids=["q-float16", "D-mismatch", "Nh-not-multiple-of-Nkv", "batch-q", "batch-kv", "v-Skv-mismatch"])
def test_attention_input_validation(cpu, q_shape, k_shape, v_shape, q_dtype, exc, match):
    with Graph(cpu) as g:
        q, k, v = _qkv(g, q_shape, k_shape, v_shape, q_dtype)
        with pytest.raises(exc, match=match):
            ops.flash_attn_train(g, q, k, v, None, 0.5)


def test_float16_param_is_refused_as_q(cpu):
    """q must be f32: a float16 leaf (what a float16 'param' would be) is refused with TypeError."""
    with Graph(cpu) as g:
        q16 = g.input(np.zeros((1, 2, 5, 8), np.float16), "q16")
        assert q16.dtype == np.float16
        _, k, v = _qkv(g)
        with pytest.raises(TypeError, match="float32"):
            ops.flash_attn_train(g, q16, k, v, None, 0.5)


@pytest.mark.parametrize("mask_shape,dtype,match,exc", [
    ((1, 5, 7), np.float32, "must be f16, got f32", TypeError),  # wrong dtype
    ((1, 4, 7), np.float16, "S'", ValueError),          # S' = 4 < S = 5
    ((2, 1, 5, 7), np.float16, "1, 1 or", ValueError),   # ggml ne [7, 5, 1, 2]: batch 2 != B = 1
    ((1, 2, 5, 7), np.float16, "1, 1 or", ValueError),   # ggml ne [7, 5, 2, 1]: ne[2] != 1
    ((1, 5, 6), np.float16, "Skv", ValueError),         # ne[0] != Skv
], ids=["mask-float32", "mask-short-rows", "mask-batch", "mask-ne2", "mask-Skv"])
def test_mask_validation(cpu, mask_shape, dtype, match, exc):
    with Graph(cpu) as g:
        q, k, v = _qkv(g)
        m = g.input(np.zeros(mask_shape, dtype), "mask")
        with pytest.raises(exc, match=match):
            ops.flash_attn_train(g, q, k, v, m, 0.5)


def test_mask_non_contiguous_refused(cpu):
    with Graph(cpu) as g:
        q, k, v = _qkv(g)
        raw = g.input(np.zeros((1, 1, 7, 5), np.float16), "mask_t")  # ggml [5, 7, 1, 1]
        m = g.permute(raw, 1, 0, 2, 3)                                 # ggml [7, 5, 1, 1], strided
        assert m.ne == (7, 5, 1, 1) and not m.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            ops.flash_attn_train(g, q, k, v, m, 0.5)


def test_scale_and_prec_validation(cpu):
    with Graph(cpu) as g:
        q, k, v = _qkv(g)
        with pytest.raises(ValueError, match="finite"):
            ops.flash_attn_train(g, q, k, v, None, float("nan"))
        with pytest.raises(ValueError, match="precision"):
            ops.flash_attn_train(g, q, k, v, None, 0.5, prec="tf16")


def test_backward_d_validation(cpu):
    with Graph(cpu) as g:
        q, k, v = _qkv(g)
        fwd = ops.flash_attn_train(g, q, k, v, None, 0.5)
        o_ne = ops.get_o(fwd).ne                       # [6, 2, 5, 1]
        with pytest.raises(ValueError, match="shaped like O"):
            ops.flash_attn_train_back(g, fwd, g.input(np.zeros((1, 5, 2, 5), np.float32)))
        with pytest.raises(TypeError, match="float32"):
            ops.flash_attn_train_back(g, fwd, g.input(np.zeros(tuple(reversed(o_ne)), np.float16)))


@pytest.mark.parametrize("axes", [(0, 1, 2), (0, 0, 1, 2), (0, 1, 2, 4), (1, 2, 3, 4)])
def test_bad_permute_axes(cpu, axes):
    with Graph(cpu) as g:
        t = g.input(np.zeros((2, 3, 4, 5), np.float32))
        with pytest.raises(ValueError, match="permutation"):
            g.permute(t, *axes)


@pytest.mark.parametrize("ne", [(-2, -2, 1, 1), (4, 0, 1, 1), (2, 2, 1), (2.0, 2, 1, 1), (True, 4, 1, 1), "4111"])
def test_reshape_takes_four_positive_ints(cpu, ne):
    with Graph(cpu) as g:
        t = g.input(np.ones((4,), np.float32))
        with pytest.raises(InputError, match="positive int dims"):
            g.reshape(t, ne)
        assert g.reshape(t, (2, 2, 1, 1)).ne == (2, 2, 1, 1)  # the Graph stays usable


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_mask_with_plus_inf_or_nan_is_refused_by_name(cpu, bad):
    q = np.ones((1, 1, 4, 8), np.float32)
    mask = np.zeros((4, 4), np.float16)
    mask[1, 2] = bad
    with Graph(cpu) as g:
        tq, tk, tv = g.param(q), g.param(q), g.param(q)
        with pytest.raises(InputError, match=r"finite values or -inf only, got .* at \(1, 2\)"):
            ops.flash_attn_train(g, tq, tk, tv, g.input(mask), 0.5)
        mask[1, 2] = -np.inf  # -INF is the contract's masked entry
        m = g.input(mask)
        fwd = ops.flash_attn_train(g, tq, tk, tv, m, 0.5)
        g.build([ops.get_o(fwd)])
        mask[0, 0] = bad
        with pytest.raises(InputError, match=r"set\(\): an attention mask holds finite values or -inf only"):
            g.set(m, mask)


def test_reshape_element_count(cpu):
    with Graph(cpu) as g:
        t = g.input(np.zeros((2, 3, 4, 5), np.float32))
        with pytest.raises(ValueError, match="element count"):
            g.reshape(t, (5, 4, 3, 3))
        with pytest.raises(ValueError, match="contiguous"):
            g.reshape(g.permute(t, 1, 0, 2, 3), (5, 4, 3, 2))


def test_loss_weight_shape_mismatch(cpu):
    with Graph(cpu) as g:
        t = g.input(np.zeros((3, 4), np.float32))
        with pytest.raises(ValueError, match="loss weight shape"):
            g.dot_loss([(t, np.zeros((4, 3), np.float32))])


def test_unsupported_dtype_and_rank(cpu):
    with Graph(cpu) as g:
        with pytest.raises(TypeError, match="unsupported dtype"):
            g.input(np.zeros((2, 3), np.int64))
        assert g.input(np.zeros((2, 3), np.int32)).dtype == np.int32  # positions, ids
        with pytest.raises(TypeError, match="unsupported dtype"):
            g.input(np.zeros((2, 3), np.float64))
        with pytest.raises(ValueError, match="at most 4 dims"):
            g.input(np.zeros((1, 2, 1, 2, 2), np.float32))
        with pytest.raises(ValueError, match="1 to 4"):
            g.new_tensor((1, 2, 3, 4, 5))
        with pytest.raises(TypeError):
            g.new_tensor((2, 3), np.int64)


def test_other_shape_checks(cpu):
    with Graph(cpu) as g:
        a = g.input(np.zeros((3, 4), np.float32))
        b = g.input(np.zeros((4, 3), np.float32))
        with pytest.raises(ValueError, match="shapes differ"):
            g.add(a, b)
        with pytest.raises(ValueError, match="shapes differ"):
            g.mul(a, b)
        with pytest.raises(ValueError, match="do not fit"):
            g.mul_mat(a, g.input(np.zeros((3, 5), np.float32)))
        with pytest.raises(ValueError, match="multiples"):
            g.repeat(a, g.input(np.zeros((3, 5), np.float32)))
        with pytest.raises(ValueError, match="scalar"):
            g.build([a], loss=a)


def test_validation_leaves_graph_usable(cpu):
    """After a refused op the interpreter and the graph are fine: a valid fused op still computes."""
    qn, kn, vn = _inputs()
    with Graph(cpu) as g:
        q, k, v = g.input(qn), g.input(kn), g.input(vn)
        with pytest.raises(TypeError):
            ops.flash_attn_train(g, q, k, v, g.input(np.zeros((1, 5, 7), np.float32)), 0.5)
        fwd = ops.flash_attn_train(g, q, k, v, None, 0.5)
        o = ops.get_o(fwd)
        g.build([o])
        g.compute(poison=[fwd])
        ref, _ = oracle.attention_forward(qn, kn, vn, None, 0.5)
        assert rel_err(g.read(o).transpose(0, 2, 1, 3), ref) <= BAR


# -- backends ---------------------------------------------------------------------------------

def test_unknown_backend_lists_devices(lib):
    with pytest.raises(BackendError) as err:
        Backend("NoSuchDevice")
    msg = str(err.value)
    assert "NoSuchDevice" in msg and "CPU" in msg


def test_n_threads_validation(lib):
    with pytest.raises(ValueError):
        Backend("CPU", n_threads=0)


def test_backend_calls_come_through_the_registry(lib):
    """The CPU backend's thread count and RPC's add_server are reached through their registry entries (the
    only way into a GGML_BACKEND_DL module), so the same binding drives a linked and a portable build."""
    cpu_reg = lib.ggml_backend_dev_backend_reg(lib.ggml_backend_dev_by_name(b"CPU"))
    assert hffi.backend_proc(cpu_reg, "ggml_backend_set_n_threads", "ggml_backend_set_n_threads_t") is not None
    assert hffi.backend_proc(cpu_reg, "ggml_backend_no_such_call", "ggml_backend_set_n_threads_t") is None
    rpc_reg = lib.ggml_backend_reg_by_name(b"RPC")  # every build has RPC
    assert rpc_reg != hffi.ffi.NULL
    assert hffi.backend_proc(rpc_reg, "ggml_backend_rpc_add_server", "ggml_backend_rpc_add_server_t") is not None


def test_a_portable_build_maps_no_cpu_variant_before_the_registry_chooses(lib, tmp_path, monkeypatch):
    """With GGML_BACKEND_DL the binding preloads libggml-base alone: a CPU variant this CPU cannot run must
    never be mapped (here a file that is no library at all: opening it would raise)."""
    real = hffi.find_lib_dir()
    (tmp_path / "libggml-base.so").symlink_to(real / "libggml-base.so")
    (tmp_path / "libggml-cpu-future.so").write_bytes(b"not an ELF file")
    opened = []
    monkeypatch.setattr(hffi.ffi, "dlopen", lambda path: opened.append(path))
    hffi._preload_dependencies(tmp_path, backend_dl=True)
    assert opened == [str(tmp_path / "libggml-base.so")]
    opened.clear()
    hffi._preload_dependencies(tmp_path, backend_dl=False)  # a linked build: every library beside libggml
    assert opened == [str(tmp_path / "libggml-base.so"), str(tmp_path / "libggml-cpu-future.so")]


# -- gradients, round trips --------------------------------------------------------------------

def test_grad_of_permuted_param_in_logical_shape(cpu):
    """q is a permuted (non-contiguous) view of a param: its gradient comes back through the inverse
    permutation, which stock ggml stored as a strided view; with patch backward-strided-grads it is made
    contiguous where it is stored. Graph.grad gives it in the param's logical shape, matching the oracle."""
    B, Nh, Nkv, S, Skv, D, Dv = 2, 4, 2, 5, 7, 8, 6
    qn, kn, vn = _inputs(B, Nh, Nkv, S, Skv, D, Dv, seed=1)
    do = np.random.default_rng(2).standard_normal((B, S, Nh, Dv)).astype(np.float32)
    scale = 1 / np.sqrt(D)
    with Graph(cpu) as g:
        base = g.param(np.ascontiguousarray(qn.transpose(0, 2, 1, 3)), "q_base")  # ggml [D, Nh, S, B]
        q = g.permute(base, 0, 2, 1, 3)                                              # ggml [D, S, Nh, B]
        assert q.ne == (D, S, Nh, B) and not q.is_contiguous()
        k, v = g.param(kn), g.param(vn)
        fwd = ops.flash_attn_train(g, q, k, v, None, scale, "f32")
        o = ops.get_o(fwd)
        g.build([o], g.dot_loss([(o, do)]))
        raw = Tensor(g, g.lib.ggml_graph_get_grad(g.gf, base.ptr))
        assert raw.is_contiguous(), "backward-strided-grads stores every gradient term contiguous"
        g.compute(poison=g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN")) + g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN_BACK")))
        dq_base = g.grad(base)
        dk, dv = g.grad(k), g.grad(v)
    rq, rk, rv = oracle.attention_backward(qn, kn, vn, None, scale, do.transpose(0, 2, 1, 3))
    assert dq_base.shape == (B, S, Nh, D)
    assert np.max(np.abs(rq)) > 0 and np.max(np.abs(rk)) > 0 and np.max(np.abs(rv)) > 0
    assert rel_err(dq_base, rq.transpose(0, 2, 1, 3)) <= BAR
    assert rel_err(dk, rk) <= BAR
    assert rel_err(dv, rv) <= BAR


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_round_trip_bitwise(cpu, dtype):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 3, 5, 7)).astype(dtype)
    a.reshape(-1)[:4] = [0.0, -0.0, np.inf, -np.inf]
    a.reshape(-1)[4] = np.finfo(dtype).tiny / 4  # subnormal
    with Graph(cpu) as g:
        t = g.input(a, "a")
        assert t.dtype == np.dtype(dtype) and t.ne == (7, 5, 3, 2)
        g.build([t])
        g.compute()
        back = g.read(t)
    assert back.dtype == np.dtype(dtype) and back.shape == a.shape
    utype = np.uint16 if dtype == np.float16 else np.uint32
    assert np.array_equal(back.view(utype), a.view(utype))


def test_read_of_strided_view(cpu):
    """Graph.read honours strides: a permuted view reads back as the transposed array."""
    a = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    with Graph(cpu) as g:
        t = g.input(a)
        p = g.permute(t, 1, 0, 2, 3)  # ne [4, 5, 3, 2]
        c = g.cont(p)
        g.build([c])
        g.compute()
        np.testing.assert_array_equal(g.read(c), a.transpose(0, 1, 3, 2))


# -- precision ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prec", ["f32", "default"])
def test_precision_request_reaches_backward(cpu, prec):
    qn, kn, vn = _inputs()
    with Graph(cpu) as g:
        q, k, v = g.param(qn), g.param(kn), g.param(vn)
        fwd = ops.flash_attn_train(g, q, k, v, None, 0.5, prec=prec) if prec != "default" \
            else ops.flash_attn_train(g, q, k, v, None, 0.5)
        assert ops.get_prec(fwd) == prec
        o = ops.get_o(fwd)
        g.build([o], g.dot_loss([(o, np.ones((1, 5, 2, 6), np.float32))]))
        backs = g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN_BACK"))
        assert len(backs) == 1
        assert ops.get_prec(backs[0]) == prec
        fwds = g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN"))
        assert len(fwds) == 1 and ops.get_prec(fwds[0]) == prec


# -- the direct backward API ---------------------------------------------------------------------

SHAPE = dict(B=2, Nh=4, Nkv=2, S=7, Skv=11, D=8, Dv=5)  # O has 2*4*7*5 = 280 floats; GQA; per-batch mask


def _mask(B, S, Skv, seed=5):
    rng = np.random.default_rng(seed)
    m = rng.uniform(-2, 2, size=(B, S + 1, Skv)).astype(np.float32)  # S' = S + 1
    m[:, :, -2:] = -np.inf                                           # two padded keys
    return m.astype(np.float16)


def _direct_backward(cpu, with_dlse: bool):
    B, Nh, Nkv, S, Skv, D, Dv = (SHAPE[n] for n in ("B", "Nh", "Nkv", "S", "Skv", "D", "Dv"))
    qn, kn, vn = _inputs(B, Nh, Nkv, S, Skv, D, Dv, seed=4)
    mn = _mask(B, S, Skv)
    scale = 1 / np.sqrt(D)
    rng = np.random.default_rng(6)
    do = rng.standard_normal((B, S, Nh, Dv)).astype(np.float32)     # ggml [Dv, Nh, S, B]
    dlse = rng.standard_normal((B, S, Nh)).astype(np.float32) if with_dlse else None  # ggml [Nh, S, B]
    with Graph(cpu) as g:
        q, k, v = g.input(qn, "q"), g.input(kn, "k"), g.input(vn, "v")
        m = g.input(mn[:, None], "mask")                              # ggml [Skv, S', 1, B]
        fwd = ops.flash_attn_train(g, q, k, v, m, scale, "f32")
        o_ne, lse = ops.get_o(fwd).ne, ops.get_lse(fwd)
        if with_dlse:
            packed = np.zeros(fwd.ne[0], np.float32)
            n_o = int(np.prod(o_ne))
            offs = lse.ptr.view_offs // 4
            assert fwd.ne[1:] == (1, 1, 1) and offs >= n_o
            packed[:n_o] = do.reshape(-1)
            packed[offs:offs + dlse.size] = dlse.reshape(-1)
            d = g.input(packed.reshape(tuple(reversed(fwd.ne))), "d_packed")
            assert d.ne == fwd.ne
        else:
            d = g.input(do, "dO")
            assert d.ne == o_ne
        back = ops.flash_attn_train_back(g, fwd, d)
        dq, dk, dv = ops.get_dq(back), ops.get_dk(back), ops.get_dv(back)
        assert dq.ne == q.ne and dk.ne == k.ne and dv.ne == v.ne
        g.build([dq, dk, dv])
        g.compute(poison=[fwd, back])
        got = g.read(dq), g.read(dk), g.read(dv)
    ref = oracle.attention_backward(qn, kn, vn, mn, scale, do.transpose(0, 2, 1, 3),
                                    None if dlse is None else dlse.transpose(0, 2, 1))
    return got, ref


@pytest.mark.parametrize("with_dlse", [False, True], ids=["dO", "packed-dO-dLSE"])
def test_direct_backward_matches_oracle(cpu, with_dlse):
    got, ref = _direct_backward(cpu, with_dlse)
    for name, x, r in zip(("dQ", "dK", "dV"), got, ref):
        assert np.max(np.abs(r)) > 0, f"{name}: zero reference, vacuous"
        assert x.shape == r.shape
        err = rel_err(x, r)
        assert err <= BAR, f"{name} rel err {err:.2e}"
    # padded key columns get exactly zero dK / dV
    assert np.all(got[1][:, :, -2:] == 0) and np.all(got[2][:, :, -2:] == 0)


def test_direct_backward_dlse_matters(cpu):
    """Guard: the dLSE part changes dQ/dK, so the packed test could not pass by ignoring it."""
    _, ref_plain = _direct_backward(cpu, False)
    got_lse, ref_lse = _direct_backward(cpu, True)
    assert rel_err(ref_plain[0], ref_lse[0]) > 1e-2
    assert rel_err(got_lse[0], ref_plain[0]) > 1e-2


# -- autodiff accumulates ---------------------------------------------------------------------------

def test_autodiff_adds_to_existing_gradient(cpu):
    """q feeds the fused op and another node: L = sum(O*W) + sum(q*W2) -> dL/dq = dQ + W2."""
    B, Nh, Nkv, S, Skv, D, Dv = 1, 2, 1, 6, 9, 8, 4
    qn, kn, vn = _inputs(B, Nh, Nkv, S, Skv, D, Dv, seed=7)
    rng = np.random.default_rng(8)
    w = rng.standard_normal((B, S, Nh, Dv)).astype(np.float32)
    w2 = rng.standard_normal(qn.shape).astype(np.float32)
    scale = 1 / np.sqrt(D)
    with Graph(cpu) as g:
        q, k, v = g.param(qn, "q"), g.param(kn, "k"), g.param(vn, "v")
        fwd = ops.flash_attn_train(g, q, k, v, None, scale, "f32")
        o = ops.get_o(fwd)
        g.build([o], g.dot_loss([(o, w), (q, w2)]))
        g.compute(poison=g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN")) + g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN_BACK")))
        gq, gk, gv = g.grad(q), g.grad(k), g.grad(v)
    rq, rk, rv = oracle.attention_backward(qn, kn, vn, None, scale, w.transpose(0, 2, 1, 3))
    want = rq + w2
    # both parts matter: missing either one would be far off
    assert rel_err(rq, want) > 1e-2 and rel_err(w2.astype(np.float64), want) > 1e-2
    assert rel_err(gq, want) <= BAR
    assert rel_err(gk, rk) <= BAR
    assert rel_err(gv, rv) <= BAR


# -- the library stamp --------------------------------------------------------------------------------

def test_parse_stamp():
    assert hffi.parse_stamp("pin=abc;series=def") == {"pin": "abc", "series_hash": "def"}
    assert hffi.parse_stamp("series=s1;pin=p1;backend=cpu") == {"pin": "p1", "series_hash": "s1"}
    assert hffi.parse_stamp("pin=a=b;junk;series=") == {"pin": "a=b", "series_hash": ""}
    assert hffi.parse_stamp("") == {"pin": "", "series_hash": ""}


def test_loaded_stamp_is_this_checkout(lib, cpu_build):
    from hotggml import pin, series

    stamp = hffi.parse_stamp(hffi.ffi.string(lib.hotggml_build_stamp()).decode())
    assert stamp == {"pin": pin.UPSTREAM_COMMIT, "series_hash": series.code_hash()}
    assert stamp["series_hash"] == cpu_build.series_hash


@pytest.mark.parametrize("what", ["series_hash", "pin", "expected_stamp"])
def test_stale_library_refused(lib, monkeypatch, what):
    from hotggml import pin_record, series

    try:
        with monkeypatch.context() as m:
            if what == "series_hash":
                m.setattr(series, "code_hash", lambda *a, **k: "0" * 64)
            elif what == "pin":
                m.setattr(pin_record, "UPSTREAM_COMMIT", "1" * 40)
            else:
                m.setattr(hffi, "expected_stamp", lambda lib_dir: {"pin": "2" * 40, "series_hash": "3" * 64})
            hffi.load.cache_clear()
            with pytest.raises(LibraryError, match="hotggml build") as err:
                hffi.load()
            assert "stale" in str(err.value)
    finally:
        hffi.load.cache_clear()
    assert hffi.load() is not None  # restored: loads again


def test_a_message_edit_keeps_the_library_a_code_edit_refuses_it(lib, monkeypatch, tmp_path):
    """The stamp carries the series' code hash: editing a patch's message (the work repo re-applies: the
    series hash moves) leaves the built library loadable; editing what it changes makes load() refuse it."""
    import shutil

    from hotggml import paths, series

    copy = tmp_path / "patches"
    shutil.copytree(paths.PATCHES_DIR, copy)
    target = copy / "alloc-free-blocks.patch"
    text = target.read_text()
    at = text.index("\ndiff --git ")
    message, diff = text[:at], text[at:]
    assert "MAX_FREE_BLOCKS 1024" in diff
    target.write_text(message.replace("Subject: ", "Subject: (reworded) ", 1) + diff)
    code = series.code_hash(paths.PATCHES_DIR)
    assert series.series_hash(copy) != series.series_hash(paths.PATCHES_DIR)
    assert series.code_hash(copy) == code
    try:
        with monkeypatch.context() as m:
            m.setattr(paths, "PATCHES_DIR", copy)
            hffi.load.cache_clear()
            assert hffi.load() is not None  # a message edit: the same code, the library current
            target.write_text(message + diff.replace("MAX_FREE_BLOCKS 1024", "MAX_FREE_BLOCKS 1025", 1))
            assert series.code_hash(copy) != code
            hffi.load.cache_clear()
            with pytest.raises(LibraryError, match="stale.*hotggml build"):
                hffi.load()
    finally:
        hffi.load.cache_clear()
    assert hffi.load() is not None


# -- determinism ------------------------------------------------------------------------------------

def _fused_fwd_bwd(be: Backend, seed=9):
    """Fused fwd + autodiff bwd at S=70, Skv=150 (several tiles / row blocks), causal tail mask."""
    B, Nh, Nkv, S, Skv, D = 1, 2, 1, 70, 150, 32
    qn, kn, vn = _inputs(B, Nh, Nkv, S, Skv, D, D, seed=seed)
    i, j = np.arange(S)[:, None], np.arange(Skv)[None, :]
    mask = np.where(j <= i + (Skv - S), 0.0, -np.inf).astype(np.float16)[None]  # (1, S, Skv)
    rng = np.random.default_rng(seed + 1)
    do = rng.standard_normal((B, S, Nh, D)).astype(np.float32)
    scale = 1 / np.sqrt(D)
    g = Graph(be)
    q, k, v = g.param(qn), g.param(kn), g.param(vn)
    m = g.input(mask[:, None], "mask")
    fwd = ops.flash_attn_train(g, q, k, v, m, scale, "f32")
    o, lse = ops.get_o(fwd), ops.get_lse(fwd)
    g.build([o, lse], g.dot_loss([(o, do)]))
    fused = g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN")) + g.find_nodes(ops.op_id("FLASH_ATTN_TRAIN_BACK"))
    assert len(fused) == 2

    def run():
        g.compute(poison=fused)
        return [g.read(o), g.read(lse), g.grad(q), g.grad(k), g.grad(v)]

    ref = oracle.attention_backward(qn, kn, vn, mask, scale, do.transpose(0, 2, 1, 3))
    return g, run, ref


def test_deterministic_run_after_run(lib):
    with Backend("CPU", n_threads=2) as be:
        g, run, ref = _fused_fwd_bwd(be)
        with g:
            first, second = run(), run()
    for a, b in zip(first, second):
        assert np.all(np.isfinite(a))
        assert np.array_equal(_bits(a), _bits(b))
    for x, r in zip(first[2:], ref):
        assert np.max(np.abs(r)) > 0 and rel_err(x, r) <= BAR


def test_deterministic_across_threads(lib):
    outs = []
    for n in (1, 2):
        with Backend("CPU", n_threads=n) as be:
            g, run, _ = _fused_fwd_bwd(be)
            with g:
                outs.append(run())
    for a, b in zip(*outs):
        assert np.all(np.isfinite(a))
        assert np.array_equal(_bits(a), _bits(b))


def test_nan_score_propagates_instead_of_reading_as_masked(cpu):
    """A NaN in q reaches O and LSE of its row (a fully masked row is decided by the mask, not by
    the softmax sum): training must see divergence, not a silently zeroed row."""
    q, k, v = _inputs(S=5, Skv=40)  # Skv > one key tile
    q[0, 1, 2, 3] = np.nan           # batch 0, head 1, query 2
    with Graph(cpu) as g:
        fwd = ops.flash_attn_train(g, g.input(q), g.input(k), g.input(v), None, 0.5)
        o, lse = ops.get_o(fwd), ops.get_lse(fwd)
        g.build([o, lse])
        g.compute()
        O = g.read(o)[0]      # (S, Nh, Dv)
        L = g.read(lse)[0, 0]  # (S, Nh)
    assert np.all(np.isnan(O[2, 1])) and np.isnan(L[2, 1])
    finite = np.ones(O.shape[:2], bool)
    finite[2, 1] = False
    assert np.all(np.isfinite(O[finite])) and np.all(np.isfinite(L[finite]))


def test_misuse_raises_instead_of_crashing(cpu):
    """Reads before compute, after close, and tensors of another Graph would crash or read garbage in C."""
    q, k, v = _inputs()
    with Graph(cpu) as g, Graph(cpu) as other:
        tq, tk, tv = g.input(q), g.input(k), g.input(v)
        foreign_k = other.input(k)
        with pytest.raises(TypeError, match="another Graph"):
            ops.flash_attn_train(g, tq, foreign_k, tv, None, 0.5)
        with pytest.raises(TypeError, match="Tensor"):
            ops.flash_attn_train(g, q, tk, tv, None, 0.5)  # a NumPy array, not a Tensor
        with pytest.raises(TypeError, match="real number"):
            ops.flash_attn_train(g, tq, tk, tv, None, "0.5")
        fwd = ops.flash_attn_train(g, tq, tk, tv, None, 0.5)
        o = ops.get_o(fwd)
        g.build([o])
        with pytest.raises(RuntimeError, match="compute"):
            g.read(o)
        g.compute()
        assert np.all(np.isfinite(g.read(o)))
    with pytest.raises(RuntimeError, match="closed"):
        g.read(o)


def test_packed_layout_offsets_agree_with_the_views(cpu):
    """The layout helpers backends use (ggml.h) and the view getters describe the same packing:
    LSE and dK/dV start at GGML_MEM_ALIGN boundaries right after O and dQ/dK (odd sizes: real gaps)."""
    q, k, v = _inputs(S=5, Skv=7, D=3, Dv=5)  # element counts not multiples of 4: every part has a gap
    with Graph(cpu) as g:
        fwd = ops.flash_attn_train(g, g.input(q), g.input(k), g.input(v), None, 0.5)
        back = ops.flash_attn_train_back(g, fwd, g.new_tensor(fwd.ne))
        lib = g.lib
        n_o = int(np.prod(ops.get_o(fwd).ne)) * 4
        assert lib.ggml_flash_attn_train_lse_offset(fwd.ptr) == ops.get_lse(fwd).ptr.view_offs == -(-n_o // 16) * 16
        assert lib.ggml_flash_attn_train_back_offset(back.ptr, 0) == ops.get_dq(back).ptr.view_offs == 0
        assert lib.ggml_flash_attn_train_back_offset(back.ptr, 1) == ops.get_dk(back).ptr.view_offs == -(-q.size * 4 // 16) * 16
        assert lib.ggml_flash_attn_train_back_offset(back.ptr, 2) == ops.get_dv(back).ptr.view_offs


def test_poison_never_clobbers_the_loss_seed(cpu):
    # dL/dL is set before compute; a poisoned tensor that shares its memory (the allocator is free to place a
    # node there, as it did for the fused backward at the tiny case on CUDA) must not turn the gradients to NaN.
    # Worst case: the seed itself poisoned. Before the fix every gradient came out NaN.
    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)
    w = np.array([[0.5, -1.0, 2.0], [3.0, 0.25, -0.75]], dtype=np.float32)
    with Graph(cpu) as g:
        tx = g.param(x)
        loss = g.dot_loss([(g.mul(tx, g.input(np.ones_like(x))), w)])
        g.build([], loss)
        seed = g.wrap(g.lib.ggml_graph_get_grad(g.gf, loss.ptr))
        assert seed.ptr.flags & g.lib.GGML_TENSOR_FLAG_OUTPUT  # the allocator never reuses its memory
        g.compute(poison=[seed])
        np.testing.assert_array_equal(g.grad(tx).reshape(w.shape), w)  # dL/dx = w exactly (products by 1)


def test_poison_takes_only_this_graphs_built_tensors(cpu):
    from hotggml.errors import InputError, InputTypeError

    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)
    with Graph(cpu) as g, Graph(cpu) as g2:
        p2 = g2.param(x)
        g2.build([p2], g2.sum(g2.mul(p2, g2.input(np.ones_like(x)))))
        tx = g.param(x)
        y = g.mul(tx, g.input(np.ones_like(x)))
        stray = g.cont(tx)  # made, never built into the graph: no memory (ggml asserts on its buffer)
        g.build([y], g.sum(y))
        with pytest.raises(InputTypeError, match="this Graph's tensors"):
            g.compute(poison=[p2])  # another graph's param: would be overwritten silently
        with pytest.raises(InputTypeError, match="list of this Graph's tensors"):
            g.compute(poison=y)
        with pytest.raises(InputTypeError, match="got a ndarray"):
            g.compute(poison=[np.zeros(3)])
        with pytest.raises(InputError, match="not in the built graph"):
            g.compute(poison=[stray])
        g2.compute()
        np.testing.assert_array_equal(g2.read(p2).reshape(x.shape), x)  # untouched
        g.compute(poison=[y])
        np.testing.assert_array_equal(g.read(y).reshape(x.shape), x)


# -- new data between computes -------------------------------------------------------------------------

def test_one_graph_three_inputs_three_answers(cpu):
    """One built graph, computed three times with three sets of q, k, v (Graph.set) and a mask input that
    changes too: each compute's O and gradients match the float64 oracle on that compute's data. A graph
    that reran the first data (or uploaded only some leaves) fails the second and third."""
    B, Nh, Nkv, S, Skv, D, Dv = 1, 2, 1, 5, 7, 8, 6
    scale = 1 / np.sqrt(D)
    do = np.random.default_rng(9).standard_normal((B, S, Nh, Dv)).astype(np.float32)
    data = [_inputs(B, Nh, Nkv, S, Skv, D, Dv, seed=s) for s in (3, 4, 5)]
    masks = [np.where(np.random.default_rng(s).random((B, 1, S, Skv)) < 0.3, -np.inf, 0).astype(np.float16)
             for s in (6, 7, 8)]
    for m in masks:
        m[..., 0] = 0  # every row sees a key
    with Graph(cpu) as g:
        q, k, v = g.param(data[0][0], "q"), g.param(data[0][1], "k"), g.param(data[0][2], "v")
        mask = g.input(masks[0], "mask")
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, mask, scale, "f32"))
        g.build([o], g.dot_loss([(o, do)]))
        answers = []
        for i, ((qn, kn, vn), mn) in enumerate(zip(data, masks)):
            if i > 0:
                for t, x in ((q, qn), (k, kn), (v, vn), (mask, mn)):
                    g.set(t, x)
                with pytest.raises(UsageError, match="compute"):
                    g.read(o)  # the old data's values are not handed out as the new data's
            g.compute()
            answers.append((g.read(o), g.grad(q), g.grad(k), g.grad(v)))
    for (qn, kn, vn), mn, got in zip(data, masks, answers):
        m64 = mn[:, 0].astype(np.float64)  # the oracle's mask layout: (B, S, Skv)
        ro, _ = oracle.attention_forward(qn, kn, vn, m64, scale)
        refs = (ro.transpose(0, 2, 1, 3), *oracle.attention_backward(qn, kn, vn, m64, scale, do.transpose(0, 2, 1, 3)))
        for name, x, r in zip(("O", "dQ", "dK", "dV"), got, refs):
            assert np.max(np.abs(r)) > 0, f"{name}: zero reference, vacuous"
            assert rel_err(x, r) <= BAR, f"{name} rel err {rel_err(x, r):.2e}"
    assert rel_err(answers[0][0], answers[1][0]) > 1e-2 and rel_err(answers[1][0], answers[2][0]) > 1e-2


def test_set_refuses_what_the_leaf_cannot_take(cpu):
    with Graph(cpu) as g:
        x = g.input(np.zeros((2, 3), np.float32), "x")
        ids = g.input(np.zeros(4, np.int32), "ids")
        y = g.add(x, x)
        other = Graph(cpu)
        with pytest.raises(TypeError, match="input\\(\\) or param\\(\\) of this Graph"):
            g.set(y, np.zeros((2, 3)))  # a computed node
        with pytest.raises(TypeError, match="of this Graph"):
            g.set(other.input(np.zeros((2, 3), np.float32)), np.zeros((2, 3)))
        other.close()
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
            g.set(x, np.zeros((3, 2)))
        with pytest.raises(TypeError, match="int32 leaf cannot take float64"):
            g.set(ids, np.zeros(4))
        with pytest.raises(ValueError, match="range"):
            g.set(ids, np.full(4, 2**40))
        g.set(x, np.ones((2, 3)))  # before build(): the pending upload takes it
        g.build([y])
        g.compute()
        assert np.array_equal(g.read(y).reshape(2, 3), np.full((2, 3), 2, np.float32))


def test_set_copies_and_refuses_what_is_not_an_array(cpu):
    with Graph(cpu) as g:
        x = g.input(np.zeros((2, 3), np.float32), "x")
        h = g.input(np.zeros(3, np.float16), "h")
        y = g.add(x, x)
        a = np.ones((2, 3), np.float32)
        g.set(x, a)
        a[:] = 7  # after set(): the Graph holds its own copy
        for bad in (None, y, np.ma.masked_array(np.ones((2, 3)), mask=[[0, 1, 0]] * 2)):
            with pytest.raises(TypeError, match="NumPy array"):
                g.set(x, bad)
        with pytest.raises(ValueError, match="float16"):
            g.set(h, np.array([1.0, 1e6, np.inf]))
        g.build([y])
        g.compute()
        assert np.array_equal(g.read(y).reshape(2, 3), np.full((2, 3), 2, np.float32))


def test_a_second_builds_other_declarations_are_refused_by_name(lib, tmp_path):
    """cffi cannot declare an enum's values twice: a process that has declared one build's API and is pointed at
    a build whose generated declarations differ (a Vulkan build beside a CPU one) gets a LibraryError naming both
    folders, not cffi's NotImplementedError, and keeps the declarations it had."""
    before = hffi._declared
    (tmp_path / hffi.CDEF_FILE).write_text("enum ggml_status { GGML_STATUS_SUCCESS = 0 };\nint hotggml_other(void);\n")
    with pytest.raises(LibraryError, match="a process uses one build") as err:
        hffi._declare(tmp_path)
    assert str(tmp_path) in str(err.value) and hffi._declared == before
    same = tmp_path / "same"
    same.mkdir()
    (same / hffi.CDEF_FILE).write_text(pathlib.Path(before).read_text())  # identical declarations: accepted
    hffi._declare(same)
    assert hffi._declared == str(same / hffi.CDEF_FILE)
    hffi._declared = before


def test_interrupts_deferred_delivers_sigint_when_the_block_ends():
    """SIGINT while C code may call back into Python is held and raised at the block's end (a KeyboardInterrupt
    inside a cffi callback would be swallowed, its fallback answer given to ggml)."""
    import os
    import signal

    from hotggml.graph import interrupts_deferred

    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # bytecodes run here: an undeferred signal would raise inside the loop
                pass
            reached_end = True
    assert reached_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_view_made_outside_the_built_graph_reads_through_its_source(cpu):
    """get_lse of a forward whose O alone was built, and a permute made after build(): ggml never placed these
    views (their data pointer is NULL, ggml aborts on it); read() takes their bytes from the source."""
    q, k, v = _inputs(S=3, Skv=5, D=4, Dv=4)
    with Graph(cpu) as g:
        qt, kt, vt = g.param(q), g.input(k), g.input(v)
        fwd = ops.flash_attn_train(g, qt, kt, vt, None, 0.5)
        g.build([fwd], g.sum(ops.get_o(fwd)))
        lse, qv = ops.get_lse(fwd), g.permute(qt, 1, 0, 2, 3)
        g.compute()
        _, ref_lse = oracle.attention_forward(q, k, v, None, 0.5)
        assert np.abs(ref_lse).max() > 0.1  # not vacuous
        want = np.transpose(ref_lse, (0, 2, 1))  # ggml [Nh, S, B]: NumPy (1, B, S, Nh)
        assert rel_err(g.read(lse).reshape(want.shape), want) < BAR
        assert np.array_equal(g.read(qv), np.swapaxes(q, 2, 3))


def test_byte_swapped_float32_is_float32(cpu):
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    with Graph(cpu) as g:
        t, p = g.input(x), g.param(x)
        y = g.add(t, p)
        g.build([y])
        g.compute()
        assert np.array_equal(g.read(y).reshape(x.shape), 2 * x.astype(np.float32))


def test_numpy_scalars_go_where_python_numbers_do(lib):
    """Backend(n_threads=), Graph(max_nodes=), rpc.Server(n_threads=, start_timeout=) and DemoConfig(alpha=)
    took NumPy scalars for a wrong type (as window, reshape and AdamW already took them)."""
    from hotggml import rpc
    from hotggml.train_demo import DemoConfig

    with Backend("CPU", n_threads=np.int64(2)) as be, Graph(be, max_nodes=np.int32(64)) as g:
        assert be.n_threads == 2 and type(be.n_threads) is int and g.max_nodes == 64 and type(g.max_nodes) is int
    with rpc.Server("CPU", n_threads=np.int64(1), start_timeout=np.float32(60)) as s:
        assert s.endpoint.startswith("127.0.0.1:")
    assert DemoConfig(alpha=np.float32(0.01)).alpha == np.float32(0.01)
    with pytest.raises(InputError, match="alpha must be in"):
        DemoConfig(alpha=True)
