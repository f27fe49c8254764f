#!/usr/bin/env bash
# The main job in a clone made with core.autocrlf=true (the line endings a Windows checkout gets by default):
# .gitattributes must keep every patch byte-exact and every script LF, so the clone's own main job passes.
# Uses the pinned sdist this checkout cached (no second download), its own state folder (the clone fetches,
# checks and applies its own patches), and this checkout's builds: keyed by pin, code and options, the clone's
# build is this checkout's one exactly when its patches came out byte-identical, else it builds its own. The
# clone's main job stops after its build when that build is this checkout's (the same library: its parity, memory,
# bench and probe are the ones this checkout's main job ran), and runs whole when it is not.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
clone=$(mktemp -d "${TMPDIR:-/tmp}/hotggml-autocrlf.XXXXXX")
trap 'rm -rf "$clone"' EXIT
git clone --quiet -c core.autocrlf=true "$root" "$clone/repo"
if grep -rlI $'\r' "$clone/repo/patches" "$clone/repo/ci" "$clone/repo/.ci" "$clone/repo/tools" --include='*' >/dev/null; then
    echo "ci/autocrlf.sh: a patch or script came out with CRLF" >&2
    exit 1
fi
sdist=$(ls "$root"/.hotggml/cache/ggml_python-*.tar.gz 2>/dev/null | head -n 1 || true)
current=$root/.hotggml/build/current-cpu.json
lib_dir() { [ -f "$current" ] && python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["lib_dir"])' "$current" || true; }
ours=$(lib_dir)   # this checkout's build, where its main job ran first (none: the clone runs its whole job)
cd "$clone/repo"
export HOTGGML_GGML_SDIST=${sdist:-${HOTGGML_GGML_SDIST:-}} HOTGGML_BUILD_ROOT=$root/.hotggml/build
bash ci/main.sh --prepare
if [ -n "$ours" ] && [ "$(lib_dir)" = "$ours" ]; then
    echo "autocrlf: the clone's patches built this checkout's library ($ours): the main job's runs are its own"
else
    echo "autocrlf: the clone's library ($(lib_dir)) is not one this checkout's main job ran: its whole main job"
    bash ci/main.sh
fi
