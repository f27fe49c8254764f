#!/usr/bin/env bash
# Compiles (never runs) every CUDA source the patch series adds or changes, for sm_80, sm_90 and sm_90a (the
# wgmma path of the register kernels), and the training kernels of the series without its wgmma patch for sm_80
# and sm_90, so a kernel or dispatch that does not compile fails the gate on a machine without a GPU. cuBLAS headers
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
# compile_tree TREE "ARCHS" SOURCE...: every (arch, source) of TREE, one job per pair, as many at a time as
# there are cores (the register family's instances are the long ones)
compile_tree() {
    local root=$1 archs=$2 objs; shift 2
    objs=$(mktemp -d)
    for arch in $archs; do
        for src in "$@"; do
            echo "$arch $src"
        done
    done | xargs -P "$(nproc)" -L 1 sh -c 'echo "nvcc sm_$0 $1" && nvcc -c -std=c++17 -arch="sm_$0" -DNDEBUG -use_fast_math -extended-lambda \
        -I"'"$root"'/include" -I"'"$root"'/src" -I"'"$root"'/src/ggml-cuda" -I"'"$inc"'" "'"$root"'/$1" -o "'"$objs"'/$(basename "$1" .cu)-sm_$0.o"' \
        || return 1
    rm -rf "$objs"
}
# the .cu files under src/ggml-cuda that some patch of the series touches
mapfile -t sources < <(sed -n 's|^diff --git a/\(src/ggml-cuda/[^ ]*\.cu\) .*|\1|p' $(sed 's|^|patches/|' patches/series) | sort -u)
[ ${#sources[@]} -gt 0 ] || { echo "cuda-compile: no CUDA source in the series"; exit 1; }
compile_tree "$tree" "80 90 90a" "${sources[@]}" || exit 1
# the series without the sm_90a wgmma patch (the tree up to the commit before it, which carries the mma.sync
# kernels alone, as upstream would review them): its training kernels for sm_80 and sm_90
wgmma=$(git -C "$tree" log --format='%H %(trailers:key=Patch-Name,valueonly,separator=)' | awk '$2 == "flash-attn-train-cuda-wgmma" { print $1 }')
[ -n "$wgmma" ] || { echo "cuda-compile: the series has no flash-attn-train-cuda-wgmma patch"; exit 1; }
mma_tree=$(mktemp -d)
git -C "$tree" archive "$wgmma^" include src | tar -x -C "$mma_tree"
mapfile -t mma_sources < <(cd "$mma_tree" && ls src/ggml-cuda/fattn-train*.cu src/ggml-cuda/template-instances/fattn-train-instance-*.cu)
compile_tree "$mma_tree" "80 90" "${mma_sources[@]}" || exit 1
rm -rf "$mma_tree"
# the device tools that include the kernels (the wgmma probe, the kernel harness): they must follow the kernels' API
out=$(mktemp -d)
for tool in tools/wgmma_probe.cu tools/fa_train_harness.cu; do
    echo "nvcc sm_90a $tool"
    nvcc -c -std=c++17 -arch=sm_90a -I"$tree/include" -I"$tree/src" -I"$tree/src/ggml-cuda" -I"$inc" "$tool" \
        -o "$out/$(basename "$tool" .cu).o" || exit 1
done
rm -rf "$out"
echo "cuda-compile: ok: ${sources[*]} for sm_80, sm_90 and sm_90a; without the wgmma patch, ${mma_sources[*]} for sm_80 and"
echo "  sm_90; the device tools; in $((SECONDS - start)) s"
