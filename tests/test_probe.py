"""probe: the device's supports_op is asked at the real shapes, and a refusal is a named error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hotggml import cases
from hotggml.errors import UnsupportedOpError
from hotggml.graph import Backend
from hotggml.probe import probe


_PEAK_VM = """
import re, sys
from hotggml import cases
from hotggml.graph import Backend
from hotggml.probe import probe
which = cases.FIELD if sys.argv[1] == "all" else cases.FIELD[:1]
with Backend("CPU") as be:
    assert all(probe(c, be, prec).precision == "f32" and probe(c, be, prec).kernel == "f32-cpu"
               for c in which for prec in ("default", "f32"))
print(re.search(r"VmPeak:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_field_shapes_probe_without_allocating(lib):
    """Every field shape, the 27B chunk included (q, k, v alone are ~670 MB there), probes without
    allocating: the peak virtual size of a process that probes them all stays within 64 MiB of one that
    probes the smallest (untouched allocations count there, unlike in the RSS). The CPU's path is
    reported as 'f32' (kernel 'f32-cpu') at every shape and precision."""
    def peak_kib(which: str) -> int:
        run = subprocess.run([sys.executable, "-c", _PEAK_VM, which], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    chunk = next(c for c in cases.FIELD if c.id.startswith("chunk-27b"))
    chunk_bytes = 4 * (chunk.D * chunk.S * chunk.Nh + (chunk.D + chunk.dv) * chunk.Skv * chunk.Nkv)
    assert chunk_bytes > 600 * 2**20  # allocating would show
    grown = (peak_kib("all") - peak_kib("smallest")) * 1024
    assert grown < 64 * 2**20, f"probing the field grew the peak virtual size by {grown / 2**20:.0f} MiB"


def test_refusal_names_the_node_and_device(cpu, monkeypatch):
    seen = []

    def refuse_backward(self, node):
        seen.append(node.op_name)
        return node.op_name != "FLASH_ATTN_TRAIN_BACK"

    monkeypatch.setattr(Backend, "supports_op", refuse_backward)
    with pytest.raises(UnsupportedOpError, match=r"CPU supports_op is false for FLASH_ATTN_TRAIN_BACK at tiny"):
        probe(cases.SMOKE[0], cpu)
    assert seen == ["FLASH_ATTN_TRAIN", "FLASH_ATTN_TRAIN_BACK"]
