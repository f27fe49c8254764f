#!/usr/bin/env bash
# `pip install .` through scikit-build-core, from a fresh clone of this checkout's HEAD (an empty
# .hotggml: the build itself fetches the pinned sdist through pip, as on a user's machine, never from
# the cache an earlier step filled): the wheel must carry the patched libraries in hotggml/lib, and
# the installed package, run from /, must load them, pass its stamp check and a smoke parity case.
source "$(dirname "$0")/env.sh"
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
raise SystemExit(0 if res.passed else 1)
PY
