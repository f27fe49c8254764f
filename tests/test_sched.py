"""The binding's scheduler (hotggml.sched): graphs through ggml_backend_sched as a trainer runs them.

CPU-only here (CI): a scheduled graph computes the same bits as a direct one and says where each node
ran; misuse raises before ggml can assert. The split across devices (forward on CUDA0, backward pinned
to the CPU) is in test_cuda.py; its CPU half, a backward whose src[4] is a plain copy, is
test_parity.py::test_backward_stands_alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from hotggml import cases, ops, parity
from hotggml.ffi import ffi
from hotggml.graph import Graph

CASE = next(c for c in cases.SMOKE if c.id == "mqa-causal")


def test_scheduled_equals_direct_and_reports_placement(cpu):
    with Graph(cpu) as g:
        h = parity.build_fused(g, CASE, "f32")
        g.compute(poison=h.fused_nodes)
        direct = parity.read_fused(g, CASE, h)
    sched = parity.run_fused(CASE, cpu, "f32")
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert np.array_equal(getattr(sched, name), getattr(direct, name)), name
    assert np.max(np.abs(sched.dq)) > 0  # not vacuous
    assert sched.placement == {"FLASH_ATTN_TRAIN": "CPU", "FLASH_ATTN_TRAIN_BACK": "CPU"}
    assert sched.n_splits == 1


def test_parity_checks_where_fused_nodes_ran(lib):
    res = parity.run_case(CASE, "CPU", threads=[2], prec="f32", with_chain=False)
    assert res.checks["fused_nodes_on_backend"] is True
    assert res.placement == {"FLASH_ATTN_TRAIN": "CPU", "FLASH_ATTN_TRAIN_BACK": "CPU"}


def test_placement_lists_every_node(cpu):
    with Graph(cpu, scheduled=True) as g:
        h = parity.build_fused(g, CASE, "f32")
        g.plan()  # placed and split, nothing allocated
        placed = g.placement()
        assert [t.ptr for t, _ in placed] == [t.ptr for t in g.nodes()]
        assert {d for _, d in placed} == {"CPU"}
        assert {t.op for t, _ in placed} >= {ops.OP_FLASH_ATTN_TRAIN, ops.OP_FLASH_ATTN_TRAIN_BACK}
        assert h.fwd.ptr.data == ffi.NULL and h.fwd.ptr.buffer == ffi.NULL  # plan() allocates nothing


def test_scheduler_misuse_raises(cpu):
    with Graph(cpu) as g:
        h = parity.build_fused(g, CASE, "f32")
        with pytest.raises(RuntimeError, match="scheduled=True"):
            g.assign(h.fwd, "CPU")
        with pytest.raises(RuntimeError, match="scheduled=True"):
            g.plan()
    with Graph(cpu, scheduled=True) as g:
        h = parity.build_fused(g, CASE, "f32")
        with pytest.raises(RuntimeError, match="plan\\(\\) or compute\\(\\)"):
            g.placement()
        with pytest.raises(ValueError, match="no backend 'CUDA0' in this scheduler"):
            g.assign(h.fwd, "CUDA0")
        with Graph(cpu, scheduled=True) as other:
            with pytest.raises(TypeError, match="another Graph"):
                other.assign(h.fwd, "CPU")
        g.compute()  # still usable after the refusals
        assert g.n_splits == 1


@pytest.mark.parametrize("max_nodes", [0, 8, 2.5, "16384"])
def test_max_nodes_validated(cpu, max_nodes):
    with pytest.raises(ValueError, match="max_nodes"):
        Graph(cpu, max_nodes=max_nodes)
