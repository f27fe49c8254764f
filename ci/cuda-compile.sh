#!/usr/bin/env bash
# Compiles (never runs) every CUDA source the patch series adds or changes, for sm_80, sm_90 and sm_90a (the
# wgmma path of the register kernels), so a
# kernel or dispatch that does not compile fails the gate on a machine without a GPU. cuBLAS headers
# (ggml-cuda's common.cuh includes them) come from the nvidia-cublas wheel, fetched by name through pip
# into .hotggml/cache once. Prints the seconds it took. Without nvcc on PATH it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
if ! command -v nvcc > /dev/null; then
    echo "cuda-compile: SKIPPED: no nvcc on PATH (the CUDA sources were not compiled)"
    exit 0
fi
start=$SECONDS
tree=$(hotggml prepare --json | python -c 'import json, sys; print(json.load(sys.stdin)["source_dir"])')
inc=.hotggml/cache/cublas-include
if [ ! -f "$inc/cublas_v2.h" ]; then
    tmp=$(mktemp -d)
    python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        "nvidia-cublas>=13,<14" -d "$tmp"
    python - "$tmp" "$inc" <<'PY'
import pathlib, shutil, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("nvidia_cublas-*.whl"))
out = pathlib.Path(sys.argv[2]); tmp = out.with_name(out.name + ".part")
shutil.rmtree(tmp, ignore_errors=True); tmp.mkdir(parents=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if "/include/" in name and not name.endswith("/"):
            (tmp / pathlib.Path(name).name).write_bytes(z.read(name))
shutil.rmtree(out, ignore_errors=True); tmp.rename(out)   # never a half-extracted folder
PY
    rm -rf "$tmp"
fi
# the .cu files under src/ggml-cuda that some patch of the series touches
mapfile -t sources < <(sed -n 's|^diff --git a/\(src/ggml-cuda/[^ ]*\.cu\) .*|\1|p' $(sed 's|^|patches/|' patches/series) | sort -u)
[ ${#sources[@]} -gt 0 ] || { echo "cuda-compile: no CUDA source in the series"; exit 1; }
out=$(mktemp -d)
# one job per (arch, source), two at a time (the register family's instances are the long ones)
for arch in 80 90 90a; do
    for src in "${sources[@]}"; do
        echo "$arch $src"
    done
done | xargs -P "$(nproc)" -L 1 sh -c 'echo "nvcc sm_$0 $1" && nvcc -c -std=c++17 -arch="sm_$0" -DNDEBUG -use_fast_math -extended-lambda \
    -I"'"$tree"'/include" -I"'"$tree"'/src" -I"'"$tree"'/src/ggml-cuda" -I"'"$inc"'" "'"$tree"'/$1" -o "'"$out"'/$(basename "$1" .cu)-sm_$0.o"' \
    || exit 1
# the device tools that include the kernels (the wgmma probe, the kernel harness): they must follow the kernels' API
for tool in tools/wgmma_probe.cu tools/fa_train_harness.cu; do
    echo "nvcc sm_90a $tool"
    nvcc -c -std=c++17 -arch=sm_90a -I"$tree/include" -I"$tree/src" -I"$tree/src/ggml-cuda" -I"$inc" "$tool" \
        -o "$out/$(basename "$tool" .cu).o" || exit 1
done
rm -rf "$out"
echo "cuda-compile: ok: ${sources[*]} for sm_80, sm_90 and sm_90a, and the device tools, in $((SECONDS - start)) s"
