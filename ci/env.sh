# Sourced, by the ci/*.sh scripts and by a user's shell (`source ci/env.sh`): a project venv (.venv) with
# the dependencies that pyproject.toml declares ([project.dependencies] + the `tooling` and `test` extras), installed by
# name through pip's configured index, put first on PATH, the checkout on PYTHONPATH, and `hotggml` defined
# as `python -m hotggml`. Idempotent: a venv whose stamp matches is reused. It changes nothing else: no shell
# options (a `set -e` here would close an interactive shell at its next failing command), no `cd`.
# Returns non-zero (and says why) when the venv cannot be made.
hotggml_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hotggml_env() {
    local root=$1 py=${PYTHON:-python3} want deps
    if [ ! -x "$root/.venv/bin/python" ]; then
        "$py" -m venv "$root/.venv" || { echo "ci/env.sh: cannot create $root/.venv with $py" >&2; return 1; }
    fi
    want=$(sha256sum "$root/pyproject.toml" | cut -c1-16)
    if [ "$(cat "$root/.venv/.hotggml-deps" 2>/dev/null)" != "$want" ]; then
        deps=$("$root/.venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
meta = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = meta["optional-dependencies"]
print("\n".join(meta["dependencies"] + extras["tooling"] + extras["test"]))
PY
) || return 1
        # shellcheck disable=SC2086
        "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check $deps \
            || { echo "ci/env.sh: installing $deps failed" >&2; return 1; }
        echo "$want" > "$root/.venv/.hotggml-deps"
    fi
}
if hotggml_env "$hotggml_root"; then
    export PATH="$hotggml_root/.venv/bin:$PATH"
    export PYTHONPATH="$hotggml_root${PYTHONPATH:+:$PYTHONPATH}"
    hotggml() { python -m hotggml "$@"; }
    unset -f hotggml_env; unset hotggml_root
else
    unset -f hotggml_env; unset hotggml_root
    false
fi
