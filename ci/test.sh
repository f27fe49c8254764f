#!/usr/bin/env bash
# The tests: pytest over tests/ (builds the CPU library first if this checkout has none).
source "$(dirname "$0")/env.sh"
python -m pytest tests -q -rs "$@"   # -rs: every skip says why
