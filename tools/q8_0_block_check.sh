#!/usr/bin/env bash
# q8_0_block_check.sh [TREE]: extracts fa_q8_0_block from TREE's fattn-train-mma.cuh (default: the work tree) and runs
# q8_0_block_check.cpp against it (g++, no GPU)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=${1:-$here/../.hotggml/work/ggml}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
awk '/void fa_q8_0_block\(/ { p = 1 } p { print } p && /^}$/ { exit }' "$tree/src/ggml-cuda/fattn-train-mma.cuh" > "$tmp/blk.inc"
[ -s "$tmp/blk.inc" ] || { echo "fa_q8_0_block not found in $tree"; exit 1; }
g++ -O2 -std=c++17 -I"$tmp" "$here/q8_0_block_check.cpp" -o "$tmp/check" && "$tmp/check"
