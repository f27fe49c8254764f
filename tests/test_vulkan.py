"""Vulkan: the fused ops on Vulkan0 (flash_attn_train.comp) against the float64 oracle at the f32 bar, with the
path the library reports. These run where the loaded build has a Vulkan device (a `hotggml build --backend
vulkan` build; on a machine without a GPU, Mesa's lavapipe, which ggml shows only when GGML_VK_VISIBLE_DEVICES
names it) and skip with the reason elsewhere. The exact chain runs on Vulkan0 too (its backward needs OUT_PROD:
patch vulkan-out-prod)."""

from __future__ import annotations

import numpy as np
import pytest

from _backends import assert_absent_backend_fails_loudly, first_device_or_skip

from hotggml import cases, parity
from hotggml.cases import Case
from hotggml.errors import UnsupportedOpError
from hotggml.graph import Backend
from hotggml.probe import probe


@pytest.fixture(scope="module")
def vulkan_device(lib) -> str:
    return first_device_or_skip("Vulkan", "a build without GGML_VULKAN, or no Vulkan driver; a CPU driver "
                                "such as lavapipe shows only with GGML_VK_VISIBLE_DEVICES=0")


def test_absent_vulkan_fails_loudly(lib):
    assert_absent_backend_fails_loudly("Vulkan", "vulkan")


def _passes(case: Case, device: str) -> parity.CaseResult:
    result = parity.run_case(case, device, prec="f32", with_chain=False)
    assert result.kernel == "f32-vulkan" and result.precision == "f32"  # what the library reports it ran
    assert result.passed, f"{case.id}: " + "; ".join(result.failures)
    assert result.checks["fused_nodes_on_backend"] is True
    assert result.checks["bitwise_across_runs"] is True  # two runs, bit for bit
    return result


@pytest.mark.vulkan
@pytest.mark.parametrize("case", cases.SMOKE, ids=lambda c: c.id)
def test_vulkan_parity_smoke(vulkan_device, case):
    _passes(case, vulkan_device)


@pytest.mark.vulkan
@pytest.mark.parametrize("case", [Case("vk-chain-gqa-bias", Nh=4, Nkv=2, D=16, Dv=8, S=9, Skv=13, mask="bias"),
                                  Case("vk-chain-causal", Nh=2, Nkv=2, D=32, S=17, Skv=17, causal=True)],
                         ids=lambda c: c.id)
def test_vulkan_exact_chain(vulkan_device, case):
    """The exact chain (mul_mat -> soft_max_ext -> mul_mat through autodiff: OUT_PROD, SOFT_MAX_BACK) on Vulkan0
    against float64 at the f32 bar, and the fused arm against it."""
    result = parity.run_case(case, vulkan_device, prec="f32", with_chain=True)
    assert result.passed, f"{case.id}: " + "; ".join(result.failures)
    assert result.errors["chain~oracle"] and result.errors["fused~chain"]
    assert max(result.errors["chain~oracle"].values()) <= result.chain_bar


# shapes the smoke set does not reach on the shaders: the largest head size, D != Dv far apart (neither a
# multiple of the 8 columns a thread strides by), an f16 mask with an odd number of halves (its binding
# rounded up to whole words), GQA 4 with an implicit causal mask, and long loops over the query rows of a GQA
# group in the dK/dV shader (many blocks per key tile, S != Skv, padding keys holding NaN)
EXTRA = [
    Case("vk-d256", Nh=2, Nkv=1, D=256, S=19, Skv=27, mask="causal"),
    Case("vk-d200v72", Nh=4, Nkv=2, D=200, Dv=72, S=21, Skv=35, mask="padding", pad_keys=3, garbage=True),
    Case("vk-odd-mask-halves", Nh=2, Nkv=1, D=8, S=7, Skv=9, mask="bias"),
    Case("vk-gqa4-causal", Nh=8, Nkv=2, D=64, S=50, Skv=50, causal=True),
    Case("vk-gqa-long-loops", Nh=4, Nkv=2, D=32, S=300, Skv=260, mask="padding", pad_keys=5, garbage=True),
    # the dK/dV shader's loop over a GQA group's rows, long at a large D: 256 row blocks per key tile at D 128.
    # With dot products looping to D at run time this crossed lavapipe's 65535 shader loop iterations and its
    # accumulation stopped part way (dK, dV wrong at the real set's Nh 16 / Nkv 8 / D 128 / S 1024)
    Case("vk-dkv-long-group-loop", Nh=4, Nkv=1, D=128, S=512, Skv=16),
]


@pytest.mark.vulkan
@pytest.mark.parametrize("case", EXTRA, ids=lambda c: c.id)
def test_vulkan_parity_extra(vulkan_device, case):
    if case.id == "vk-odd-mask-halves":
        assert case.Skv * case.S % 2 == 1  # the stored mask holds an odd number of halves
    _passes(case, vulkan_device)


@pytest.mark.vulkan
def test_vulkan_refuses_d512_by_name(vulkan_device):
    with Backend(vulkan_device) as be, pytest.raises(UnsupportedOpError, match="FLASH_ATTN_TRAIN at d512-refused") as err:
        probe(cases.LIMITS[0], be)
    assert "above 256" in str(err.value)  # the library's reason, through the probe


@pytest.mark.vulkan
@pytest.mark.parametrize("k_type", ["q8_0", "f16"])
def test_vulkan_refuses_stored_k_by_name(vulkan_device, k_type):
    """K/V in f32 only on Vulkan at first: a cache in a stored type is refused by name, never run on the CPU."""
    case = Case(f"vk-k-{k_type}", Nh=2, Nkv=1, D=32, S=8, Skv=16, k_type=k_type)
    with Backend(vulkan_device) as be, pytest.raises(UnsupportedOpError, match=f"FLASH_ATTN_TRAIN at vk-k-{k_type}") as err:
        probe(case, be)
    assert "K is not f32" in str(err.value)


# -- the split graph: forward on the device, backward pinned to the CPU (SPEC §4) ----------------------------

@pytest.mark.vulkan
@pytest.mark.parametrize("case_id", ["lse-loss", "odd-causal-cross", "q-view-bias", "gqa-band", "nan-padding-keys"])
def test_split_backward_on_cpu(vulkan_device, case_id):
    """ggml's scheduler runs the forward on Vulkan0 and, pinned with set_tensor_backend, the backward on the
    CPU: the forward's bytes cross the split as a plain copy, and the gradients still pass parity."""
    case = next(c for c in cases.SMOKE if c.id == case_id)
    with Backend(vulkan_device) as be:
        fused = parity.run_fused(case, be, "f32", backward_on="CPU")
    assert fused.placement == {"FLASH_ATTN_TRAIN": vulkan_device, "FLASH_ATTN_TRAIN_BACK": "CPU"}
    assert fused.n_splits >= 2
    assert fused.lse_gap_zero
    ref = parity.run_oracle(case)
    live = ~parity.oracle.masked_rows(case.mask_array(), case.B, case.S)
    errs = parity._compare(fused, ref, live)
    assert all(np.max(np.abs(getattr(ref, g))) > 0 for g in ("dq", "dk", "dv"))
    assert max(errs.values()) <= parity.BARS["f32"], errs


@pytest.mark.vulkan
def test_lavapipe_loop_limit_refused_by_name(vulkan_device):
    """lavapipe ends a shader's loops after 65535 iterations counted together, silently: supports_op refuses a
    shape with more tiles per workgroup than that leaves (the forward's key tiles here), and the probe says why."""
    from hotggml.graph import devices as registry

    if "llvmpipe" not in dict(registry())[vulkan_device]:
        pytest.skip(f"{vulkan_device} is not lavapipe: the loop limit is that driver's")
    case = Case("vk-lavapipe-tiles", Nh=1, Nkv=1, D=8, S=8, Skv=32 * 65536)  # 65536 key tiles of 32
    with Backend(vulkan_device) as be, pytest.raises(UnsupportedOpError, match="FLASH_ATTN_TRAIN at vk-lavapipe-tiles") as err:
        probe(case, be)
    assert "65535" in str(err.value)
    # each key tile of the dQ shader also runs its two score products' loops over depth chunks of 16 (D = Dv = 256: 32
    # of them): 2100 tiles x 33 iterations pass the limit though the tiles alone do not, 1900 x 33 (62700) fit
    refused = Case("vk-lavapipe-depth-chunks", Nh=1, Nkv=1, D=256, S=8, Skv=32 * 2100)
    with Backend(vulkan_device) as be, pytest.raises(UnsupportedOpError, match="FLASH_ATTN_TRAIN_BACK at vk-lavapipe-depth-chunks .*65535"):
        probe(refused, be)
    with Backend(vulkan_device) as be:
        probe(Case("vk-lavapipe-depth-chunks-fit", Nh=1, Nkv=1, D=256, S=8, Skv=32 * 1900), be)


@pytest.mark.vulkan
def test_a_build_with_vulkan_keeps_stderr_clean_without_a_visible_device(vulkan_device):
    """ggml_vulkan logs "No devices found." (INFO) when the registry is first used and no device is visible; the
    binding registers the backends under its warnings-only logger, so a command's stderr stays its own."""
    import os
    import subprocess
    import sys

    from hotggml import ffi

    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    env["HOTGGML_LIB_DIR"] = str(ffi.find_lib_dir())
    run = subprocess.run([sys.executable, "-c", "from hotggml import ffi; print(ffi.load().ggml_backend_dev_count())"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0 and int(run.stdout) >= 1, run.stdout + run.stderr
    assert run.stderr == "", run.stderr
