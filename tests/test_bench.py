"""The benchmark's bookkeeping: visible pairs and FLOPs per mask, the node profile's attribution.
Times themselves are claims for `hotggml bench`, never asserted here."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from hotggml import bench, cases, paths
from hotggml.cases import Case
from hotggml.errors import UsageError
from hotggml.graph import Graph
from hotggml.parity import build_chain, build_fused

RESERVE_IDS = ("odd-causal-cross", "q-view-bias", "batch-padding-cross", "lse-loss", "tiles", "kv-q8_0-causal-tail")


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


@pytest.mark.parametrize("case", [c for c in cases.SMOKE + cases.TYPES if c.id in RESERVE_IDS], ids=lambda c: c.id)
def test_a_reserve_only_graph_measures_the_arena_of_the_graph_with_data(cpu, case):
    """Leaves without data (on a zero-byte buffer) give the allocator what uploaded leaves give it: the same arena,
    for the fused graph and the chain, with a stored mask, a q view, a stored-type cache."""
    for build in (build_fused, build_chain):
        if build is build_chain and case.k_type != "f32":
            continue
        arenas = []
        for reserve_only in (False, True):
            with Graph(cpu, reserve_only=reserve_only) as g:
                build(g, case)
                arenas.append(g.arena_bytes())
        assert arenas[0] == arenas[1] > 0, (build.__name__, arenas)


def test_a_reserve_only_graph_refuses_what_needs_data(cpu):
    case = next(c for c in cases.SMOKE if c.id == "tiny")
    with Graph(cpu, reserve_only=True) as g:
        h = build_fused(g, case)
        for call in (g.compute, lambda: g.read(h.o), lambda: g.set(h.k, np.zeros((1, 1, 3, 4), np.float32))):
            with pytest.raises(UsageError, match="reserve_only"):
                call()


def _child_max_rss(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run `hotggml ARGS` from a fresh interpreter and return its run and peak RSS in bytes: the interpreter in
    between reaps it alone, so no other child of this test session counts in RUSAGE_CHILDREN."""
    probe = ("import resource, subprocess, sys; run = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(run.stdout); sys.stderr.write(run.stderr); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(run.returncode)")
    run = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "hotggml", *args], capture_output=True,
                         text=True, timeout=300, cwd=paths.REPO_ROOT)
    *out, rss_kib = run.stdout.strip().splitlines()
    return subprocess.CompletedProcess(run.args, run.returncode, "\n".join(out), run.stderr), int(rss_kib) * 1024


def test_memory_at_a_million_queries_allocates_no_input_data(lib):
    """`memory --seq 1000000 --no-chain` at DiT full attention: q, k, v and dO alone would be 24 GB of host arrays
    and as much in the backend's input buffer (it was refused, or OOM-killed); reserve only, it stays under 1 GiB."""
    run, rss = _child_max_rss("memory", "--seq", "1000000", "--no-chain")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].split()[0] == "1000000"
    assert rss < 2**30, f"peak RSS {rss / 2**20:.0f} MiB"
    # no size is refused for want of host memory any more: the arena of S = 1e8 is a number like any other
    run, rss = _child_max_rss("memory", "--seq", "100000000", "--no-chain")
    assert run.returncode == 0 and run.stdout.splitlines()[-1].split()[0] == "100000000", run.stderr
    assert rss < 2**30


def _row(kernel: str) -> bench.FieldRow:
    return bench.FieldRow("c", "s", 1e-3, None, 2e-3, 1 << 20, 2 << 20, 10**9, {"fused_tf32": kernel})


@pytest.mark.parametrize("kernels, label", [
    (["tf32-reg-d128-smem227", "tf32-reg-d80-smem99"], "tf32"),
    (["f32-vulkan", "f32-vulkan"], "f32"),
    (["f32-cpu"], "f32"),
    (["tf32-reg-d128-smem227", "f32-scalar"], "default"),
])
def test_the_field_table_names_the_default_arm_by_what_ran(kernels, label):
    # a Vulkan or CPU table must not head its default-precision column "tf32": that arm ran f32 kernels there
    table = bench.format_field([_row(k) for k in kernels], 30.0, "Dev0")
    head = table.splitlines()[1].split()
    assert f"{label}/chain" in head and f"{label} " in table.splitlines()[1]
    assert {"tf32", "f32", "default"} - {label} & {h.split("/")[0] for h in head if h.endswith("/chain")} == set()


def test_profile_interrupted_raises_and_leaves_nothing_readable(cpu, monkeypatch):
    """A KeyboardInterrupt inside the scheduler's eval callback (the profile's per-node clock) used to be swallowed
    by cffi: profile() returned two nodes and read() gave the half-computed graph as results."""
    import time

    case = next(c for c in cases.SMOKE if c.id == "lse-loss")
    with Graph(cpu, scheduled=True) as g:
        h = build_fused(g, case, "f32")
        g.compute()
        calls, clock = [0], time.perf_counter

        def interrupted_clock():
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return clock()

        monkeypatch.setattr(time, "perf_counter", interrupted_clock)
        with pytest.raises(KeyboardInterrupt):
            g.profile()
        monkeypatch.setattr(time, "perf_counter", clock)
        with pytest.raises(UsageError):
            g.read(h.o)
        g.compute()
        assert g.read(h.o).any()
