"""The README's Python example is run as written: an example that no longer works is a failing test."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hotggml import paths


def test_readme_python_example_runs(lib):
    text = (paths.REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3, ("the README has three Python examples: the ops with autodiff, a graph through an RPC "
                              "server, a frozen cache with AdamW")
    said = []
    for block in blocks:
        run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
        assert run.returncode == 0, run.stderr[-2000:]
        said.append(run.stdout)
    assert "O and dQ match float64 NumPy" in said[0]
    assert said[1].split() == ["RPC0", "True", "True"], said[1]
    assert "AdamW against a frozen q8_0 cache: loss" in said[2]


# the binding's example must not need the tooling: GitPython, the build orchestrator or the patch modules
_TOOLING = ("git", "hotggml.build", "hotggml.patches", "hotggml.gitutil", "hotggml.pin")
_BLOCK_TOOLING = f"""
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name in {_TOOLING!r} or name.startswith("git."):
            raise ImportError("blocked by the test: the binding imported " + name)
sys.meta_path.insert(0, _Blocked())
"""


def test_readme_example_runs_without_the_tooling(lib):
    """The README's example with GitPython, hotggml.build and the patch modules made unimportable: the binding
    (graph, ops, ffi) finds and checks its library without them, and none is in sys.modules afterwards."""
    text = (paths.REPO_ROOT / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    check = f"\nimport sys\nloaded = [m for m in {_TOOLING!r} if m in sys.modules]\nassert not loaded, loaded\n"
    run = subprocess.run([sys.executable, "-c", _BLOCK_TOOLING + example + check], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "O and dQ match float64 NumPy" in run.stdout


def test_readme_states_the_prerequisites_as_the_build_does():
    readme = (paths.REPO_ROOT / "README.md").read_text()
    cmake_min = re.search(r"cmake_minimum_required\(VERSION ([\d.]+)\)", (paths.REPO_ROOT / "CMakeLists.txt").read_text())
    assert f"CMake >= {cmake_min.group(1)}" in readme
    assert f'cmake.version = ">={cmake_min.group(1)}"' in (paths.REPO_ROOT / "pyproject.toml").read_text()


def test_the_readme_patch_table_lists_the_series_in_order():
    """The README's table of patches names every patch of patches/series, in the series' order (it had drifted)."""
    readme = (paths.REPO_ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `([a-z0-9_.-]+)`(?: \(fork-only\))? \|", readme, re.M)
    series = [line.split("#", 1)[0].strip().removesuffix(".patch")
              for line in (paths.PATCHES_DIR / "series").read_text().splitlines()]
    assert listed == [name for name in series if name], listed
