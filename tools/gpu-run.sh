#!/usr/bin/env bash
# The one-call GPU runner (run on the GPU machine, from the repository root):
#   bash tools/gpu-run.sh OUTDIR
# Materializes the pin from the sdist carried in .hotggml/cache (that machine has no network), applies
# the series, builds the CUDA backend for CUDA_ARCH (default 90a, an H200), then runs the mma lane-map
# probe, the wgmma operand-layout probe (sm_XXa), parity smoke + real (and the field cases of issue 18's head sizes) on CUDA0 at both precisions, parity smoke
# through the meta device over two instances of CUDA0 (split by heads, bitwise vs CUDA0), test-backend-ops for both ops on CUDA0 (test and
# grad modes), the long-context chunk on TF32 and f32 against the per-head float64 oracle, the CUDA tests (with
# the split graph: forward on CUDA0, backward pinned to the CPU), the field table (TF32 and f32 fused vs
# the exact chain at every SPEC §7 geometry, TFLOP/s against the measured TF32 ceiling, arenas, the TF32 path
# under the 99 and 163 KiB shared-memory caps, a per-node profile), probe at every field geometry, the
# named refusal of D = 512, parity under both caps, and a build for 80-virtual (PTX) with parity under the
# 99 KiB cap: the consumer card's code path; with tools/vulkan-kit.sh's packages carried, a Vulkan build and its
# parity, tests and bench on the NVIDIA Vulkan driver. Wheels in .whl (cffi, pycparser, gitpython, gitdb, smmap) are installed first when
# present. Everything goes to OUTDIR/run.log (plus the parity JSON records); a summary table is printed
# last. Exit status: 0 when every step gave what it must. ONLY='build|chunk-tf32' (a regex on step names)
# runs a subset: a second call on a machine still warm reuses the build (a call runs 10 minutes at most).
set -uo pipefail
out=${1:?usage: bash tools/gpu-run.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hotggml-site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/hotggml-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
log="$out/run.log"
summary=()
failed=0

# step NAME EXPECT CMD...: run CMD, log it, record ok/FAIL (EXPECT: pass, or fail:REGEX for a named refusal)
step() {
    local name=$1 expect=$2; shift 2
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ ^($ONLY)$ ]]; then return 0; fi
    local t0=$SECONDS rc
    echo "=== $name: $*" >> "$log"
    "$@" > "$out/step.log" 2>&1; rc=$?
    cat "$out/step.log" >> "$log"
    local verdict=FAIL
    if [ "$expect" = pass ] && [ $rc -eq 0 ]; then verdict=ok
    elif [ "${expect#fail:}" != "$expect" ] && [ $rc -ne 0 ] && grep -Eq "${expect#fail:}" "$out/step.log"; then verdict="ok (refused by name)"
    fi
    [ "$verdict" = FAIL ] && failed=1
    summary+=("$(printf '%-28s %-22s rc=%-3s %4ss' "$name" "$verdict" "$rc" "$((SECONDS - t0))")")
    tail -n 40 "$out/step.log"
}

hg() { python3 -m hotggml "$@"; }
sdist=$(ls .hotggml/cache/ggml_python-*.tar.gz 2>/dev/null | head -n 1)
# 90a: the H200's architecture-specific features (wgmma: the register kernels' A B^T products; plain 90 builds
# run them on mma.sync)
arch=${CUDA_ARCH:-90a}

step device pass nvidia-smi -L
step mma-probe pass bash -c "nvcc -arch=sm_$arch -o /tmp/mma_probe tools/mma_probe.cu && /tmp/mma_probe"
step fetch pass hg fetch ${sdist:+--sdist "$sdist"}
step apply pass hg patches apply
w=.hotggml/work/ggml
[[ $arch == *a ]] && step wgmma-probe pass bash -c "nvcc -std=c++17 -arch=sm_$arch -I$w/include -I$w/src -I$w/src/ggml-cuda tools/wgmma_probe.cu -Xlinker --unresolved-symbols=ignore-all -o /tmp/wgmma_probe && /tmp/wgmma_probe"
step build pass hg build --backend cuda --cuda-arch "$arch" --jobs "$(nproc)" --tests
step parity-f32 pass hg parity --backend cuda --set smoke --set real --set types --prec f32 --json "$out/parity-f32.json"
step parity-tf32 pass hg parity --backend cuda --set smoke --set real --set types --prec default --json "$out/parity-tf32.json"
step tf32-above-f32 pass python3 tools/compare_precisions.py "$out/parity-f32.json" "$out/parity-tf32.json"
# the field geometries of issue 18's head sizes (72, 80, 96, 112, 160, 192 / 128) and the batch-4 padding case, against
# the float64 oracle and the exact chain at both precisions (the SPEC section 7 D = 128 rows are in `real` or timed only)
for prec in f32 default; do
    step parity-field-$prec pass hg parity --backend cuda --set field -p '^(?!chunk-|dit-self-|dit-cross-|lm-causal-|lm4b-)' \
        --prec $prec --json "$out/parity-field-$prec.json"
done
# ggml's meta device over two instances of CUDA0 (issue 23): the fused arm split by heads, bitwise equal to CUDA0
for prec in f32 default; do
    step parity-meta-$prec pass hg parity --backend "Meta(CUDA0,CUDA0)" --set smoke --prec $prec --json "$out/parity-meta-$prec.json"
done
# through ggml RPC: a CUDA0 server in a child process on 127.0.0.1, its record of the fused nodes checked (issue 23)
for prec in f32 default; do
    step parity-rpc-$prec pass hg parity --backend rpc:CUDA0 --set smoke --prec $prec --json "$out/parity-rpc-$prec.json"
done
step backend-ops pass hg floor --backend cuda --cuda-arch "$arch" --no-stock --no-ctest --op FLASH_ATTN_TRAIN --op FLASH_ATTN_TRAIN_BACK
step chunk-tf32 pass hg parity --backend cuda --set field -p '^chunk-27b-2048' --prec default --no-chain --json "$out/parity-chunk.json"
step chunk-f32 pass hg parity --backend cuda --set field -p '^chunk-27b-2048' --prec f32 --no-chain --json "$out/parity-chunk-f32.json"
step cuda-tests pass python3 -m pytest tests/test_cuda.py tests/test_training_floor.py -v -m cuda -rs -p no:cacheprovider
step nan-inputs pass python3 -m pytest tests/test_nan_inputs.py -v -m cuda -rs -p no:cacheprovider
step bench-field pass hg bench --backend cuda --set field -p '^(?!chunk-)' --runs 5 --smem-caps 99,163 --profile --json "$out/bench-field.json"
step bench-chunk pass hg bench --backend cuda --set field -p '^chunk-27b-2048' --runs 3 --json "$out/bench-chunk.json"
# the chunk against a frozen cache, dQ alone: K/V as q8_0 beside their f32 twin, paired (issue 20)
step chunk-q8_0 pass hg parity --backend cuda --set field -p '^chunk-27b-q8_0' --prec default --no-chain --json "$out/parity-chunk-q8_0.json"
step bench-chunk-kv pass hg bench --backend cuda --set field -p '^chunk-27b-(q8_0|frozen)' --no-chain --no-f32 --runs 5 --json "$out/bench-chunk-kv.json"
step probe-field pass hg probe --backend cuda --set field
# the smaller shared-memory classes' configurations on this card (GGML_CUDA_FA_TRAIN_SMEM_KB caps the budget per
# block; parity prints the kernel, e.g. tf32-reg-d128-smem99): the code paths of A100-class and consumer cards
for kib in 99 163; do
    for prec in f32 default; do
        step parity-$prec-smem$kib pass env GGML_CUDA_FA_TRAIN_SMEM_KB=$kib python3 -m hotggml parity --backend cuda \
            --set smoke --set real --set types --prec $prec --json "$out/parity-$prec-smem$kib.json"
    done
done
step probe-d512 fail:"supports_op is false for FLASH_ATTN_TRAIN at d512-refused" hg probe --backend cuda --set limits
step parity-d512 fail:"supports_op is false for FLASH_ATTN_TRAIN at d512-refused" hg parity --backend cuda --set limits
# the training ops on the NVIDIA driver's Vulkan ICD (issue 22), where tools/vulkan-kit.sh's packages were carried
# (.gl, .vkdev): a Vulkan build with ggml's tests, parity smoke + real against the oracle and the exact chain on Vulkan0
# (each fused arm twice, bitwise), test-backend-ops on Vulkan0, the Vulkan tests, the bench against the Vulkan chain
if [ -d .gl ] && [ -d .vkdev ]; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    mkdir -p /tmp/vkroot; for f in .vkdev/*.deb; do dpkg -x "$f" /tmp/vkroot; done
    vk=/tmp/vkroot/usr
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; [ -f $icd ] && export VK_DRIVER_FILES=$icd
    step build-vulkan pass env PATH="$vk/bin:$PATH" LD_LIBRARY_PATH="$vk/lib/x86_64-linux-gnu" python3 -m hotggml build \
        --backend vulkan --jobs "$(nproc)" --tests -D Vulkan_INCLUDE_DIR=$vk/include -D Vulkan_LIBRARY=$vk/lib/x86_64-linux-gnu/libvulkan.so.1 \
        -D Vulkan_GLSLC_EXECUTABLE=$vk/bin/glslc
    vklib=$(ls -d "$PWD"/.hotggml/build/vulkan-*/lib 2>/dev/null | head -n 1)
    step parity-vulkan pass env HOTGGML_LIB_DIR="$vklib" python3 -m hotggml parity -b vulkan --set smoke --set real \
        --json "$out/parity-vulkan.json"
    for m in "test OUT_PROD" "test FLASH_ATTN_TRAIN" "test FLASH_ATTN_TRAIN_BACK" "grad FLASH_ATTN_TRAIN"; do
        set -- $m
        step "backend-ops-vulkan-$1-$2" pass "$vklib/test-backend-ops" $1 -o $2 -b Vulkan0
    done
    step vulkan-tests pass env HOTGGML_LIB_DIR="$vklib" python3 -m pytest tests/test_vulkan.py -v -m vulkan -rs -p no:cacheprovider
    step bench-vulkan pass env HOTGGML_LIB_DIR="$vklib" python3 -m hotggml bench -b vulkan --set field -p '^dit-' --runs 5 \
        --no-f32
fi
# a consumer card's code path: PTX for 80-virtual (JIT-compiled here; mma.sync, since wgmma is chosen at compile
# time) under the 99 KB cap. Last: the newest CUDA build is the one the steps after it load
step build-80v pass hg build --backend cuda --cuda-arch 80-virtual --jobs "$(nproc)"
for prec in f32 default; do
    step parity-$prec-80v-smem99 pass env GGML_CUDA_FA_TRAIN_SMEM_KB=99 python3 -m hotggml parity --backend cuda \
        --set smoke --set real --prec $prec --json "$out/parity-$prec-80v-smem99.json"
done
rm -f "$out/step.log"

printf '%s\n' "" "step                         verdict                rc   time" "${summary[@]}" | tee -a "$log"
exit $failed
