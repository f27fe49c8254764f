#!/usr/bin/env bash
# The tests: pytest over tests/ (builds the CPU library first if this checkout has none).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
python -m pytest tests -q -rs "$@"   # -rs: every skip says why
