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
    assert len(blocks) == 1, "the README has one Python example"
    run = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "O and dQ match float64 NumPy" in run.stdout


def test_readme_states_the_prerequisites_as_the_build_does():
    readme = (paths.REPO_ROOT / "README.md").read_text()
    cmake_min = re.search(r"cmake_minimum_required\(VERSION ([\d.]+)\)", (paths.REPO_ROOT / "CMakeLists.txt").read_text())
    assert f"CMake >= {cmake_min.group(1)}" in readme
    assert f'cmake.version = ">={cmake_min.group(1)}"' in (paths.REPO_ROOT / "pyproject.toml").read_text()
    assert "rpc" in readme.lower() and "hotggml bench" in readme and "hotggml probe" in readme
