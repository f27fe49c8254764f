#!/usr/bin/env bash
# The main job on the CPU: pinned ggml -> patch series -> CMake build -> parity -> memory table.
# Fails (non-zero) on a tampered pin, a patch that does not apply or misses a marker, a build
# error, or any parity failure. Full records go to .hotggml/reports/ (main-job.json: each step's
# exit status and seconds). `--prepare`: the steps up to the build only (ci/autocrlf.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
STEPS_REPORT=.hotggml/reports/main-job.json
source ci/steps.sh
mkdir -p .hotggml/reports
step fetch          hotggml fetch
step patches-check  hotggml patches check   # LF, names, applies onto a pristine pin, markers, canonical export
step patches-apply  hotggml patches apply
step cpu-build      hotggml build --backend cpu   # with GGML_RPC=ON: every GGML_OP_COUNT check compiles (ggml-rpc.h has one)
[ "${1-}" = --prepare ] && exit 0
step parity         hotggml parity --backend cpu --set smoke --set real --set types --threads 1,2 --json .hotggml/reports/parity-cpu.json
step memory         hotggml memory --backend cpu
step bench          hotggml bench --backend cpu --case dit-self-full-1250 --runs 5
step probe          hotggml probe --backend cpu
