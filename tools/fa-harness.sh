#!/usr/bin/env bash
# Kernel iteration on the GPU machine without a ggml build (seconds, not minutes):
#   bash tools/fa-harness.sh OUTDIR "[VAR=value ...] S Skv Nh Nkv D [mode]" ...
# materializes and patches the pin (as tools/gpu-run.sh), compiles tools/fa_train_harness.cu and the register
# family's instances of the patched tree, and runs it once per shape argument (its leading VAR=value words, e.g.
# DV=128 FA_SMEM_KB=99, are that run's environment: see the harness). Output to OUTDIR/harness.log and stdout.
# NCU='regex ...': instead of timing, profile the first launch of each kernel matching a regex with Nsight
# Compute (speed of light, occupancy, warp stall reasons; clocks left alone, as device/METHOD.md asks); the regexes
# match mangled names, which tell the instantiations apart (...Lb0ELb1EEv: the TF32 forward's Q8 kernel);
# NCU_COUNT=N: the first N launches of each (the backward kernel's first two are dQ alone, then dK/dV alone).
# INSTANCES='d64 d256': compile only those instances (the shapes must need no other; default: all).
set -uo pipefail
out=${1:?usage: bash tools/fa-harness.sh OUTDIR SHAPE...}; shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hotggml-site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/hotggml-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
sdist=$(ls .hotggml/cache/ggml_python-*.tar.gz 2>/dev/null | head -n 1)
{
    python3 -m hotggml fetch ${sdist:+--sdist "$sdist"} && python3 -m hotggml patches apply || exit 1
    w=.hotggml/work/ggml
    # ggml's CUDA flags (src/ggml-cuda/CMakeLists.txt: -use_fast_math -extended-lambda), so that the kernels are
    # the code the backend runs: without them expf is not ex2.approx, and harness times were off by that
    # VARIANTS='-DX=1;-DX=2': one harness per set of defines (compiled in parallel), each run on every shape,
    # the variants alternated twice (paired at equal shape, for defines the patched source reads)
    IFS=';' read -r -a variants <<< "${VARIANTS:-}"
    rm -rf /tmp/fa_harness*
    [ ${#variants[@]} -gt 0 ] || variants=("")
    flags="-std=c++17 -O3 -use_fast_math -extended-lambda -arch=sm_${CUDA_ARCH:-90a} -I$w/include -I$w/src -I$w/src/ggml-cuda"
    # one object per register-family instance (template-instances/) and per variant, compiled in parallel, then linked
    for i in "${!variants[@]}"; do
        mkdir -p /tmp/fa_harness_o$i
        for src in tools/fa_train_harness.cu $(for d in ${INSTANCES:-"*"}; do echo $w/src/ggml-cuda/template-instances/fattn-train-instance-$d.cu; done); do
            nvcc $flags ${variants[$i]} -c "$src" -o /tmp/fa_harness_o$i/$(basename "$src" .cu).o &
        done
    done
    wait
    for i in "${!variants[@]}"; do
        nvcc $flags /tmp/fa_harness_o$i/*.o -Xlinker --unresolved-symbols=ignore-all -o /tmp/fa_harness$i || exit 1
    done
    # a shape argument may begin with VAR=value words (DV=128 FA_SMEM_KB=99 ...): that run's environment
    run_shape() {
        local bin=$1 envs=(); shift
        while [[ ${1:-} == *=* ]]; do envs+=("$1"); shift; done
        env "${envs[@]}" "$bin" "$@"
    }
    for shape in "$@"; do
        if [ -z "${NCU:-}" ]; then
            for round in $([ ${#variants[@]} -gt 1 ] && echo 1 2 || echo 1); do
                for i in "${!variants[@]}"; do
                    [ ${#variants[@]} -gt 1 ] && echo "=== variant '${variants[$i]}' round $round"
                    run_shape /tmp/fa_harness$i $shape || exit 1
                done
            done
            continue
        fi
        for k in $NCU; do
            echo "=== ncu $k at $shape"
            ncu --clock-control none --kernel-name-base mangled -k "regex:$k" -c "${NCU_COUNT:-1}" --section SpeedOfLight --section Occupancy \
                --section WarpStateStats --section SchedulerStats --section LaunchStats \
                --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" env /tmp/fa_harness0 $shape \
                | sed -n '/==PROF==/,$p' | grep -v '^  *-\+ *-' || exit 1
        done
    done
} 2>&1 | tee "$out/harness.log"
