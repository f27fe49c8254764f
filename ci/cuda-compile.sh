#!/usr/bin/env bash
# Compiles (never runs) every CUDA source the patch series adds or changes, for sm_80, sm_90 and sm_90a (the
# wgmma path of the register kernels), the training kernels of the series without its wgmma patch for sm_80
# and sm_90, and the device tools, so a kernel or dispatch that does not compile fails the gate on a machine
# without a GPU (sm_90a with the release build's optimization, sm_80 and sm_90 at -O0, as PTX but for two sources: see jobs()), and a TF32
# register kernel that spills more than its recorded baseline fails it too (ci/ptxas_spills.py). cuBLAS headers
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
# The compile jobs, one line each: TREE OPT ARCHS SOURCE (ARCHS comma-separated: one nvcc per source and
# optimization level, every arch a -gencode of it, so the host side is compiled once). OPT "full" is the
# release build's device code generation; "O0" turns NVVM's and ptxas' optimizers off: the front end,
# every template instantiation and static_assert, and the PTX assembly are the same, in a third of the time.
# sm_90a (the wgmma path, whose products ptxas schedules) is compiled as the release build does; sm_80 and sm_90
# (the mma.sync path, in both trees) at -O0. An arch written "80v" or "90v" is compiled to PTX only (compute_80,
# compute_90: what a `*-virtual` build ships, its front end and NVVM at that arch, every template instance and
# static_assert): ptxas at -O0 on unoptimized PTX is most of an O0 job's time (34 s of 41 for the d160 instance at
# sm_80), and what only it checks (the inline PTX the kernels write: mma.sync, ldmatrix, cp.async, the same strings
# at every head size) it checks in the sm_90a release compile and, for sm_80, in the mma.sync tree's dispatch source
# and its d64 instance.
jobs() {
    local src archs
    for src in "${sources[@]}"; do echo "$tree full 90a $src"; done   # the long ones first: no idle core at the end
    for src in "${sources[@]}"; do echo "$tree O0 80v,90v $src"; done
    for src in "${mma_sources[@]}"; do
        case $src in */fattn-train.cu|*/fattn-train-instance-d64.cu) archs=80,90v ;; *) archs=80v,90v ;; esac
        echo "$mma_tree O0 $archs $src"
    done
    # the device tools that include the kernels (the wgmma probe, the kernel harness) follow their API
    for src in tools/wgmma_probe.cu tools/fa_train_harness.cu; do echo "$tree O0 90a $PWD/$src"; done
}
# compile ROOT OPT ARCHS SOURCE: one job (run by xargs, as many at a time as there are cores). The release compile
# writes ptxas' resource report (-v) of all but the X3 kernels (ci/ptx_without_x3.py) to $ptxas_logs, for the gate
compile() {
    local root=$1 opt=$2 archs=$3 src=$4 gencode=() arch flags=() file log=/dev/null
    [[ $src = /* ]] && file=$src || file=$root/$src
    for arch in ${archs//,/ }; do
        if [[ $arch = *v ]]; then gencode+=(-gencode "arch=compute_${arch%v},code=compute_${arch%v}")
        else gencode+=(-gencode "arch=compute_$arch,code=sm_$arch"); fi
    done
    [ "$opt" = O0 ] && flags=(-Xcicc -O0 -Xptxas -O0)
    [ "$opt" = full ] && log=$ptxas_logs/$(basename "$src").log
    local t0=$SECONDS rc ptx
    local common=(-std=c++17 -DNDEBUG -use_fast_math -extended-lambda -I"$root/include" -I"$root/src" -I"$root/src/ggml-cuda" -I"$inc")
    if [ "$opt" = full ]; then   # one arch: its PTX at the release optimization, ptxas -v on all but the X3 kernels
        ptx=$(mktemp --suffix=.ptx)
        nvcc -ptx -arch="sm_$archs" "${common[@]}" "$file" -o "$ptx" 2> "$log" && python ci/ptx_without_x3.py "$ptx" &&
            ptxas -arch="sm_$archs" -v "$ptx" -o /dev/null 2>> "$log"
        rc=$?
        rm -f "$ptx"
    else
        nvcc -c "${gencode[@]}" "${flags[@]}" "${common[@]}" "$file" -o /dev/null 2> "$log"
        rc=$?
    fi
    echo "nvcc $opt sm_${archs//,/ sm_} ${src#$PWD/}: $((SECONDS - t0)) s"   # after: the seconds say which jobs the step's time goes to
    [ "$log" = /dev/null ] || grep -vE "^ptxas info|^ +[0-9]+ bytes stack frame" "$log" >&2 # warnings and errors as before; the report stays in the log
    return $rc
}
export -f compile
ptxas_logs=.hotggml/reports/ptxas
rm -rf "$ptxas_logs" && mkdir -p "$ptxas_logs"
export inc ptxas_logs
# the .cu files under src/ggml-cuda that some patch of the series touches
mapfile -t sources < <(sed -n 's|^diff --git a/\(src/ggml-cuda/[^ ]*\.cu\) .*|\1|p' $(sed 's|^|patches/|' patches/series) | sort -u)
[ ${#sources[@]} -gt 0 ] || { echo "cuda-compile: no CUDA source in the series"; exit 1; }
# the series without the sm_90a wgmma patch (the tree up to the commit before it, which carries the mma.sync
# kernels alone, as upstream would review them): its training kernels
wgmma=$(git -C "$tree" log --format='%H %(trailers:key=Patch-Name,valueonly,separator=)' | awk '$2 == "flash-attn-train-cuda-wgmma" { print $1 }')
[ -n "$wgmma" ] || { echo "cuda-compile: the series has no flash-attn-train-cuda-wgmma patch"; exit 1; }
mma_tree=$(mktemp -d)
trap 'rm -rf "$mma_tree"' EXIT
git -C "$tree" archive "$wgmma^" include src | tar -x -C "$mma_tree"
mapfile -t mma_sources < <(cd "$mma_tree" && ls src/ggml-cuda/fattn-train*.cu src/ggml-cuda/template-instances/fattn-train-instance-*.cu)
jobs | xargs -P "$(nproc)" -L 1 bash -c 'compile "$@"' compile || exit 1
# the spill gate: no TF32 register kernel spills more than ci/ptxas-spills.json records (ci/ptxas_spills.py says why)
python ci/ptxas_spills.py "$ptxas_logs"/*.log || exit 1
echo "cuda-compile: ok: ${sources[*]} for sm_90a (and sm_80, sm_90 PTX at -O0); without the wgmma patch,"
echo "  ${mma_sources[*]} for sm_80 and sm_90 (PTX; sm_80 SASS for the dispatch and d64) at -O0; the device tools;"
echo "  in $((SECONDS - start)) s"
