#!/usr/bin/env bash
# The lavapipe lane: the training ops' Vulkan shaders run (not only compile) on Mesa's CPU Vulkan driver. A Vulkan
# build of the series with ggml's tests (`hotggml build --backend vulkan --tests`, keyed like every build), then on
# Vulkan0, which ggml shows for a CPU-type device only when GGML_VK_VISIBLE_DEVICES names it: test-backend-ops for
# both ops against the CPU in eval and grad mode, parity smoke (the fused arm against float64 at the f32 bar, each
# case run twice bit for bit) and the Vulkan tests (tests/test_vulkan.py).
#
# lavapipe compiles each pipeline (one per op kernel and (D, Dv)) in seconds to a minute, so what the lane costs is
# how many head sizes it touches: by default (a step of .ci/run) test-backend-ops runs its cases at the head sizes
# of the smoke set, and the Vulkan tests leave out the two at D = 256 and 200 (the GPU runner runs all of it on the
# NVIDIA driver, `tools/gpu-run.sh`); `--all` runs every case. The jobs run one at a time so that each pipeline is
# compiled once into Mesa's shader cache, kept in .hotggml/cache/mesa (a fresh checkout starts cold).
#
# The OS packages come by name through apt-get where they are missing (glslc, libvulkan-dev, spirv-headers: the
# build; mesa-vulkan-drivers: lavapipe); without them, and without root's apt-get or a package index it reaches,
# it says so and exits 0. Logs go to .hotggml/reports/vulkan/; each job prints its seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
all=0
case ${1-} in --all) all=1 ;; "") ;; *) echo "usage: bash ci/vulkan.sh [--all]" >&2; exit 2 ;; esac
start=$SECONDS
packages=(glslc libvulkan-dev spirv-headers mesa-vulkan-drivers)
have_lavapipe() { ls /usr/share/vulkan/icd.d/lvp_icd*.json > /dev/null 2>&1; }
if ! command -v glslc > /dev/null || ! have_lavapipe; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
        echo "vulkan: SKIPPED: glslc or lavapipe missing, and no root apt-get to install ${packages[*]}"
        exit 0
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${packages[@]}" > /dev/null; }; then
        echo "vulkan: SKIPPED: apt-get could not install ${packages[*]} (no package index reachable?)"
        exit 0
    fi
    echo "vulkan: installed ${packages[*]} in $((SECONDS - start)) s"
fi
python -m hotggml build --backend vulkan --tests
lib=$(python -c 'import json; print(json.load(open(".hotggml/build/current-vulkan.json"))["lib_dir"])')
logs=.hotggml/reports/vulkan
rm -rf "$logs" && mkdir -p "$logs" .hotggml/cache/mesa
echo "vulkan: built $lib in $((SECONDS - start)) s"
export GGML_VK_VISIBLE_DEVICES=0 HOTGGML_LIB_DIR=$lib MESA_SHADER_CACHE_DIR=$PWD/.hotggml/cache/mesa
# job NAME CMD...: one lavapipe job, its output in $logs/NAME.log, its last line and seconds printed
job() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" > "$logs/$name.log" 2>&1 || rc=$?
    echo "vulkan: $name: rc $rc, $((SECONDS - t0)) s: $(tail -n 1 "$logs/$name.log" | sed 's/\x1b\[[0-9;]*m//g')"
    [ "$rc" -eq 0 ] || { echo "vulkan: FAILED (logs in $logs)"; exit "$rc"; }
}
params=() grad_params=() tests_k='not test_vulkan_parity_smoke'
if [ "$all" = 0 ]; then
    # test-backend-ops' parameter filter: its cases whose D is a head size of the smoke set; in grad mode, of those
    # the ones over a stored bias mask (with its -INF entries: the masked path the none and causal variants take
    # too, which run in eval mode here): lavapipe takes ~20 s a grad case for its finite differences
    d_filter=$(python -c 'from hotggml import cases; print("^d=(%s)," % "|".join(sorted({str(c.D) for c in cases.SMOKE}, key=int)))')
    params=(-p "$d_filter") grad_params=(-p "$d_filter.*mask=bias,")
    tests_k+=' and not vk-d256 and not vk-d200v72'
fi
ops=$lib/test-backend-ops
job backend-ops-test      "$ops" test -o FLASH_ATTN_TRAIN -b Vulkan0 "${params[@]}"
job backend-ops-test-back "$ops" test -o FLASH_ATTN_TRAIN_BACK -b Vulkan0 "${params[@]}"
job backend-ops-grad      "$ops" grad -o FLASH_ATTN_TRAIN -b Vulkan0 "${grad_params[@]}"
job backend-ops-grad-back "$ops" grad -o FLASH_ATTN_TRAIN_BACK -b Vulkan0 "${grad_params[@]}"
job parity-smoke python -m hotggml parity -b vulkan --set smoke --no-chain --json "$logs/parity-smoke.json"
job vulkan-tests python -m pytest tests/test_vulkan.py -q -m vulkan -rs -p no:cacheprovider -k "$tests_k"
scope="test-backend-ops at the smoke set's head sizes (grad mode: the bias-mask cases)"
[ "$all" = 1 ] && scope="every test-backend-ops case"
echo "vulkan: ok: $scope (both ops, eval and grad), parity smoke, tests/test_vulkan.py on lavapipe in $((SECONDS - start)) s"
