"""The upstream floor's bookkeeping (hotggml.floor): parsing test-backend-ops output and judging
patched against stock. The runs themselves need builds with ggml's tests (`hotggml floor`)."""

from __future__ import annotations

import pytest

from hotggml import floor

OUT = """Testing 1 devices

Backend 1/1: CPU
  ADD(type=f32,ne=[10,5,4,3]): \x1b[1;32mOK\x1b[0m
  SUM(type=f32,ne=[10,5,4,3]): [SUM] MAA = 0.2 > 0.0001 \x1b[1;31mFAIL\x1b[0m
  SUM(type=f32,ne=[10,5,4,3]): compare failed \x1b[1;31mFAIL\x1b[0m
  GEGLU(type=f32,ne_a=[128,2,2,2],v=0,swapped=1): \x1b[1;32mOK\x1b[0m
  GEGLU(type=f32,ne_a=[128,2,2,2],v=0,swapped=1): not supported [GEGLU]
  MUL_MAT(type_a=f32,k=[1,2]): skipping large tensors for speed
"""


def test_parse_cases_takes_the_worst_status_per_case():
    cases = floor.parse_cases(OUT)
    assert cases == {
        "ADD(type=f32,ne=[10,5,4,3])": "ok",
        "SUM(type=f32,ne=[10,5,4,3])": "fail",
        "GEGLU(type=f32,ne_a=[128,2,2,2],v=0,swapped=1)": "unsupported",
        "MUL_MAT(type_a=f32,k=[1,2])": "skipped",
    }


def _run(crashed=False, **cases):
    return floor.OpRun({f"OP(x={k})": v for k, v in cases.items()}, crashed=crashed, returncode=134 if crashed else 0)


def test_judge_flags_a_case_that_passed_on_stock_only():
    v = floor.judge("OP", _run(a="ok", b="ok", c="fail"), _run(a="ok", b="fail", c="fail"))
    assert not v.ok and v.regressions == ["OP(x=b): stock ok, patched fail"]


def test_judge_flags_cases_lost_to_an_abort_of_the_patched_tree_only():
    v = floor.judge("OP", _run(a="ok", b="ok"), _run(crashed=True, a="ok"))
    assert not v.ok
    assert any("missing" in r for r in v.regressions) and any("aborted" in r for r in v.regressions)


def test_judge_accepts_the_same_abort_as_stock_and_fixes():
    assert floor.judge("OP", _run(crashed=True, a="ok", b="fail"), _run(crashed=True, a="ok", b="ok")).ok


def test_judge_new_op_must_pass_every_supported_case():
    assert floor.judge("NEW", None, _run(a="ok", b="unsupported")).ok
    assert not floor.judge("NEW", None, _run(a="ok", b="fail")).ok
    assert not floor.judge("NEW", None, _run(crashed=True, a="ok")).ok


def test_failures_keep_what_test_backend_ops_said():
    cases, messages = floor._parse(OUT)
    assert messages == {"SUM(type=f32,ne=[10,5,4,3])": "[SUM] MAA = 0.2 > 0.0001"}
    v = floor.judge("SUM", None, floor.OpRun(cases, messages=messages))
    assert v.regressions == ["SUM(type=f32,ne=[10,5,4,3]): [SUM] MAA = 0.2 > 0.0001"]


def test_judge_over_reruns_separates_flaky_from_regressed():
    stock = [_run(a="ok", b="ok", c="ok"), _run(a="ok", b="ok", c="ok")]
    patched = [_run(a="fail", b="ok", c="ok"), _run(a="fail", b="fail", c="ok")]
    v = floor.judge("OP", stock, patched)
    assert [r.split(":")[0] for r in v.regressions] == ["OP(x=a)"] and v.flaky == ["OP(x=b)"]
    # a case stock itself fails in some run is no floor at all
    assert floor.judge("OP", [_run(a="ok"), _run(a="fail")], [_run(a="fail"), _run(a="fail")]).ok


def _fake_program(path, ops: dict[str, str]) -> "Path":
    """A stand-in test-backend-ops: --list-ops names ops; `grad -o OP -b DEVICE` prints OP's case lines."""
    lines = ["#!/bin/sh", 'if [ "$1" = --list-ops ]; then', "  echo 'Available ops:'"]
    lines += [f"  echo '  {op}'" for op in ops] + ["  exit 0", "fi", 'case "$3" in']
    lines += [f"  {op}) printf '%s\\n' '  {op}(x=1): {status}' ;;" for op, status in ops.items()] + ["esac"]
    # its backend's verdict line, or "Skipping" for a device of another name (then it passes, having run nothing)
    lines += ['if [ "$5" = CPU ]; then echo "  Backend CPU: OK"; else echo "  Skipping"; fi']
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def test_compare_ops_reports_each_op_as_it_ends(tmp_path):
    """The per-op loop runs for tens of minutes on two cores: progress after each op, in order, with its verdict."""
    from hotggml.build import TestBuild

    ops = {"ADD": "OK", "SUM": "FAIL", "MUL": "OK"}
    stock = TestBuild("stock", tmp_path, _fake_program(tmp_path / "stock", dict.fromkeys(ops, "OK")))
    patched = TestBuild("patched", tmp_path, _fake_program(tmp_path / "patched", ops))
    seen = []
    verdicts = floor.compare_ops(stock, patched, "grad", "CPU", progress=lambda *a: seen.append(a), reruns=0)
    assert [(done, total, v.op) for done, total, v, _ in seen] == [(1, 3, "ADD"), (2, 3, "SUM"), (3, 3, "MUL")]
    assert [v.ok for v in verdicts] == [True, False, True] and all(s >= 0 for *_, s in seen)
    assert floor.verdict_line(seen[1][2]).endswith("REGRESSION")
    # without a stock build the patched program alone is judged, op by op too
    seen.clear()
    assert [v.ok for v in floor.compare_ops(None, patched, "grad", "CPU", progress=lambda *a: seen.append(a))] \
        == [True, False, True] and len(seen) == 3


def test_compare_ops_refuses_an_op_or_a_device_that_runs_nothing(tmp_path):
    """test-backend-ops runs no case of an unknown op (`-o flash_attn_train`: names are upper case) and skips a
    backend of another name, and passes both: floor said "no regression" after 0 cases."""
    from hotggml.build import TestBuild
    from hotggml.errors import InputError

    patched = TestBuild("patched", tmp_path, _fake_program(tmp_path / "patched", {"ADD": "OK"}))
    with pytest.raises(InputError, match="no op 'add' in test-backend-ops"):
        floor.compare_ops(None, patched, "grad", "CPU", ["add"])
    with pytest.raises(InputError, match="tested no backend named 'NOPE'"):
        floor.compare_ops(None, patched, "grad", "NOPE", ["ADD"])
    assert [v.ok for v in floor.compare_ops(None, patched, "grad", "CPU", ["ADD"])] == [True]
