"""The CI spill gate (ci/ptxas_spills.py) on synthetic ptxas -v reports: it reads each register-family kernel's
spills, fails a TF32 kernel over its recorded baseline (or a new one over the budget) and lets x3 kernels pass."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def gate(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ptxas_spills", ROOT / "ci" / "ptxas_spills.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "BASELINE", tmp_path / "baseline.json")
    return mod


def report(tmp_path, kernels):
    """A ptxas -v log: (mangled name, spill bytes, registers) per function, as ptxas prints them."""
    text = "".join(f"ptxas info    : Function properties for {name}\n"
                   f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
                   f"ptxas info    : Used {regs} registers, used 16 barriers\n" for name, spill, regs in kernels)
    path = tmp_path / "x.cu.log"
    path.write_text(text)
    return str(path)


FWD_TF32 = "_Z16fa_train_fwd_regI8fa_tilesILi128ELi128ELi4ELi1ELi32ELi32ELi1ELi3EELb0EEv15fa_train_params"
FWD_X3 = "_Z16fa_train_fwd_regI8fa_tilesILi128ELi128ELi4ELi1ELi32ELi32ELi1ELi3EELb1EEv15fa_train_params"
BWD_TF32 = "_Z16fa_train_bwd_regI8fa_tilesILi80ELi80ELi4ELi1ELi32ELi32ELi2ELi1EELb0ELb1ELb1EEv15fa_train_params"


def test_keys_name_kind_configuration_and_flags(gate, tmp_path):
    log = report(tmp_path, [(FWD_TF32, 0, 166), (BWD_TF32, 8, 253), ("_Z5otherv", 99, 40)])
    found = list(gate.kernels(pathlib.Path(log).read_text()))
    assert found == [("fwd 128x128x4x1x32x32x1x3 b0", False, 0, 166), ("bwd 80x80x4x1x32x32x2x1 b011", False, 8, 253)]


def test_tf32_kernel_over_its_baseline_fails(gate, tmp_path, capsys):
    gate.BASELINE.write_text(json.dumps({"fwd 128x128x4x1x32x32x1x3 b0": 0, "fwd 128x128x4x1x32x32x1x3 b1": 4}))
    assert gate.main([report(tmp_path, [(FWD_TF32, 346, 168), (FWD_X3, 828, 168)])]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "346 spill bytes > 0" in out and "828" in out   # x3 listed, not failed
    assert out.count("FAIL") == 1


def test_at_baseline_and_x3_over_it_pass(gate, tmp_path):
    gate.BASELINE.write_text(json.dumps({"fwd 128x128x4x1x32x32x1x3 b0": 82}))
    assert gate.main([report(tmp_path, [(FWD_TF32, 82, 168), (FWD_X3, 900, 168)])]) == 0


def test_new_kernel_gets_the_budget(gate, tmp_path):
    gate.BASELINE.write_text("{}")
    assert gate.main([report(tmp_path, [(BWD_TF32, gate.NEW_BUDGET, 255)])]) == 0
    assert gate.main([report(tmp_path, [(BWD_TF32, gate.NEW_BUDGET + 1, 255)])]) == 1


def test_no_kernel_in_the_logs_fails(gate, tmp_path):
    gate.BASELINE.write_text("{}")
    assert gate.main([report(tmp_path, [("_Z5otherv", 0, 10)])]) == 1


def test_write_records_the_logs(gate, tmp_path):
    assert gate.main(["--write", report(tmp_path, [(FWD_TF32, 10, 168)])]) == 0
    assert json.loads(gate.BASELINE.read_text()) == {"fwd 128x128x4x1x32x32x1x3 b0": 10}


def test_committed_baseline_covers_the_family():
    base = json.loads((ROOT / "ci" / "ptxas-spills.json").read_text())
    kinds = {key.split()[0] for key in base}
    assert kinds == {"fwd", "bwd", "di"} and len(base) > 100


def test_ptx_without_x3_removes_only_the_compensated_kernels(tmp_path, monkeypatch):
    """ci/ptx_without_x3.py: the X3 register kernels' entries go (ptxas never sees them), every other entry and the
    text between entries stays byte for byte."""
    monkeypatch.syspath_prepend(str(ROOT / "ci"))
    spec = importlib.util.spec_from_file_location("ptx_without_x3", ROOT / "ci" / "ptx_without_x3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def entry(name, body):
        return f".visible .entry {name}(\n\t.param .u64 p\n)\n{{\n\t{body}\n}}\n"
    head, between = "//\n.version 8.8\n.target sm_90a\n", "\n\t// .globl\tnext\n"
    kept = [entry(FWD_TF32, "ret; // tf32"), entry(BWD_TF32, "ret; // bwd"), entry("_Z5otherv", "ret;")]
    ptx = head + kept[0] + between + entry(FWD_X3, "ret; // x3") + between + kept[1] + kept[2]
    text, removed = mod.without_x3(ptx)
    assert removed == 1 and "x3" not in text
    assert text == head + kept[0] + between + between + kept[1] + kept[2]
