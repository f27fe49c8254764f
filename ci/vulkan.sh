#!/usr/bin/env bash
# The lavapipe lane: the training ops' Vulkan shaders run (not only compile) on Mesa's CPU Vulkan driver. A Vulkan
# build of the series with ggml's tests (`hotggml build --backend vulkan --tests`, keyed like every build), then on
# Vulkan0, which ggml shows for a CPU-type device only when GGML_VK_VISIBLE_DEVICES names it: parity smoke (the fused
# arm against float64 at the f32 bar, each case run twice bit for bit), the Vulkan tests (tests/test_vulkan.py) and
# test-backend-ops for both ops in eval and grad mode against the CPU. The OS packages come by name through apt-get
# where they are missing (glslc, libvulkan-dev, spirv-headers: the build; mesa-vulkan-drivers: lavapipe); without
# them and without root's apt-get it says so and exits 0. Not a step of .ci/run: on 2 cores it takes ~13 minutes
# (the build ~4, lavapipe ~9; ~24 CPU-minutes), which the 25 minutes of a CI run do not leave beside its other steps.
# Logs go to .hotggml/reports/vulkan/; each job prints its seconds; two lavapipe jobs run at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
start=$SECONDS
packages=(glslc libvulkan-dev spirv-headers mesa-vulkan-drivers)
have_lavapipe() { ls /usr/share/vulkan/icd.d/lvp_icd*.json > /dev/null 2>&1; }
if ! command -v glslc > /dev/null || ! have_lavapipe; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
        echo "vulkan: SKIPPED: glslc or lavapipe missing, and no root apt-get to install ${packages[*]}"
        exit 0
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" > /dev/null
fi
python -m hotggml build --backend vulkan --tests
lib=$(python -c 'import json; print(json.load(open(".hotggml/build/current-vulkan.json"))["lib_dir"])')
logs=.hotggml/reports/vulkan
rm -rf "$logs" && mkdir -p "$logs"
echo "vulkan: built $lib in $((SECONDS - start)) s"
export GGML_VK_VISIBLE_DEVICES=0 HOTGGML_LIB_DIR=$lib logs
# job NAME CMD...: one lavapipe job (run by xargs), its output in $logs/NAME.log, its last line and seconds printed
job() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" > "$logs/$name.log" 2>&1 || rc=$?
    echo "vulkan: $name: rc $rc, $((SECONDS - t0)) s: $(tail -n 1 "$logs/$name.log" | sed 's/\x1b\[[0-9;]*m//g')"
    return $rc
}
export -f job
# the longest first (the backward's eval cases: most of the head sizes, compiled cold), the rest beside it
{
    echo "backend-ops-test-back $lib/test-backend-ops test -o FLASH_ATTN_TRAIN_BACK -b Vulkan0"
    echo "parity-smoke python -m hotggml parity -b vulkan --set smoke --no-chain --json $logs/parity-smoke.json"
    echo "backend-ops-grad $lib/test-backend-ops grad -o FLASH_ATTN_TRAIN -b Vulkan0"
    echo "vulkan-tests python -m pytest tests/test_vulkan.py -q -m vulkan -rs -p no:cacheprovider -k 'not test_vulkan_parity_smoke'"
    echo "backend-ops-test $lib/test-backend-ops test -o FLASH_ATTN_TRAIN -b Vulkan0"
    echo "backend-ops-grad-back $lib/test-backend-ops grad -o FLASH_ATTN_TRAIN_BACK -b Vulkan0"
} | xargs -P 2 -L 1 bash -c 'job "$@"' job || { echo "vulkan: FAILED (logs in $logs)"; exit 1; }
echo "vulkan: ok: parity smoke, tests/test_vulkan.py and test-backend-ops (both ops, eval and grad) on lavapipe in $((SECONDS - start)) s"
