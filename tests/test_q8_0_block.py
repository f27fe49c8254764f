"""The CUDA kernels' q8_0 block dequantization (fa_q8_0_block: byte permutes, one exact fma and an integer carry, no
conversion instructions), compiled for the host from the patched tree by tools/q8_0_block_check.sh, against the
per-value definition (dequantize_row_q8_0's f32 product of the int8 and the f16 scale, then rounded to TF32 as
fa_tf32_bits rounds) over random rows and every scale class (zeros, subnormals, the largest, Inf, NaN): bitwise as the
tensor cores read a TF32 operand (its 13 low bits ignored; the harness's q8_0 arms, bitwise equal to their f32 K/V
arms on the device, show that they do). No GPU: what the device runs is this function's arithmetic, which the host
reproduces instruction for instruction."""
import pathlib
import shutil
import subprocess

import pytest

from hotggml.prepare import prepare

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH to compile the host check")
def test_q8_0_block_matches_the_per_value_definition():
    tree = prepare().source_dir
    out = subprocess.run(["bash", str(ROOT / "tools" / "q8_0_block_check.sh"), str(tree)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    checked, bad = [int(w) for w in out.stdout.split() if w.isdigit()][-2:]
    assert checked >= 100_000_000 and bad == 0, out.stdout
