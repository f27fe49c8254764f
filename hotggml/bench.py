"""Benchmarks of the fused op vs the exact chain: allocator arenas and paired timings (SPEC §6).

Memory is the graph allocator's arena for the whole fwd+bwd graph (exact, deterministic,
nothing computed). Time is ggml_backend_graph_compute of the fwd+bwd graph, arms paired at the
same case, interleaved (order alternating per round), medians and the ratio from one run.
These are claims for tools, never unit tests: the machines are noisy.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass, field, replace

import numpy as np

from hotggml.cases import Case
from hotggml.graph import Backend, Graph
from hotggml.parity import build_chain, build_fused
from hotggml.errors import InputError
from hotggml.probe import probe

SMEM_CAP_ENV = "GGML_CUDA_FA_TRAIN_SMEM_KB"  # read by the CUDA backend at every dispatch of the fused nodes

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


def arena_bytes(case: Case, device: str = "CPU", with_chain: bool = True) -> tuple[int, int]:
    """(fused, chain) allocator arena bytes of the fwd+bwd graph at ``case`` (chain 0 without it): reserve only,
    on Graphs whose leaves hold no data (Graph(reserve_only=True)), so no input of the case is ever allocated."""
    with Backend(device) as be:
        with Graph(be, reserve_only=True) as g:
            build_fused(g, case)
            fused = g.arena_bytes()
        chain = 0
        if with_chain:
            with Graph(be, reserve_only=True) as g:
                build_chain(g, case)
                chain = g.arena_bytes()
    return fused, chain


def memory_case(base: Case, s: int) -> Case:
    """base at S = s: self-attention (Skv == S) moves Skv with S, a causal tail (the chunk) keeps its context
    before the queries (Skv - S), cross-attention keeps the encoder's Skv (and its padding)."""
    if base.Skv == base.S:
        skv = s
    elif base.causal or base.mask == "causal":
        skv = s + base.Skv - base.S
    else:
        skv = base.Skv
    return replace(base, name=f"{base.name}-{s}", S=s, Skv=skv)


def memory_kv_rule(base: Case) -> str:
    """What the memory table varies besides S, in words (memory_case's rule for base)."""
    if base.Skv == base.S:
        return "Skv = S"
    if base.causal or base.mask == "causal":
        return f"Skv = S + {base.Skv - base.S} (the context before the queries)"
    return f"Skv = {base.Skv} (the encoder's)"


def memory_table(base: Case = DIT_FULL, seq_lens=MEMORY_S, device: str = "CPU", with_chain: bool = True) -> list[MemoryRow]:
    """Arena bytes, fused vs exact chain (0 without it), at base's geometry for each S (memory_case: Skv as
    memory_kv_rule says). Nothing of the size of the case is allocated (arena_bytes): any S is measured."""
    rows = []
    for s in seq_lens:
        fused, chain = arena_bytes(memory_case(base, s), device, with_chain)
        rows.append(MemoryRow(s, fused, chain))
    return rows


def format_memory(rows: list[MemoryRow]) -> str:
    first = rows[0]
    lines = [f"{'S':>6} {'fused MiB':>10} {'chain MiB':>10} {'fused/chain':>11} {'fused growth':>12} {'chain growth':>12}"]
    for r in rows:
        if r.chain_bytes:
            lines.append(f"{r.S:>6} {r.fused_bytes / 2**20:>10.1f} {r.chain_bytes / 2**20:>10.1f} {r.ratio:>11.3f} "
                         f"{r.fused_bytes / first.fused_bytes:>11.2f}x {r.chain_bytes / first.chain_bytes:>11.2f}x")
        else:
            lines.append(f"{r.S:>6} {r.fused_bytes / 2**20:>10.1f} {'-':>10} {'-':>11} "
                         f"{r.fused_bytes / first.fused_bytes:>11.2f}x {'-':>12}")
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
        raise InputError("runs must be >= 3 (medians of fewer are not worth quoting)")
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
            f"  fused median {t.fused_median * 1e3:9.3f} ms  runs " + ", ".join(f"{x * 1e3:.3f}" for x in t.fused_s) + "\n"
            f"  chain median {t.chain_median * 1e3:9.3f} ms  runs " + ", ".join(f"{x * 1e3:.3f}" for x in t.chain_s) + "\n"
            f"  fused/chain time ratio {t.ratio:.3f}")


# -- the field table (issue: fused faster than the exact chain at every real shape) ---------------

def visible_pairs(case: Case) -> int:
    """(query, key) pairs the mask leaves visible, summed over the batch (S * Skv * B without a mask)."""
    mask = case.mask_array()
    if mask is None:
        return case.S * case.Skv * case.B
    live = int(np.count_nonzero(~np.isneginf(mask[:, : case.S])))
    return live * (case.B if mask.shape[0] == 1 else 1)


def attention_flops(case: Case) -> tuple[int, int]:
    """(forward, backward) FLOPs of one attention site: forward 2 (D + Dv) Nh x visible pairs (QK^T
    and PV), backward 2.5x that (dV, dP, dQ, dK and the recomputed S: FlashAttention-2's count)."""
    fwd = 2 * (case.D + case.dv) * case.Nh * visible_pairs(case)
    return fwd, fwd * 5 // 2


CEILING_N = 8192  # the ceiling's mul_mat size on a GPU
CEILING_N_CPU = 2048  # on the CPU: 8192^3 is 1.1 TFLOP a product, 6 products, minutes on a few cores (a 2-core
                      # machine: 0.066 TFLOP/s, so about 17 s each); 2048^3 measured 1.7 s in all there (1024^3: 0.061)


def ceiling_size(device: str) -> int:
    """The n of tf32_ceiling's n^3 mul_mat on ``device``: CEILING_N_CPU on the CPU backend (CPU, or a meta device
    of CPUs alone), CEILING_N on any other (a GPU's TF32 tensor cores need the large product to reach their peak)."""
    from hotggml import meta

    names = meta.parse_name(device) or (device,)
    return CEILING_N_CPU if all(name.upper() == "CPU" for name in names) else CEILING_N


def tf32_ceiling(device: str, n: int = CEILING_N, runs: int = 5, threads: int | None = None) -> float:
    """TFLOP/s of ggml's own f32 mul_mat [n, n] x [n, n] on ``device`` (cuBLAS with TF32 tensor cores
    on CUDA): the ceiling the fused kernels are read against, measured in the same call. Median of runs;
    threads: the CPU backend's (None: ggml's default)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((n, n), dtype=np.float32)
    with Backend(device, n_threads=threads) as be, Graph(be) as g:
        out = g.mul_mat(g.input(a, "a"), g.input(a.T.copy(), "b"))
        g.build([out])
        g.compute()  # warm-up
        secs = statistics.median(g.compute() for _ in range(runs))
    return 2 * n**3 / secs / 1e12


@contextlib.contextmanager
def cuda_smem_cap(kib: int | None):
    """The CUDA backend's shared-memory budget per block capped at ``kib`` KiB for the block's duration
    (None: uncapped): the fused nodes then run the configuration of that smaller class (its code path; the
    timings are the H200's, not a smaller card's). The backend reads the variable at every dispatch."""
    old = os.environ.get(SMEM_CAP_ENV)
    if kib is None:
        os.environ.pop(SMEM_CAP_ENV, None)
    else:
        os.environ[SMEM_CAP_ENV] = str(int(kib))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SMEM_CAP_ENV, None)
        else:
            os.environ[SMEM_CAP_ENV] = old


@dataclass
class FieldRow:
    """One geometry: medians (s) per arm, arena bytes per site, FLOPs of fwd+bwd, the kernels that ran
    (arm -> Backend.fa_train_kernel) and the TF32 arm's median under each shared-memory cap (KiB -> s)."""

    case: str
    shape: str
    fused_tf32: float
    fused_f32: float | None
    chain: float | None
    fused_arena: int
    chain_arena: int | None
    flops: int
    kernels: dict = field(default_factory=dict)
    capped: dict = field(default_factory=dict)
    kv_bytes: int = 0            # K and V as the fused graph holds them (a cache in its stored type)
    pool_peak: int | None = None  # the TF32 arm's most op pool memory in one node (CUDA's counter), bytes

    @property
    def ratio(self) -> float | None:
        return self.fused_tf32 / self.chain if self.chain else None


def field_row(case: Case, device: str, runs: int = 5, with_f32: bool = True, with_chain: bool = True,
              warmup: int = 1, caps: tuple[int, ...] = (), threads: int | None = None) -> FieldRow:
    """Time the fused fwd+bwd (TF32 path and f32 path), the exact chain and the TF32 path under each
    shared-memory cap (KiB, CUDA only) at ``case``, interleaved (the order reversed every other round);
    threads: the CPU backend's (None: ggml's default)."""
    arms = [("fused_tf32", "default", None)] + ([("fused_f32", "f32", None)] if with_f32 else [])
    arms += [("chain", None, None)] if with_chain else []
    arms += [(f"tf32@{kib}", "default", kib) for kib in caps]
    with Backend(device, n_threads=threads) as be:
        graphs, kernels, kv_bytes = {}, {}, 0
        try:
            for arm, prec, kib in arms:
                g = graphs[arm] = Graph(be)
                if prec is None:
                    build_chain(g, case)
                else:
                    h = build_fused(g, case, prec)
                    kv_bytes = g.lib.ggml_nbytes(h.k.ptr) + g.lib.ggml_nbytes(h.v.ptr)
                if prec is not None:
                    with cuda_smem_cap(kib):
                        kernels[arm] = probe(case, be, prec).kernel
            arenas = {arm: g.arena_bytes() for arm, g in graphs.items()}
            times = {arm: [] for arm in graphs}
            caps_of = {arm: kib for arm, _, kib in arms}
            names = list(graphs)
            for r in range(warmup + runs):
                for arm in (names if r % 2 == 0 else names[::-1]):
                    with cuda_smem_cap(caps_of[arm]):
                        secs = graphs[arm].compute()
                    if r >= warmup:
                        times[arm].append(secs)
            pool_peak = None
            if device.upper().startswith("CUDA"):  # one more TF32 compute with the op's pool counter reset
                be.fa_train_pool_peak(reset=True)
                graphs["fused_tf32"].compute()
                pool_peak = be.fa_train_pool_peak()
        finally:
            for g in graphs.values():
                g.close()
    med = {arm: statistics.median(t) for arm, t in times.items()}
    fwd, bwd = attention_flops(case)
    return FieldRow(case.id, case.shape, med["fused_tf32"], med.get("fused_f32"), med.get("chain"),
                    arenas["fused_tf32"], arenas.get("chain"), fwd + bwd, kernels,
                    {kib: med[f"tf32@{kib}"] for kib in caps}, kv_bytes, pool_peak)


# what the default-precision arm ran, by the kernels' names ("tf32-reg-d128-smem227", "f32-vulkan", "f32-cpu")
DEFAULT_ARM_MEANS = {"tf32": "on TF32 tensor cores", "f32": "in f32 (this backend has no TF32 path)",
                     "default": "on TF32 at some rows, in f32 at others (the kernel column says which)"}


def default_arm_label(rows: list[FieldRow]) -> str:
    """The column label of the default-precision arm: "tf32" where every row's kernel is a TF32 one, "f32"
    where none is (the CPU, Vulkan, CUDA below sm_80), "default" for a mix; from the kernels that ran (the
    path report), never from the request."""
    tf32 = {r.kernels.get("fused_tf32", "").startswith("tf32-") for r in rows}
    return "tf32" if tf32 == {True} else "f32" if tf32 == {False} else "default"


def format_field(rows: list[FieldRow], ceiling: float, device: str, ceiling_n: int = CEILING_N) -> str:
    caps = sorted({kib for r in rows for kib in r.capped})
    d = default_arm_label(rows)
    head = (f"{'case':<26} {f'{d} ms':>9} {'PREC_F32 ms':>11} {'chain ms':>9} {f'{d}/chain':>10} {'TFLOP/s':>8} "
            f"{'% ceil':>6} {'fused MiB':>9} {'chain MiB':>9} {'arena %':>7}  {f'{d} kernel':<22}"
            + "".join(f" {f'@{kib} ms':>9} {'x':>5}" for kib in caps))
    what = ("TF32 tensor cores on CUDA" if ceiling_n == CEILING_N else
            f"sized for the CPU, where {CEILING_N}^3 takes minutes")
    lines = [f"fwd+bwd per attention site on {device}; ceiling (ggml's f32 mul_mat {ceiling_n}^3: {what}) "
             f"{ceiling:.{1 if ceiling >= 1 else 3}f} TFLOP/s", head, "-" * len(head)]
    for r in rows:
        tflops = r.flops / r.fused_tf32 / 1e12
        def ms(x):
            return f"{x * 1e3:9.2f}" if x is not None else f"{'-':>9}"
        lines.append(f"{r.case:<26} {ms(r.fused_tf32)}   {ms(r.fused_f32)} {ms(r.chain)} "
                     + (f"{r.ratio:10.3f}" if r.ratio is not None else f"{'-':>10}")
                     + f" {tflops:8.1f} {100 * tflops / ceiling:6.1f} {r.fused_arena / 2**20:9.1f} "
                     + (f"{r.chain_arena / 2**20:9.1f} {100 * r.fused_arena / r.chain_arena:7.1f}"
                        if r.chain_arena else f"{'-':>9} {'-':>7}")
                     + f"  {r.kernels.get('fused_tf32', '-'):<22}"
                     + "".join(f" {ms(r.capped[kib])} {r.capped[kib] / r.fused_tf32:5.2f}" if kib in r.capped
                               else f" {'-':>9} {'-':>5}" for kib in caps))
    lines += ["",
              f"{d} ms: the fused arm at the default precision, which ran {DEFAULT_ARM_MEANS[d]}; {d}/chain: its median",
              "  over the exact chain's (paired, interleaved); TFLOP/s: of that arm at FlashAttention-2's count;",
              f"  {d} kernel: what it ran (family-instance-shared-memory class); PREC_F32 ms: the fused arm with",
              "  GGML_PREC_F32 (on CUDA the compensated 3xTF32 product)."]
    if any(r.pool_peak is not None for r in rows):
        lines += ["", "device memory per step (MiB): K/V as the graph holds them, the fused graph's arena, and the op's most",
                  "  pool memory in one node (TF32 arm; mask cells, TF32 copies of the streamed operands, D_i, dK/dV parts)"]
        lines += [f"  {r.case:<26} K/V {r.kv_bytes / 2**20:9.1f}  arena {r.fused_arena / 2**20:9.1f}  op pool "
                  + (f"{r.pool_peak / 2**20:9.1f}" if r.pool_peak is not None else f"{'-':>9}") for r in rows]
    if caps:
        lines += [f"@N ms: the TF32 arm with the CUDA shared-memory budget capped at N KiB ({SMEM_CAP_ENV}), its kernels",
                  "  those of that class's cards; x: its time over the uncapped arm's. The code path, not those cards' speed:",
                  "  the timings are this device's. Kernels under the caps: "
                  + "; ".join(f"{r.case} " + ", ".join(r.kernels.get(f"tf32@{kib}", "-") for kib in caps) for r in rows)]
    return "\n".join(lines)


def profile_by_op(case: Case, device: str, prec: str | None, threads: int | None = None) -> dict[str, float]:
    """Seconds per op name over the fwd+bwd graph computed node by node (prec None: the exact chain; threads:
    the CPU backend's, None: ggml's default)."""
    with Backend(device, n_threads=threads) as be, Graph(be, scheduled=True) as g:
        build_chain(g, case) if prec is None else build_fused(g, case, prec)
        g.compute()  # warm-up: first-use costs (cuBLAS handles, pool growth) are not a node's time
        out: dict[str, float] = {}
        for t, secs in g.profile():
            out[t.op_name] = out.get(t.op_name, 0.0) + secs
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
