#!/usr/bin/env bash
# The main job on the CPU: pinned ggml -> patch series -> CMake build -> parity -> memory table.
# Fails (non-zero) on a tampered pin, a patch that does not apply or misses a marker, a build
# error, or any parity failure. Full records go to .hotggml/reports/.
source "$(dirname "$0")/env.sh"
mkdir -p .hotggml/reports
hotggml fetch
hotggml patches check
hotggml patches apply
hotggml build --backend cpu
hotggml build --backend cpu --define GGML_RPC=ON   # every GGML_OP_COUNT check agrees (ggml-rpc.h has one)
hotggml parity --backend cpu --set smoke --set real --threads 1,2 --json .hotggml/reports/parity-cpu.json
hotggml memory --backend cpu
hotggml bench --backend cpu --case dit-self-full-1250 --runs 5
hotggml probe --backend cpu
