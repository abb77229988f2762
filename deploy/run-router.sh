#!/usr/bin/env bash
# N `kvpool serve` replicas behind vllm-router (the vLLM project's router, from the test
# extra): replica i (1..N) serves the tiny generated checkpoint on 127.0.0.1:(ROUTER_PORT+i),
# publishes its KV events on its own ports with its own topic (rank 0, vLLM's meaning), and the router listens on
# 127.0.0.1:ROUTER_PORT with --policy cache_aware. Then the load generator's shared-prefix
# workload through the router, each replica's prefix-cache hit rate and the aggregate, and
# everything stopped -- or, with --hold, everything served until Ctrl-C.
#
#   bash deploy/run-router.sh [--hold | extra loadgen args...]    (after `make install`)
#
# Environment overrides (defaults in brackets):
#   PYTHON [.venv/bin/python if it exists, else python3]  interpreter with kvpool installed
#   ROUTER [vllm-router beside $PYTHON, else on PATH]
#   KVPOOL_REPLICAS [2]          how many `kvpool serve`
#   KVPOOL_ROUTER_PORT [8100]    the router's port; replica i listens on this + i
#   KVPOOL_ROUTER_POLICY [cache_aware]  (round_robin, power_of_two, consistent_hash, ...)
#   KVPOOL_ROUTER_ARGS           extra vllm-router flags (word-split)
#   KVPOOL_KV_EVENTS_PORT [5557] replica i publishes KV events on 127.0.0.1:(this + 2(i-1)),
#                                replays on the port after it; empty: no KV events
#   KVPOOL_DEVICE [cpu], KVPOOL_MODEL [the tiny checkpoint], KVPOOL_MAX_MODEL_LEN [2048],
#   KVPOOL_KV_CACHE_MEMORY [8MiB], KVPOOL_BLOCK_SIZE [16], KVPOOL_SERVE_ARGS (word-split):
#                                as in deploy/run.sh, for every replica
#   KVPOOL_READY_TIMEOUT [120]   seconds to wait for every replica's /health and the router
#   KVPOOL_STOP_TIMEOUT [10]     seconds between SIGTERM and SIGKILL at shutdown
#   KVPOOL_LOG_DIR [mktemp -d]   router.log, and replica-I/ with each replica's logs
# Exit status: the load generator's (0 = every request completed), 0 after --hold, or 1
# when something did not come up.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${ROUTER:-}" ]; then
    ROUTER="$(dirname "$PYTHON")/vllm-router"
    [ -x "$ROUTER" ] || ROUTER=$(command -v vllm-router || true)
fi
REPLICAS=${KVPOOL_REPLICAS:-2}
ROUTER_PORT=${KVPOOL_ROUTER_PORT:-8100}
POLICY=${KVPOOL_ROUTER_POLICY:-cache_aware}
EVENTS_PORT=${KVPOOL_KV_EVENTS_PORT-5557}
DEVICE=${KVPOOL_DEVICE:-cpu}
MODEL=${KVPOOL_MODEL:-}
MAX_MODEL_LEN=${KVPOOL_MAX_MODEL_LEN:-2048}
KV_CACHE_MEMORY=${KVPOOL_KV_CACHE_MEMORY:-8MiB}
BLOCK_SIZE=${KVPOOL_BLOCK_SIZE:-16}
READY_TIMEOUT=${KVPOOL_READY_TIMEOUT:-120}
STOP_TIMEOUT=${KVPOOL_STOP_TIMEOUT:-10}
LOG_DIR=${KVPOOL_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvpool-router.XXXXXX")}
HOLD=0
if [ "${1:-}" = "--hold" ]; then HOLD=1; shift; fi
mkdir -p "$LOG_DIR"

log() { echo "run-router.sh: $*" >&2; }

if [ -z "$ROUTER" ] || [ ! -x "$ROUTER" ]; then
    log "vllm-router not found: \`make install\` installs it (the test extra), or pip install vllm-router, or set ROUTER"
    exit 1
fi
if ! [ "$REPLICAS" -ge 1 ] 2>/dev/null; then
    log "KVPOOL_REPLICAS must be a positive number, got '$REPLICAS'"
    exit 1
fi

pids=()
names=()
stopping=0

show_logs() {
    local f
    for f in "$LOG_DIR"/router.log "$LOG_DIR"/replica-*/serve.log; do
        if [ -s "$f" ]; then
            echo "----- last lines of $f -----" >&2
            tail -n 30 "$f" >&2
        fi
    done
}

# NOTE: start() puts the router first in pids, so stop_all stops it first: no request
# reaches a replica being stopped.
. deploy/processes.sh  # stop_all, alive_or_die, wait_http, trap_fleet_cleanup, serve_until_interrupted

trap_fleet_cleanup

start() {  # start NAME LOGFILE CMD...: in the background
    local name=$1 logfile=$2
    shift 2
    "$@" >"$logfile" 2>&1 &
    pids=("$!" "${pids[@]}")
    names=("$name" "${names[@]}")
    log "started $name (pid $!): $*"
}

if [ -z "$MODEL" ]; then
    MODEL=$("$PYTHON" -c 'from worker.tiny.generate import default_checkpoint; print(default_checkpoint())')
fi

urls=()
kv_sources=()
for i in $(seq 1 "$REPLICAS"); do
    port=$((ROUTER_PORT + i))
    dir="$LOG_DIR/replica-$i"
    mkdir -p "$dir"
    events=()
    if [ -n "$EVENTS_PORT" ]; then
        pub=$((EVENTS_PORT + 2 * (i - 1)))
        # NOTE: llm-d's indexer reads the topic as kv@<pod>@<model>. Every replica keeps rank 0:
        # vLLM's data_parallel_rank is the engine's rank inside its own DP group, and
        # vllm-router's kv_aware files a batch under (worker, rank), so rank i would be a
        # target that does not exist.
        events=(--kv-events-endpoint "tcp://127.0.0.1:$pub" --kv-events-replay-endpoint "tcp://127.0.0.1:$((pub + 1))"
                --kv-events-topic "kv@127.0.0.1:$port@$MODEL")
        if [ "$POLICY" = kv_aware ]; then
            kv_sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$pub"
                         --kv-event-replay-source "http://127.0.0.1:$port=tcp://127.0.0.1:$((pub + 1))")
        fi
    fi
    # shellcheck disable=SC2086  # KVPOOL_SERVE_ARGS is meant to be word-split
    start "replica-$i" "$dir/serve.log" "$PYTHON" -m frontend.serve.cli serve "$MODEL" --host 127.0.0.1 --port "$port" \
        --device "$DEVICE" --kv-cache-memory "$KV_CACHE_MEMORY" --block-size "$BLOCK_SIZE" \
        --max-model-len "$MAX_MODEL_LEN" --log-dir "$dir" --stop-timeout "$(( STOP_TIMEOUT > 2 ? STOP_TIMEOUT / 2 : 1 ))" \
        "${events[@]}" ${KVPOOL_SERVE_ARGS:-}
    urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do
    wait_http "$url/health" "kvpool serve at $url"
done
if [ "${#kv_sources[@]}" -gt 0 ]; then
    # NOTE: vllm-router 0.1.17 subscribes to an HTTP worker's KV events only when told
    # where they are, with the block size and model (docs/architecture.md, "KV-aware routing").
    kv_sources+=(--kv-event-block-size "$BLOCK_SIZE" --kv-event-model "$MODEL")
fi

# Health checked every 2 s, out after 2 failures: a dead replica leaves the rotation in
# about 4 s (the router's defaults: 60 s and 3). The metrics port must not collide.
# shellcheck disable=SC2086  # KVPOOL_ROUTER_ARGS is meant to be word-split
start router "$LOG_DIR/router.log" "$ROUTER" --worker-urls "${urls[@]}" --policy "$POLICY" \
    --host 127.0.0.1 --port "$ROUTER_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$((ROUTER_PORT + 90))" \
    --health-check-interval-secs 2 --health-failure-threshold 2 --worker-startup-check-interval 1 \
    "${kv_sources[@]}" ${KVPOOL_ROUTER_ARGS:-}
wait_http "http://127.0.0.1:$ROUTER_PORT/readiness" "vllm-router"
log "ready: vllm-router ($POLICY) at http://127.0.0.1:$ROUTER_PORT/v1 over ${urls[*]}"

if [ "$HOLD" -eq 1 ]; then
    serve_until_interrupted
fi

set +e
# NOTE: --metrics-url '': the KV figures are per replica, summed below.
"$PYTHON" -m loadgen --backend openai --base-url "http://127.0.0.1:$ROUTER_PORT" --metrics-url '' \
    --dataset shared-prefix --num-requests 200 --num-prefixes 8 --prefix-len 256 \
    --suffix-len 64 --output-len 32 --request-timeout 300 --timeout 900 "$@"
rc=$?
set -e
"$PYTHON" - "${urls[@]}" <<'EOF' >&2 || true
import sys, urllib.request

def total(text, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))

hits = queries = 0.0
for url in sys.argv[1:]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    h, q = total(text, "vllm:prefix_cache_hits_total"), total(text, "vllm:prefix_cache_queries_total")
    served = total(text, "vllm:request_success_total")
    hits, queries = hits + h, queries + q
    print(f"run-router.sh: {url}: {served:.0f} requests, prefix-cache hit rate {h / q if q else 0:.3f} ({h:.0f}/{q:.0f} tokens)")
print(f"run-router.sh: aggregate prefix-cache hit rate {hits / queries if queries else 0:.3f}")
EOF
exit "$rc"
