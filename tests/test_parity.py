"""Parity of the fused ops on the CPU against the exact chain and the float64 oracle (SPEC §6),
and guards that the comparison itself can fail."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hotggml import cases, parity
from hotggml.cases import Case


@pytest.mark.parametrize("case", cases.SMOKE, ids=lambda c: c.id)
def test_smoke_case(lib, case):
    result = parity.run_case(case, "CPU", threads=[1, 2])
    assert result.passed, f"{case.id} ({case.shape}): " + "; ".join(result.failures)
    # the verdict rests on real comparisons at the f32 bar
    assert result.bar == parity.BARS["f32"] == 1e-4
    assert set(result.errors["fused~oracle"]) >= {"O", "LSE", "dQ", "dK", "dV"}
    assert result.checks["bitwise_across_runs"] is True
    # a 'cancel' case's dQ/dK reference is ~0 by construction: its dV guards against vacuity
    for name in (("dV",) if "cancel" in case.tags else ("dQ", "dK", "dV")):
        assert result.checks[f"{name}_ref_nonzero"] is True
    if "one-hot" in case.tags:
        assert result.checks["one_key_dQ_dK_cancel"] is True
    if case.garbage:
        assert result.checks["garbage_keys_dK_dV_zero"] is True


@pytest.mark.parametrize("case_id,check", [
    ("masked-rows", "masked_rows_dQ_zero"),
    ("masked-rows", "masked_rows_O_zero"),
    ("masked-rows", "masked_rows_LSE_zero"),
    ("batch-padding-cross", "masked_cols_dK_dV_zero"),
    ("batch-bias-per-batch", "masked_cols_dK_dV_zero"),
])
def test_exact_checks_are_exercised(lib, case_id, check):
    case = next(c for c in cases.SMOKE if c.id == case_id)
    result = parity.run_case(case, "CPU", threads=[2], with_chain=False)
    assert check in result.checks, f"{case_id} does not exercise {check}: {sorted(result.checks)}"
    assert result.checks[check] is True


def test_one_hot_case_saturates_in_f32():
    """Every row of the one-hot case has its top two scores more than 104 apart, so every other P
    underflows to 0 in f32: dQ = dK = 0 is then the exact answer, not an approximation."""
    case = next(c for c in cases.SMOKE if "one-hot" in c.tags)
    x = case.inputs()
    s = np.einsum("bhsd,bktd->bhst", x["q"].astype(np.float64), x["k"].astype(np.float64)) * case.scale
    top2 = np.sort(s, axis=-1)[..., -2:]
    assert np.min(top2[..., 1] - top2[..., 0]) > 104


def test_garbage_cases_hold_nan_where_masked():
    for case in (c for c in cases.SMOKE if c.garbage):
        x = case.inputs(with_garbage=True)
        dead = case.dead_keys()
        assert dead.any() and not dead.all()
        for b, j in zip(*np.nonzero(dead)):
            assert np.isnan(x["k"][b, :, j]).all() and np.isnan(x["v"][b, :, j]).all()
        assert np.isfinite(case.inputs()["k"]).all()


def test_lse_gap_is_exercised():
    """At least one smoke case has an alignment gap between O and LSE (O's float count % 4 != 0)."""
    assert any((c.dv * c.Nh * c.S * c.B) % 4 for c in cases.SMOKE)


# -- the comparison can fail ------------------------------------------------------------------

def _oracle_pair(case_id="gqa-band"):
    case = next(c for c in cases.SMOKE if c.id == case_id)
    ref = parity.run_oracle(case)
    live = np.ones((case.B, case.S), dtype=bool)
    return case, ref, live


def test_compare_flags_a_corrupted_dk():
    _, ref, live = _oracle_pair()
    exact = parity._compare(dataclasses.replace(ref), ref, live)
    assert all(err == 0 for err in exact.values())
    bad = dataclasses.replace(ref, dk=ref.dk * 1.001)
    errs = parity._compare(bad, ref, live)
    assert errs["dK"] > 1e-4 and errs["dK"] == pytest.approx(1e-3, rel=1e-6)
    assert errs["dQ"] == 0 and errs["dV"] == 0 and errs["O"] == 0


@pytest.mark.parametrize("field", ["o", "lse", "dq", "dv"])
def test_compare_flags_each_output(field):
    _, ref, live = _oracle_pair()
    bad = dataclasses.replace(ref, **{field: getattr(ref, field) * 1.001})
    errs = parity._compare(bad, ref, live)
    key = {"o": "O", "lse": "LSE", "dq": "dQ", "dv": "dV"}[field]
    assert errs[key] > 1e-4


def test_compare_flags_nan():
    _, ref, live = _oracle_pair()
    dq = ref.dq.copy()
    dq[0, 0, 0, 0] = np.nan
    assert parity._compare(dataclasses.replace(ref, dq=dq), ref, live)["dQ"] == float("inf")


def test_run_case_fails_on_corrupted_fused(lib, monkeypatch):
    """End to end: a fused arm that is 0.1% off in dK, or leaves the O/LSE gap dirty, fails the case."""
    real = parity.run_fused
    case = next(c for c in cases.SMOKE if c.id == "odd-causal-cross")

    def off_dk(case, backend, prec="default"):
        r = real(case, backend, prec)
        return dataclasses.replace(r, dk=r.dk * np.float32(1.001))

    monkeypatch.setattr(parity, "run_fused", off_dk)
    res = parity.run_case(case, "CPU", threads=[2])
    assert not res.passed
    assert any(f.startswith("fused~oracle dK") for f in res.failures), res.failures

    def dirty_gap(case, backend, prec="default"):
        return dataclasses.replace(real(case, backend, prec), lse_gap_zero=False)

    monkeypatch.setattr(parity, "run_fused", dirty_gap)
    res = parity.run_case(case, "CPU", threads=[2], with_chain=False)
    assert not res.passed and "check lse_gap_zero failed" in res.failures


def test_vacuous_case_fails(lib):
    """S = Skv = 1: softmax is constant, dQ = dK = 0 -> the non-zero reference check fails the case."""
    res = parity.run_case(Case("vacuous", D=4, S=1, Skv=1), "CPU", threads=[2], with_chain=False)
    assert not res.passed
    assert "check dQ_ref_nonzero failed" in res.failures
    assert "check dK_ref_nonzero failed" in res.failures


def test_rel_err():
    assert parity.rel_err(np.array([1.0, 2.0]), np.array([1.0, 2.5])) == pytest.approx(0.2)
    assert parity.rel_err(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == float("inf")
    assert parity.rel_err(np.array([np.inf, 1.0]), np.array([1.0, 1.0])) == float("inf")
    # floor: against an all-zero reference the error is relative to 1e-5
    assert parity.rel_err(np.array([1e-6]), np.array([0.0])) == pytest.approx(0.1)
    assert parity.rel_err(np.zeros(0), np.zeros(0)) == 0.0
    with pytest.raises(ValueError):
        parity.rel_err(np.zeros(3), np.zeros(4))


# -- the backward node stands alone (SPEC §4) ----------------------------------------------------

@pytest.mark.parametrize("case_id", ["lse-loss", "odd-causal-cross", "q-view-bias"])
def test_backward_stands_alone(lib, cpu, case_id):
    """ggml's scheduler replaces a source on another backend's buffer with a plain copy (op NONE, no
    sources, zeroed op_params). Swap the backward's src[4] (the forward node) for such a tensor holding
    the forward's bytes: the backward must give the same gradients, and pass parity."""
    from hotggml.ffi import ffi
    from hotggml.graph import Graph
    from hotggml.ops import OP_FLASH_ATTN_TRAIN_BACK

    case = next(c for c in cases.SMOKE if c.id == case_id)
    with Graph(cpu) as g:
        h = parity.build_fused(g, case, "f32")
        g.compute(poison=h.fused_nodes)
        packed = g.read(h.fwd)
        normal = parity.read_fused(g, case, h)
    with Graph(cpu) as g:
        plain = g.input(packed, "forward bytes")
        h = parity.build_fused(g, case, "f32")
        back = g.find_nodes(OP_FLASH_ATTN_TRAIN_BACK)[0]
        assert back.ptr.src[4] == h.fwd.ptr
        back.ptr.src[4] = plain.ptr
        assert plain.op == 0 and all(plain.ptr.src[i] == ffi.NULL for i in range(10))
        assert all(x == 0 for x in plain.ptr.op_params)
        g.compute(poison=[back])
        alone = parity.read_fused(g, case, h)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(getattr(alone, name), getattr(normal, name)), name
    ref = parity.run_oracle(case)
    live = ~parity.oracle.masked_rows(case.mask_array(), case.B, case.S)
    errs = parity._compare(alone, ref, live)
    assert max(errs.values()) <= parity.BARS["f32"], errs


def test_the_parity_command_says_where_a_long_case_is(lib, monkeypatch, capsys):
    """A field-set case runs for minutes on a CPU: each arm (and each oracle head) is reported on stderr as it
    ends, once the heartbeat's interval has passed (zero here, so every step shows)."""
    from hotggml import cli

    monkeypatch.setattr(cli._Heartbeat, "EVERY_S", 0.0)
    assert cli.main(["parity", "-p", "^gqa-band$", "--threads", "1,2"]) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [line.split(": ", 1)[1].split(" (")[0] for line in err if line.startswith("[1/1] gqa-band: ")]
    assert steps == ["oracle head 1/4", "oracle head 2/4", "oracle head 3/4", "oracle head 4/4", "oracle done",
                     "fused at 1 thread(s) done", "fused at 2 thread(s) done", "chain done"]


def test_an_id_names_one_case_in_every_set():
    """Two cases of one id in different sets (the real set's stored band mask and the field set's implicit window
    were both dit-self-window-625) made `bench --case` and `memory --case` time different cases under one name;
    a case in several sets is the same case, and selecting sets twice runs it once."""
    by_id = {}
    for name, members in cases.SETS.items():
        for c in members:
            assert by_id.setdefault(c.id, (name, c))[1] == c, f"{c.id}: {by_id[c.id][0]} and {name} differ"
    twice = cases.select(["smoke", "smoke", "real", "field"], "^dit-self-full-625$")
    assert [c.id for c in twice] == ["dit-self-full-625"]
