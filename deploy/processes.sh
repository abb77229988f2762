# Sourced by deploy/run.sh, deploy/run-router.sh and deploy/run-pd.sh: waiting for what they
# started, and stopping it. Expects: pids and names (parallel arrays of the background
# processes, in the order to stop them), STOP_TIMEOUT (seconds each may take after SIGTERM),
# READY_TIMEOUT and PYTHON (wait_http), and log(); the fleet scripts' exit below.

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

alive_or_die() {
    local i
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            log "${names[$i]} exited during start-up"
            exit 1
        fi
    done
}

wait_http() {  # wait_http URL WHAT
    local deadline=$((SECONDS + READY_TIMEOUT))
    until "$PYTHON" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
    do
        alive_or_die
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$2 did not answer $1 within ${READY_TIMEOUT}s"
            exit 1
        fi
        sleep 0.5
    done
}

# The fleet scripts' exit (run-router.sh, run-pd.sh): everything stopped once, the logs shown
# after a failure, and under --hold a Ctrl-C (or SIGTERM) is a clean exit. Expects stopping,
# HOLD, LOG_DIR and show_logs(); DRY_RUN (unset: 0) when nothing was started.
fleet_cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$stopping" -eq 0 ] && [ "${DRY_RUN:-0}" -eq 0 ]; then
        stopping=1
        stop_all
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 130 ] && [ "$rc" -ne 143 ]; then
            show_logs
        fi
        log "logs in $LOG_DIR"
    fi
    if [ "$HOLD" -eq 1 ] && { [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ]; }; then
        rc=0
    fi
    exit "$rc"
}

serve_until_interrupted() {  # --hold: serve until Ctrl-C, exiting if anything started dies
    log "serving until Ctrl-C"
    while true; do
        alive_or_die
        sleep 1
    done
}

trap_fleet_cleanup() {
    trap fleet_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}
