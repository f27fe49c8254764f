"""ci/env.sh is sourced by users' shells (README): it changes only what it promises (PATH, PYTHONPATH, the
`hotggml` function), never shell options (a `set -e` would close an interactive shell at its next failing
command) nor the working folder."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hotggml import paths

SCRIPT = f"""
cd /tmp
source {paths.REPO_ROOT}/ci/env.sh
echo "sourced $?"
false
echo "after-false $?"
echo "cwd $(pwd)"
case $- in *e*) echo "errexit on";; *) echo "errexit off";; esac
set -o | grep -q 'nounset *on' && echo "nounset on" || echo "nounset off"
type -t hotggml
declare -F hotggml_env >/dev/null && echo "leaked function" || echo "no helper left"
[ -n "${{hotggml_root:-}}" ] && echo "leaked variable" || echo "no variable left"
python -c 'import hotggml, sys; print("python", sys.prefix.endswith(".venv"))'
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sourcing_env_sh_changes_only_what_it_promises():
    out = subprocess.run(["bash", "-c", SCRIPT], capture_output=True, text=True, timeout=600).stdout.split("\n")
    assert "sourced 0" in out and "after-false 1" in out  # the shell survives a failing command
    assert "cwd /tmp" in out and "errexit off" in out and "nounset off" in out
    assert "function" in out and "no helper left" in out and "no variable left" in out
    assert "python True" in out
