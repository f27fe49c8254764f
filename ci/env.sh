# Sourced by the ci/*.sh scripts: a project venv (.venv) with the dependencies that
# pyproject.toml declares ([project.dependencies] + the `test` extra), installed by name
# through pip's configured index. Idempotent: a venv whose stamp matches is reused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat .venv/.hotggml-deps 2>/dev/null)" != "$want" ]; then
    deps=$(.venv/bin/python - <<'PY'
import tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(meta["dependencies"] + meta["optional-dependencies"]["test"]))
PY
)
    # shellcheck disable=SC2086
    .venv/bin/python -m pip install --quiet --disable-pip-version-check $deps
    echo "$want" > .venv/.hotggml-deps
fi
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
hotggml() { python -m hotggml "$@"; }
