#!/usr/bin/env bash
# `pip install .` through scikit-build-core, from a fresh clone of this checkout's HEAD (an empty
# .hotggml: the build itself fetches the pinned sdist through pip, as on a user's machine, never from
# the cache an earlier step filled): the wheel must carry the patched libraries in hotggml/lib, and
# the installed package, run from /, must load them, pass its stamp check and a smoke parity case, and
# leave site-packages as it was installed; an editable install of the same clone loads its libraries too.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
out=$PWD/.hotggml/wheel
rm -rf "$out" && mkdir -p "$out"
git clone --quiet . "$out/src"
python -m pip wheel "$out/src" --no-deps --quiet --disable-pip-version-check -w "$out/dist"
python -m venv "$out/venv"
"$out/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$out"/dist/hotggml-*.whl
cd / && env -u PYTHONPATH "$out/venv/bin/python" - <<'PY'
import hotggml, hotggml.ffi as ffi
from hotggml import cases, parity
lib_dir = ffi.find_lib_dir()
assert lib_dir == ffi._package_lib_dir(), f"installed package loaded {lib_dir}, not its own lib/"
res = parity.run_case(cases.SMOKE[5], "CPU", threads=[1, 2])
print(f"wheel: {hotggml.__file__}: libraries {lib_dir}, stamp {ffi.library_info()['series_hash'][:12]}, "
      f"{res.case} {'PASS' if res.passed else 'FAIL ' + '; '.join(res.failures)}")
if not res.passed:
    raise SystemExit(1)

# the installed command, from /: parity runs, a checkout-only command refuses by name, and nothing
# under site-packages is created or changed (state goes to the user's cache folder)
import os, pathlib, subprocess, sys
site = pathlib.Path(hotggml.__file__).parent.parent
def snapshot():
    return {str(p): p.stat().st_mtime_ns for p in site.rglob("*") if "__pycache__" not in p.parts}
before = snapshot()
hg = pathlib.Path(sys.executable).parent / "hotggml"
env = {**os.environ, "XDG_CACHE_HOME": os.environ.get("WHEEL_CACHE", "/tmp/hotggml-wheel-cache")}
run = subprocess.run([str(hg), "parity", "--set", "smoke", "-p", "^tiny$"], capture_output=True, text=True, env=env)
assert run.returncode == 0, run.stdout + run.stderr
run = subprocess.run([str(hg), "fetch"], capture_output=True, text=True, env=env)
assert run.returncode == 2 and "works on a hotggml checkout" in run.stderr, run.stderr
after = snapshot()
assert after == before, f"site-packages changed: {sorted(set(after) ^ set(before))[:5]}"
print(f"wheel: from /, `hotggml parity` passes, `hotggml fetch` refuses by name, site-packages unchanged ({len(after)} files)")
PY

# an editable install (`pip install -e .`) of the same clone loads the libraries it installed, from / too
python -m venv "$out/venv-e"
"$out/venv-e/bin/python" -m pip install --quiet --disable-pip-version-check -e "$out/src"
cd / && env -u PYTHONPATH "$out/venv-e/bin/python" - <<'PY'
import hotggml.ffi as ffi
from hotggml import cases, parity
lib_dir = ffi.find_lib_dir()
assert lib_dir == ffi._package_lib_dir() and (lib_dir / "libggml.so").exists(), lib_dir
res = parity.run_case(cases.SMOKE[0], "CPU")
print(f"editable: modules {ffi.__file__}, libraries {lib_dir}: {res.case} {'PASS' if res.passed else 'FAIL'}")
raise SystemExit(0 if res.passed else 1)
PY
