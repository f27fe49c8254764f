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
# Two of ggml's CPU variants, the x86-64 baseline and AVX2 (GGML_CPU_VARIANTS, patch cpu-variants-subset), where a
# user's `pip install .` builds about a dozen: what this step checks is the loading (the registry picks the best
# variant the CPU runs, here and under qemu below), and the dozen compiles were most of its time. The main job's
# build compiles the same sources for this machine's own extensions. WHEEL_CPU_VARIANTS= (empty) builds them all.
variants=${WHEEL_CPU_VARIANTS-x64;haswell}
settings=()
[ -n "$variants" ] && [ "$(uname -m)" = x86_64 ] && settings=(-C "cmake.define.GGML_CPU_VARIANTS=$variants")
python -m pip wheel "$out/src" --no-deps --quiet --disable-pip-version-check "${settings[@]}" -w "$out/dist"
python -m venv "$out/venv"
"$out/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$out"/dist/hotggml-*.whl
cd / && env -u PYTHONPATH "$out/venv/bin/python" - <<'PY'
import hotggml, hotggml.ffi as ffi
from hotggml import cases, parity
lib_dir = ffi.find_lib_dir()
assert lib_dir == ffi._package_lib_dir(), f"installed package loaded {lib_dir}, not its own lib/"
res = parity.run_case(cases.SMOKE[5], "CPU", threads=[1, 2])   # 2 threads: the CPU backend's own call, by proc address
info = ffi.library_info()
print(f"wheel: {hotggml.__file__}: libraries {lib_dir}, stamp {info['series_hash'][:12]}, "
      f"{res.case} {'PASS' if res.passed else 'FAIL ' + '; '.join(res.failures)}")
if not res.passed:
    raise SystemExit(1)
# portable (HOTGGML_PORTABLE): the CPU backend in ggml's per-CPU variants, one of them loaded by the registry
import json
record = json.loads((lib_dir / "hotggml-build.json").read_text())
variants = sorted(p.name for p in lib_dir.glob("libggml-cpu-*.so"))
assert record["backend_dl"] and not record["native"] and len(variants) > 1, (record, variants)
assert info["cpu_backend"] in variants, info
from hotggml import rpc                                         # RPC's own call, by proc address
from hotggml.errors import BackendError
try:
    rpc.add_server("127.0.0.1:1")
    raise SystemExit("an RPC server answered on port 1")
except BackendError as e:
    assert "no RPC server answered" in str(e), e
print(f"wheel: portable: {len(variants)} CPU variants, this CPU loads {info['cpu_backend']}; RPC reachable")

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

# the README's Python example in that venv, which holds the wheel and what it declares (cffi, NumPy) only: it
# runs from / and imports nothing of the tooling (GitPython, the build, the patch modules)
python - "$out/venv" "$out/src/README.md" <<'PY'
import pathlib, re, subprocess, sys
venv = pathlib.Path(sys.argv[1])
have = subprocess.run([str(venv / "bin/python"), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                      capture_output=True, text=True, check=True).stdout.lower().split()
names = sorted(n for n in (line.split("==")[0] for line in have) if n not in ("pip", "setuptools", "wheel"))  # venv's own
assert names == ["cffi", "hotggml", "numpy", "pycparser"], names
example = re.findall(r"```python\n(.*?)```", pathlib.Path(sys.argv[2]).read_text(), re.S)[0]
probe = example + "\nimport sys\nprint('tooling imported:', sorted(m for m in sys.modules if m in ('git', 'hotggml.build', 'hotggml.patches', 'hotggml.gitutil')))\n"
run = subprocess.run([str(venv / "bin/python"), "-c", probe], capture_output=True, text=True, cwd="/",
                     env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
assert run.returncode == 0 and "O and dQ match float64 NumPy" in run.stdout, run.stdout + run.stderr[-2000:]
assert "tooling imported: []" in run.stdout, run.stdout
print(f"wheel: the README example runs in a venv of {', '.join(names)}, importing none of the tooling")
PY

# the same wheel on an x86-64 CPU without this machine's extensions: the whole interpreter under qemu-user
# emulating a Sandy Bridge (AVX; no AVX2, FMA, F16C or AVX-512), where ggml's registry must pick a variant it can
# run (NumPy's wheel needs at least that CPU; its OpenBLAS is told the core qemu emulates, which its own CPU
# detection misreads under qemu)
if command -v qemu-x86_64 > /dev/null && [ "$(uname -m)" = x86_64 ]; then
    cd / && env -u PYTHONPATH OPENBLAS_CORETYPE=Sandybridge qemu-x86_64 -cpu SandyBridge "$out/venv/bin/python" - <<'PY' 2>&1 | grep -v "TCG doesn't support"
from hotggml import cases, ffi, parity
results = [parity.run_case(case, "CPU", threads=[1, 2]) for case in cases.SMOKE]
failed = [r.case for r in results if not r.passed]
variant = ffi.library_info()["cpu_backend"]
print(f"wheel: under qemu-x86_64 -cpu SandyBridge: {variant}, parity smoke {len(results) - len(failed)}/{len(results)} pass")
raise SystemExit(0 if not failed and variant in ("libggml-cpu-sandybridge.so", "libggml-cpu-sse42.so", "libggml-cpu-x64.so") else 1)
PY
else
    echo "wheel: SKIPPED the other-CPU run: no qemu-x86_64 on PATH (the apt package qemu-user)"
fi

# an editable install (`pip install -e .`) of the same clone loads the libraries it installed, from / too
python -m venv "$out/venv-e"
"$out/venv-e/bin/python" -m pip install --quiet --disable-pip-version-check "${settings[@]}" -e "$out/src"
cd / && env -u PYTHONPATH "$out/venv-e/bin/python" - <<'PY'
import hotggml.ffi as ffi
from hotggml import cases, parity
lib_dir = ffi.find_lib_dir()
assert lib_dir == ffi._package_lib_dir() and (lib_dir / "libggml.so").exists(), lib_dir
res = parity.run_case(cases.SMOKE[0], "CPU")
print(f"editable: modules {ffi.__file__}, libraries {lib_dir}: {res.case} {'PASS' if res.passed else 'FAIL'}")
raise SystemExit(0 if res.passed else 1)
PY
