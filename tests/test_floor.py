"""The upstream floor's bookkeeping (hotggml.floor): parsing test-backend-ops output and judging
patched against stock. The runs themselves need builds with ggml's tests (`hotggml floor`)."""

from __future__ import annotations

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
