# Sourced by the gate scripts: `step NAME CMD...` runs CMD, appends {"step", "rc", "seconds"} to the JSON
# report at $STEPS_REPORT (rewritten after every step, so a failed run says where it stopped), and ends
# the calling script at the first failure with CMD's exit status. Defines `step` and `steps_json` only.
steps_json=()
step() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" || rc=$?
    steps_json+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}")
    mkdir -p "$(dirname "$STEPS_REPORT")"
    (IFS=,; printf '{"steps": [%s]}\n' "${steps_json[*]}") > "$STEPS_REPORT"
    if [ "$rc" -ne 0 ]; then
        echo "step $name failed (exit $rc); report in $STEPS_REPORT" >&2
        exit "$rc"
    fi
}
