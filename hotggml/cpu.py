"""The CPU features a native build compiles for (ggml's GGML_NATIVE: -march=native), so that a build
folder is never reused, and a library never loaded, on a CPU that lacks one of them (SIGILL otherwise).

Two kinds of build: ``hotggml build`` compiles the CPU backend once, natively (the fastest code for the
machine that builds and runs it); it records the instruction-set flags of that machine, the build key
includes them, and the binding compares them with the running CPU when it loads the library. The wheel
(``HOTGGML_PORTABLE``, CMakeLists.txt) compiles ggml's per-CPU variants instead, and ggml's registry loads
the best one the running CPU supports: nothing to refuse there (its record says ``native: false``).
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

# x86 flags (/proc/cpuinfo names) that change what -march=native emits; on other machines every listed
# feature counts
X86_ISA = frozenset({
    "sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
})


@lru_cache(maxsize=1)
def isa_flags() -> tuple[str, ...]:
    """Sorted instruction-set flags of this CPU ('arch:<machine>' first); only the machine where
    /proc/cpuinfo is unreadable (not Linux)."""
    machine = platform.machine().lower()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags = set(value.split())
                break
    except OSError:
        pass
    if machine in ("x86_64", "amd64", "i686"):
        flags &= X86_ISA
    return (f"arch:{machine}", *sorted(flags))


def missing(required: list[str] | tuple[str, ...]) -> list[str]:
    """The flags of ``required`` (a build's record) this CPU lacks."""
    have = set(isa_flags())
    return [f for f in required if f not in have]
