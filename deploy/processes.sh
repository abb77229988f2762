# Sourced by deploy/run.sh and deploy/run-router.sh: stopping what they started.
# Expects: pids and names (parallel arrays of the background processes, in the order
# to stop them), STOP_TIMEOUT (seconds each may take after SIGTERM), and log().

stop_all() {  # SIGTERM every process, then SIGKILL whatever outlives STOP_TIMEOUT
    local i pid deadline
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    deadline=$((SECONDS + STOP_TIMEOUT))
    for i in "${!pids[@]}"; do
        pid=${pids[$i]}
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "${names[$i]} (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
