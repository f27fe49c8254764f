"""CUDA: the fused ops on CUDA0 against the float64 oracle, both precisions, with the path the library
reports. These run where the loaded build has a CUDA device (tools/gpu-run.sh on the GPU machine) and
skip with the reason elsewhere; a requested CUDA backend that is absent fails loudly, never falling
back to the CPU (that test runs where there is no CUDA device, as in CI)."""

from __future__ import annotations


import numpy as np
import pytest

from _backends import assert_absent_backend_fails_loudly, first_device_or_skip

from hotggml import cases, parity
from hotggml.cases import Case
from hotggml.graph import Backend, Graph


@pytest.fixture(scope="module")
def cuda_device(lib) -> str:
    return first_device_or_skip("CUDA", "a CPU build, or no GPU on this machine; "
                                "the CUDA tests run on the GPU machine through tools/gpu-run.sh")


def test_absent_cuda_fails_loudly(lib):
    assert_absent_backend_fails_loudly("CUDA", "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("prec,path", [("f32", "f32"), ("default", "tf32")])
@pytest.mark.parametrize("case", cases.SMOKE, ids=lambda c: c.id)
def test_cuda_parity(cuda_device, case, prec, path):
    result = parity.run_case(case, cuda_device, prec=prec)
    assert result.precision == path  # what the library reports it ran (an sm_90 card: TF32 for 'default')
    assert result.kernel.startswith("tf32-reg-" if prec == "default" else "f32-x3-")  # every D: the register family
    assert result.passed, f"{case.id} {prec}: " + "; ".join(result.failures)
    assert result.checks["bitwise_across_runs"] is True


@pytest.mark.cuda
def test_cuda_refuses_d512_by_name(cuda_device):
    from hotggml.errors import UnsupportedOpError
    from hotggml.probe import probe

    with Backend(cuda_device) as be, pytest.raises(UnsupportedOpError, match="FLASH_ATTN_TRAIN at d512-refused"):
        probe(cases.LIMITS[0], be)


# -- the split graph: forward on the device, backward pinned to the CPU (SPEC §4, issue 5 item 2) ----

@pytest.mark.cuda
@pytest.mark.parametrize("prec", ["f32", "default"])
@pytest.mark.parametrize("case_id", ["lse-loss", "odd-causal-cross", "q-view-bias", "gqa-band", "nan-padding-keys"])
def test_split_backward_on_cpu(cuda_device, case_id, prec):
    """ggml's scheduler runs the forward on CUDA0 and, pinned with set_tensor_backend, the backward on
    the CPU: the forward's bytes cross the split as a plain copy, and the gradients still pass parity."""
    case = next(c for c in cases.SMOKE if c.id == case_id)
    with Backend(cuda_device) as be:
        fused = parity.run_fused(case, be, prec, backward_on="CPU")
    assert fused.placement == {"FLASH_ATTN_TRAIN": cuda_device, "FLASH_ATTN_TRAIN_BACK": "CPU"}
    assert fused.n_splits >= 2
    ref = parity.run_oracle(case)
    live = ~parity.oracle.masked_rows(case.mask_array(), case.B, case.S)
    errs = parity._compare(fused, ref, live)
    assert all(np.max(np.abs(getattr(ref, g))) > 0 for g in ("dq", "dk", "dv"))
    # the forward's path sets the bar: a TF32 O and LSE feed the CPU's f32 backward
    bar = parity.BARS["f32" if prec == "f32" else "tf32"]
    assert max(errs.values()) <= bar, errs


# -- supports_op across the field's shape matrix (issue 6 item 5) ------------------------------------

MATRIX = [Case(f"matrix-d{D}-gqa{G}-{mask}", Nh=4, Nkv=4 // G, D=D, S=37, Skv=53,
               mask="bias" if mask == "2d" else "none", causal=mask == "causal")
          for D in (16, 64, 80, 96, 128, 192, 256) for G in (1, 4) for mask in ("none", "2d", "causal")]

KERNEL_NAME = r"^(tf32-reg|f32-x3)-d(\d+)(v(\d+))?-smem(99|163|227)$"


@pytest.mark.cuda
@pytest.mark.parametrize("prec,path", [("default", "tf32"), ("f32", "f32")])
@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.id)
def test_supports_op_matrix(cuda_device, cpu_fused_cache, case, prec, path):
    """Every shape of the field's matrix runs on CUDA (sm_80+: the register family at both precisions, the
    instance covering its D and Dv), passes parity against float64 and matches the CPU's fused op at its
    precision's bar; nothing is refused, nothing runs on the CPU in its place."""
    import re

    from hotggml.probe import probe

    with Backend(cuda_device) as be:
        ran = probe(case, be, prec=prec)
        fused = parity.run_fused(case, be, prec)
    assert ran.precision == path
    name = re.match(KERNEL_NAME, ran.kernel)
    assert name and name.group(1) == ("tf32-reg" if prec == "default" else "f32-x3"), ran.kernel
    assert int(name.group(2)) >= case.D and int(name.group(4) or name.group(2)) >= case.dv, ran.kernel
    result = parity.run_case(case, cuda_device, prec=prec, with_chain=False)
    assert result.passed, "; ".join(result.failures)
    assert result.kernel == ran.kernel
    cpu = cpu_fused_cache(case)
    live = ~parity.oracle.masked_rows(case.mask_array(), case.B, case.S)
    errs = parity._compare(fused, cpu, live)
    assert max(errs.values()) <= parity.BARS[path], errs


@pytest.mark.cuda
@pytest.mark.parametrize("kib,cls", [(99, 99), (120, 99), (163, 163), (200, 163), (100000, 227)])
@pytest.mark.parametrize("dims", [(32, 32), (72, 72), (128, 128), (160, 160), (192, 128), (256, 256)])
def test_smem_cap_selects_class(cuda_device, kib, cls, dims):
    """GGML_CUDA_FA_TRAIN_SMEM_KB caps the budget at dispatch: the kernel reported (and run: parity under
    the caps in tools/gpu-run.sh) is the register family's configuration of the largest class within the
    cap, at every head size; above the device's own limit the cap changes nothing (an H200: 227)."""
    from hotggml.bench import cuda_smem_cap
    from hotggml.probe import probe

    case = Case(f"cap-d{dims[0]}v{dims[1]}", Nh=4, Nkv=2, D=dims[0], Dv=dims[1], S=70, Skv=90, causal=True)
    with Backend(cuda_device) as be, cuda_smem_cap(kib):
        for prec in ("default", "f32"):
            assert probe(case, be, prec).kernel.endswith(f"-smem{cls}")


@pytest.fixture(scope="module")
def cpu_fused_cache(lib):
    """The CPU's fused results per case (the reference the matrix compares CUDA against)."""
    done = {}

    def get(case):
        if case.id not in done:
            with Backend("CPU") as be:
                done[case.id] = parity.run_fused(case, be, "f32")
        return done[case.id]
    return get


# -- K and V in stored types (issue 20): the register family reads them as stored -------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("prec", ["f32", "default"])
@pytest.mark.parametrize("case", cases.TYPES, ids=lambda c: c.id)
def test_cuda_types_parity(cuda_device, case, prec):
    result = parity.run_case(case, cuda_device, prec=prec)
    assert result.kernel.startswith("tf32-reg-" if prec == "default" else "f32-x3-")
    assert result.passed, f"{case.id} {prec}: " + "; ".join(result.failures)
    assert result.checks["bitwise_across_runs"] is True and result.checks["grads_only_for_f32_kv"] is True


@pytest.mark.cuda
@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("f16", "bf16")])
def test_cuda_cache_takes_no_converted_copy(cuda_device, k_type, v_type):
    """No node of the graph and no pool allocation of the op is the size of an f32 copy of K or V; the f32
    twin of the same graph (K and V frozen f32 inputs) shows that the counter sees such copies where the TF32
    path makes them (its rounded K and V)."""
    shape = dict(Nh=4, Nkv=2, D=128, S=32, Skv=4096, causal=True)
    f32_kv = 2 * 2 * 4096 * 128 * 4  # K and V of the two kv heads as f32
    peaks = {}
    for case in (Case("stored", k_type=k_type, v_type=v_type, **shape), Case("twin", frozen_kv=True, **shape)):
        with Backend(cuda_device) as be, Graph(be) as g:
            h = parity.build_fused(g, case, "default")
            if case.k_type != "f32":
                kv = (h.k.ptr, h.v.ptr)
                largest = max(g.lib.ggml_nbytes(t.ptr) for t in g.nodes() if t.ptr not in kv)
                assert largest < f32_kv // 2 / 4, f"a node of {largest} bytes beside a {k_type}/{v_type} cache"
            be.fa_train_pool_peak(reset=True)
            g.compute()
            peaks[case.name] = be.fa_train_pool_peak()
            assert np.max(np.abs(g.grad(h.q_leaf))) > 0
    assert 0 < peaks["stored"] < f32_kv // 16, peaks   # mask cells and D_i only
    assert peaks["twin"] >= f32_kv, peaks               # the twin's TF32 copies of K and V
