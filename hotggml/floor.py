"""Upstream's own tests as the floor: the patched tree must do no worse than the stock pin, op for op.

Both trees are built with ggml's tests (hotggml.build.build_stock / build_with_tests). Then, per arm:

- ``ctest`` (ggml's test programs): the names of the failing tests;
- ``test-backend-ops MODE -o OP -b DEVICE`` once per op (so an abort in one op, which stock ggml
  has in grad mode, costs only that op): the status of every test case.

A regression is a case that passes on stock and does not on the patched tree (fails, or never ran
because the program aborted), an op that aborts only when patched, or a ctest that fails only when
patched. Ops that exist only in the patched tree (ours) must pass wherever they are supported.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hotggml.build import TestBuild
from hotggml.errors import BuildError, InputError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CASE = re.compile(r"^  (\S[^:]*?\)): (.*)$")  # "  OP(vars): status ..." (vars hold no ')')

# a case's statuses across its printed lines; the worst one wins
_RANK = {"ok": 0, "skipped": 1, "unsupported": 2, "fail": 3}


@dataclass
class OpRun:
    """One ``test-backend-ops MODE -o OP`` run: case -> status, and whether the program aborted."""

    cases: dict = field(default_factory=dict)
    crashed: bool = False
    returncode: int = 0
    messages: dict = field(default_factory=dict)  # failing case -> what test-backend-ops said (e.g. MAA = ...)
    tested: bool = True  # the device was tested (test-backend-ops skips a backend of another name, and passes)


@dataclass
class OpVerdict:
    op: str
    stock: OpRun | None
    patched: OpRun
    regressions: list = field(default_factory=list)
    flaky: list = field(default_factory=list)  # cases whose status changed between runs of one arm

    @property
    def ok(self) -> bool:
        return not self.regressions


def _status(text: str) -> str:
    if "FAIL" in text:
        return "fail"
    if "not supported" in text:
        return "unsupported"
    if "skipping" in text:
        return "skipped"
    return "ok" if "OK" in text else "skipped"


def parse_cases(output: str) -> dict[str, str]:
    """Case string -> worst status from test-backend-ops console output (ANSI colours removed)."""
    return _parse(output)[0]


def _parse(output: str) -> tuple[dict[str, str], dict[str, str]]:
    cases: dict[str, str] = {}
    messages: dict[str, str] = {}
    for line in _ANSI.sub("", output).splitlines():
        m = _CASE.match(line)
        if not m:
            continue
        case, status = m.group(1), _status(m.group(2))
        if status == "fail" and case not in messages:
            messages[case] = m.group(2).replace("FAIL", "").strip()  # the first line says why
        if _RANK[status] >= _RANK.get(cases.get(case, "ok"), 0):
            cases[case] = status
    return cases, messages


def list_ops(program: Path) -> list[str]:
    """The op names a test-backend-ops program knows (``--list-ops``; its header and total line dropped)."""
    out = _run([str(program), "--list-ops"], timeout=60).stdout
    return [line.strip() for line in out.splitlines() if re.fullmatch(r"\s+[A-Z0-9_]+\s*", line)]


def _run(cmd: list[str], timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not Path(cmd[0]).exists() and cmd[0] != "ctest":
        raise BuildError(f"{cmd[0]} does not exist: build with tests first")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})


def run_op(program: Path, mode: str, device: str, op: str, timeout: int = 900) -> OpRun:
    """Run one op's cases; rc 0 = all passed, 1 = some failed, anything else = the program aborted."""
    try:
        proc = _run([str(program), mode, "-o", op, "-b", device], timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = 124
    cases, messages = _parse(output)
    tested = re.search(r"^[ \t]+Backend [^:\n]+: ", _ANSI.sub("", output), re.M) is not None  # its verdict line
    return OpRun(cases, crashed=rc not in (0, 1), returncode=rc, messages=messages, tested=tested)


def judge(op: str, stock: OpRun | list[OpRun] | None, patched: OpRun | list[OpRun]) -> OpVerdict:
    """Regressions of one op: stock passes where patched does not, or patched alone aborts.

    With several runs per arm (reruns of an op that differed), a case regresses only when it passed
    in every stock run and in no patched run: ggml's cases draw fresh random inputs each run, and some
    of stock's own grad cases pass or fail by the draw (reported as flaky, not as regressions).
    """
    stock_runs = [stock] if isinstance(stock, OpRun) else (stock or [])
    patched_runs = [patched] if isinstance(patched, OpRun) else patched
    v = OpVerdict(op, stock_runs[0] if stock_runs else None, patched_runs[0])
    if not stock_runs:  # an op of ours: every supported case must pass, and the program must finish
        for run in patched_runs:
            v.regressions += [f"{c}: {run.messages.get(c, s)}" for c, s in run.cases.items() if s == "fail"]
            if run.crashed:
                v.regressions.append(f"aborted (rc {run.returncode})")
        return v
    for case in dict.fromkeys(c for run in stock_runs for c in run.cases):
        if not all(run.cases.get(case) == "ok" for run in stock_runs):
            continue
        got = [run.cases.get(case, "missing") for run in patched_runs]
        if all(g not in ("ok", "skipped") for g in got):
            v.regressions.append(f"{case}: stock ok, patched {patched_runs[0].messages.get(case, got[0])}")
        elif any(g not in ("ok", "skipped") for g in got):
            v.flaky.append(case)
    if all(run.crashed for run in patched_runs) and not any(run.crashed for run in stock_runs):
        v.regressions.append(f"aborted when patched only (rc {patched_runs[0].returncode})")
    return v


Progress = Callable[[int, int, "OpVerdict", float], None]  # (done, total, verdict, seconds of that op)


def compare_ops(stock: TestBuild | None, patched: TestBuild, mode: str, device: str,
                ops: list[str] | None = None, reruns: int = 2, progress: Progress | None = None) -> list[OpVerdict]:
    """Every op (or ``ops``) of the patched program, in ``mode`` on ``device``, against stock; an op
    that differs is run ``reruns`` more times on both arms before it is called a regression. Without a
    stock build (None), the patched runs alone: every case run must pass. ``progress`` is called after
    each op (a run over every op takes tens of minutes)."""
    stock_ops = set(list_ops(stock.test_backend_ops)) if stock is not None else set()
    known = list_ops(patched.test_backend_ops)
    unknown = [op for op in ops or [] if op not in known]
    if unknown:  # test-backend-ops runs no case of an op it does not know, and passes
        raise InputError(f"no op {', '.join(map(repr, unknown))} in test-backend-ops (names as ggml_op_desc gives "
                         f"them: {', '.join(known[:6])}, ..., `test-backend-ops --list-ops` lists them)")
    names = ops or known
    verdicts = []
    for i, op in enumerate(names, start=1):
        t0 = time.monotonic()
        if stock is None:
            v = judge(op, None, run_op(patched.test_backend_ops, mode, device, op))
        else:
            base = [run_op(stock.test_backend_ops, mode, device, op)] if op in stock_ops else []
            mine = [run_op(patched.test_backend_ops, mode, device, op)]
            v = judge(op, base, mine)
            if base and not v.ok:
                for _ in range(reruns):
                    base.append(run_op(stock.test_backend_ops, mode, device, op))
                    mine.append(run_op(patched.test_backend_ops, mode, device, op))
                v = judge(op, base, mine)
        if not v.patched.tested and not v.patched.crashed:  # every op would pass, having run nothing
            raise InputError(f"test-backend-ops tested no backend named {device!r} (it skips the others and "
                             "passes): name one of the build's devices, e.g. CPU or CUDA0")
        verdicts.append(v)
        if progress is not None:
            progress(i, len(names), v, time.monotonic() - t0)
    return verdicts


def verdict_line(v: OpVerdict) -> str:
    """A short account of one op's verdict: its patched cases and the outcome (for progress lines)."""
    n = {s: sum(1 for x in v.patched.cases.values() if x == s) for s in _RANK}
    what = "ok" if v.ok else "REGRESSION"
    return f"{v.op}: {n['ok']} ok, {n['fail']} fail" + (" (aborted)" if v.patched.crashed else "") + f": {what}"


def ctest_failures(build: TestBuild, jobs: int | None = None, timeout: int = 1800) -> tuple[int, list[str]]:
    """(tests run, names of the failing ones) of ggml's ctest in a build with tests."""
    proc = _run(["ctest", "-j", str(jobs or os.cpu_count() or 2), "--timeout", "600"], timeout=timeout,
                cwd=build.ctest_dir)
    text = proc.stdout + proc.stderr
    m = re.search(r"tests passed, (\d+) tests? failed out of (\d+)", text)
    if not m:
        raise BuildError(f"ctest in {build.ctest_dir} printed no summary:\n{text[-2000:]}")
    failed = re.findall(r"^\s*\d+ - (\S+) \(", text.split("The following tests FAILED:")[-1], re.M) \
        if int(m.group(1)) else []
    return int(m.group(2)), sorted(failed)


def format_ops(verdicts: list[OpVerdict], mode: str, device: str) -> str:
    """One line per op whose outcome differs from 'all passed on both', then a summary line."""
    def counts(run: OpRun | None) -> str:
        if run is None:
            return "(new op)"
        n = {s: sum(1 for x in run.cases.values() if x == s) for s in _RANK}
        return f"{n['ok']} ok {n['fail']} fail" + (" ABORT" if run.crashed else "")

    lines = [f"test-backend-ops {mode} on {device}: op, stock, patched, verdict"]
    for v in verdicts:
        interesting = not v.ok or v.stock is None or v.patched.crashed or any(
            s == "fail" for s in v.patched.cases.values())
        if interesting:
            lines.append(f"  {v.op:<24} {counts(v.stock):<22} {counts(v.patched):<22} "
                         + ("ok" if v.ok else "REGRESSION: " + "; ".join(v.regressions[:3]))
                         + (f" ({len(v.flaky)} flaky case(s) across reruns)" if v.flaky else ""))
    bad = [v.op for v in verdicts if not v.ok]
    n_cases = sum(len(v.patched.cases) for v in verdicts)
    lines.append(f"{len(verdicts)} ops, {n_cases} cases: " + (f"{len(bad)} regressed ({', '.join(bad)})" if bad
                                                           else "no regression"))
    return "\n".join(lines)
