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
from dataclasses import dataclass, field
from pathlib import Path

from hotggml.build import TestBuild
from hotggml.errors import BuildError

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


@dataclass
class OpVerdict:
    op: str
    stock: OpRun | None
    patched: OpRun
    regressions: list = field(default_factory=list)

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
    cases: dict[str, str] = {}
    for line in _ANSI.sub("", output).splitlines():
        m = _CASE.match(line)
        if not m:
            continue
        case, status = m.group(1), _status(m.group(2))
        if _RANK[status] >= _RANK.get(cases.get(case, "ok"), 0):
            cases[case] = status
    return cases


def list_ops(program: Path) -> list[str]:
    """The op names a test-backend-ops program knows (``--list-ops``)."""
    out = _run([str(program), "--list-ops"], timeout=60).stdout
    return [line.strip() for line in out.splitlines()[1:] if line.strip()]


def _run(cmd: list[str], timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not Path(cmd[0]).exists() and cmd[0] != "ctest":
        raise BuildError(f"{cmd[0]} does not exist: build with tests first")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})


def run_op(program: Path, mode: str, device: str, op: str, timeout: int = 900) -> OpRun:
    """Run one op's cases; rc 0 = all passed, 1 = some failed, anything else = the program aborted."""
    try:
        proc = _run([str(program), mode, "-o", op, "-b", device], timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return OpRun(parse_cases(out), crashed=True, returncode=124)
    return OpRun(parse_cases(proc.stdout + proc.stderr), crashed=proc.returncode not in (0, 1),
                 returncode=proc.returncode)


def judge(op: str, stock: OpRun | None, patched: OpRun) -> OpVerdict:
    """Regressions of one op: stock passes where patched does not, or patched alone aborts."""
    v = OpVerdict(op, stock, patched)
    if stock is None:  # an op of ours: every supported case must pass, and the program must finish
        v.regressions += [f"{c}: {s}" for c, s in patched.cases.items() if s == "fail"]
        if patched.crashed:
            v.regressions.append(f"aborted (rc {patched.returncode})")
        return v
    for case, status in stock.cases.items():
        if status == "ok" and patched.cases.get(case, "missing") not in ("ok", "skipped"):
            v.regressions.append(f"{case}: stock ok, patched {patched.cases.get(case, 'missing')}")
    if patched.crashed and not stock.crashed:
        v.regressions.append(f"aborted when patched only (rc {patched.returncode})")
    return v


def compare_ops(stock: TestBuild, patched: TestBuild, mode: str, device: str,
                ops: list[str] | None = None) -> list[OpVerdict]:
    """Every op (or ``ops``) of the patched program, in ``mode`` on ``device``, against stock."""
    stock_ops = set(list_ops(stock.test_backend_ops))
    verdicts = []
    for op in ops or list_ops(patched.test_backend_ops):
        base = run_op(stock.test_backend_ops, mode, device, op) if op in stock_ops else None
        verdicts.append(judge(op, base, run_op(patched.test_backend_ops, mode, device, op)))
    return verdicts


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
                         + ("ok" if v.ok else "REGRESSION: " + "; ".join(v.regressions[:3])))
    bad = [v.op for v in verdicts if not v.ok]
    n_cases = sum(len(v.patched.cases) for v in verdicts)
    lines.append(f"{len(verdicts)} ops, {n_cases} cases: " + (f"{len(bad)} regressed ({', '.join(bad)})" if bad
                                                           else "no regression"))
    return "\n".join(lines)
