# Sourced by bench/gpu_run.sh and bench/collab_gpu.sh (device calls, where one hang must leave the rest):
#     step NAME LIMIT_S CMD...
# runs CMD with a time limit, its output to $STEP_LOGS/NAME.log, prints "[$STEP_TAG] NAME: rc=.. in .. s"
# (also appended to $STEP_TIMES when that is set) and the log's last $STEP_TAIL lines without vLLM's
# INFO/WARNING chatter; returns CMD's exit code.
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$STEP_LOGS/$name.log" 2>&1
    local rc=$?
    local line="[$STEP_TAG] $name: rc=$rc in $((SECONDS - t0)) s"
    if [ -n "${STEP_TIMES:-}" ]; then echo "$line" | tee -a "$STEP_TIMES"; else echo "$line"; fi
    grep -v -E '^\(|INFO|WARNING' "$STEP_LOGS/$name.log" | tail -n "${STEP_TAIL:-25}"
    return $rc
}
