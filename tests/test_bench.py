"""The benchmark's bookkeeping: visible pairs and FLOPs per mask, the node profile's attribution.
Times themselves are claims for `hotggml bench`, never asserted here."""

from __future__ import annotations

from dataclasses import replace

from hotggml import bench, cases
from hotggml.cases import Case
from hotggml.graph import Graph
from hotggml.parity import build_fused


def test_visible_pairs_count_the_mask():
    base = Case("x", B=2, Nh=4, Nkv=2, D=8, S=4, Skv=6)
    assert bench.visible_pairs(base) == 2 * 4 * 6
    # causal tail: query i sees keys j <= i + 2 -> 3 + 4 + 5 + 6 per batch, one mask for both batches
    assert bench.visible_pairs(replace(base, mask="causal")) == 2 * (3 + 4 + 5 + 6)
    # padding: batch b loses pad_keys + b keys for every query (a mask per batch)
    assert bench.visible_pairs(replace(base, mask="padding", pad_keys=1)) == 4 * (6 - 1) + 4 * (6 - 2)
    # band |i - j| <= 1 on 4x6: rows see 2, 3, 3, 3 keys
    assert bench.visible_pairs(replace(base, mask="band", band=1)) == 2 * (2 + 3 + 3 + 3)


def test_attention_flops_follow_the_issue_formula():
    case = Case("x", B=1, Nh=3, Nkv=1, D=8, Dv=4, S=5, Skv=7)
    fwd, bwd = bench.attention_flops(case)
    assert fwd == 2 * (8 + 4) * 3 * 5 * 7 and bwd == fwd * 5 // 2


def test_profile_times_every_node_once(cpu):
    case = next(c for c in cases.SMOKE if c.id == "lse-loss")
    with Graph(cpu, scheduled=True) as g:
        h = build_fused(g, case, "f32")
        timed = g.profile()
        assert [t.ptr for t, _ in timed] == [t.ptr for t in g.nodes()]
        assert all(s >= 0 for _, s in timed)
        assert g.read(h.o).any()  # the profiled run computed the graph


def test_memory_rows_keep_the_named_geometry():
    """Self-attention moves Skv with S, a causal tail keeps its context, cross-attention keeps the encoder's Skv
    (it moved with S before: --seq 1 of a 1250 x 640 cross case asked for Skv = -609)."""
    by_id = {c.id: c for c in cases.FIELD}
    assert bench.memory_case(by_id["dit-self-full-625"], 100).Skv == 100
    assert bench.memory_case(by_id["chunk-27b-2048x75520"], 16).Skv == 16 + 75520 - 2048
    cross = by_id["dit-cross-1250x640"]
    assert [bench.memory_case(cross, s).Skv for s in (1, 7, 5000)] == [640, 640, 640]
    assert "640" in bench.memory_kv_rule(cross)


def test_memory_refuses_an_s_that_cannot_fit_before_allocating(lib):
    import subprocess
    import sys

    from hotggml import paths

    run = subprocess.run([sys.executable, "-m", "hotggml", "memory", "--seq", "100000000", "--no-chain"],
                         capture_output=True, text=True, timeout=120, cwd=paths.REPO_ROOT)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "GiB of host arrays, more than this machine's" in lines[0], run.stderr
