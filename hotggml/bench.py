"""Benchmarks of the fused op vs the exact chain: allocator arenas and paired timings (SPEC §6).

Memory is the graph allocator's arena for the whole fwd+bwd graph (exact, deterministic,
nothing computed). Time is ggml_backend_graph_compute of the fwd+bwd graph, arms paired at the
same case, interleaved (order alternating per round), medians and the ratio from one run.
These are claims for tools, never unit tests: the machines are noisy.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace

from hotggml.cases import Case
from hotggml.graph import Backend, Graph
from hotggml.parity import build_chain, build_fused

DIT_FULL = Case("dit-self-full", Nh=16, Nkv=8, D=128, S=625, Skv=625)
MEMORY_S = (625, 1250, 3000)


@dataclass(frozen=True)
class MemoryRow:
    S: int
    fused_bytes: int
    chain_bytes: int

    @property
    def ratio(self) -> float:
        return self.fused_bytes / self.chain_bytes


def arena_bytes(case: Case, device: str = "CPU") -> tuple[int, int]:
    """(fused, chain) allocator arena bytes of the fwd+bwd graph at ``case`` (reserve only)."""
    with Backend(device) as be:
        with Graph(be) as g:
            build_fused(g, case)
            fused = g.arena_bytes()
        with Graph(be) as g:
            build_chain(g, case)
            chain = g.arena_bytes()
    return fused, chain


def memory_table(base: Case = DIT_FULL, seq_lens=MEMORY_S, device: str = "CPU") -> list[MemoryRow]:
    """Arena bytes, fused vs exact chain, at base's geometry for each S (= Skv)."""
    rows = []
    for s in seq_lens:
        fused, chain = arena_bytes(replace(base, name=f"{base.name}-{s}", S=s, Skv=s), device)
        rows.append(MemoryRow(s, fused, chain))
    return rows


def format_memory(rows: list[MemoryRow]) -> str:
    first = rows[0]
    lines = [f"{'S':>6} {'fused MiB':>10} {'chain MiB':>10} {'fused/chain':>11} {'fused growth':>12} {'chain growth':>12}"]
    for r in rows:
        lines.append(f"{r.S:>6} {r.fused_bytes / 2**20:>10.1f} {r.chain_bytes / 2**20:>10.1f} {r.ratio:>11.3f} "
                     f"{r.fused_bytes / first.fused_bytes:>11.2f}x {r.chain_bytes / first.chain_bytes:>11.2f}x")
    return "\n".join(lines)


@dataclass(frozen=True)
class TimingResult:
    case: str
    device: str
    threads: int | None
    fused_s: list
    chain_s: list

    @property
    def fused_median(self) -> float:
        return statistics.median(self.fused_s)

    @property
    def chain_median(self) -> float:
        return statistics.median(self.chain_s)

    @property
    def ratio(self) -> float:
        """fused / chain time (< 1: fused is faster)."""
        return self.fused_median / self.chain_median


def time_pair(case: Case, device: str = "CPU", threads: int | None = None, runs: int = 5,
              warmup: int = 1) -> TimingResult:
    """Time fused vs chain fwd+bwd at ``case``, interleaved, ``runs`` (>= 3) per arm after warmup.

    On the CPU, ``threads`` defaults to the machine's core count (ggml's own default is 4).
    """
    if threads is None and device.upper() == "CPU":
        threads = os.cpu_count() or 1
    if runs < 3:
        raise ValueError("runs must be >= 3 (medians of fewer are not worth quoting)")
    with Backend(device, n_threads=threads) as be, Graph(be) as gf, Graph(be) as gc:
        build_fused(gf, case)
        build_chain(gc, case)
        arms = {"fused": gf, "chain": gc}
        times = {"fused": [], "chain": []}
        for r in range(warmup + runs):
            order = ["fused", "chain"] if r % 2 == 0 else ["chain", "fused"]
            for name in order:
                secs = arms[name].compute()
                if r >= warmup:
                    times[name].append(secs)
    return TimingResult(case.id, device, threads, times["fused"], times["chain"])


def format_timing(t: TimingResult) -> str:
    threads = f"{t.threads} threads" if t.threads else "default threads"
    return (f"{t.case} on {t.device} ({threads}), fwd+bwd, {len(t.fused_s)} runs/arm interleaved:\n"
            f"  fused median {t.fused_median * 1e3:8.1f} ms  runs " + ", ".join(f"{x * 1e3:.0f}" for x in t.fused_s) + "\n"
            f"  chain median {t.chain_median * 1e3:8.1f} ms  runs " + ", ".join(f"{x * 1e3:.0f}" for x in t.chain_s) + "\n"
            f"  fused/chain time ratio {t.ratio:.3f}")
