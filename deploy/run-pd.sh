#!/usr/bin/env bash
# Prefill/decode disaggregation (docs/pd-disaggregation.md): P prefill and D decode
# `kvpool serve` engines of the tiny generated checkpoint behind vllm-router's PD mode
# (--vllm-pd-disaggregation). Prefill engine i (1..P) listens on 127.0.0.1:(ROUTER_PORT+i),
# decode engine j (1..D) on 127.0.0.1:(ROUTER_PORT+P+j); the router on ROUTER_PORT sends
# each request to a prefill engine (one token, its blocks lent), then to a decode engine,
# whose worker reads the prompt's blocks from the prefill engine's side channel (a free
# port each worker picks, named in kv_transfer_params). Then a short shared-prefix load
# through the router, each engine's requests, prefix-cache hit rate and prompt tokens read
# from another engine (vllm:prompt_tokens_cached_by_source{source="p2p"}), and everything
# stopped -- or, with --hold, everything served until Ctrl-C.
#
# Each engine on its own core: engine k (0-based, prefill engines first, then decode) runs
# under `taskset -c (k mod nproc)`, its scheduler, worker and frontend with it (children
# inherit the affinity), so a prefill and a decode engine do not share a core while there
# are cores enough. Skipped where taskset is not installed, or with KVPOOL_PIN_CORES=0.
#
#   bash deploy/run-pd.sh [--hold | --dry-run | extra loadgen args...]    (after `make install`)
#
# --dry-run prints the command lines (one a line, shell-quoted) and starts nothing.
#
# Environment overrides (defaults in brackets):
#   PYTHON [.venv/bin/python if it exists, else python3]  interpreter with kvpool installed
#   ROUTER [vllm-router beside $PYTHON, else on PATH]
#   KVPOOL_PREFILL [1], KVPOOL_DECODE [1]  how many prefill and decode engines
#   KVPOOL_ROUTER_PORT [8100]    the router's port; the engines listen on the ports after it,
#                                the router's own metrics on this + 90
#   KVPOOL_ROUTER_POLICY [round_robin]  (the PD mode's policy, for both pools)
#   KVPOOL_ROUTER_ARGS           extra vllm-router flags (word-split)
#   KVPOOL_PIN_CORES [1]         1: engine k on core k mod nproc (taskset); 0: not pinned
#   KVPOOL_KV_LEASE [30]         seconds a prefill engine keeps a request's blocks for its reader
#   KVPOOL_READ_TIMEOUT [10]     seconds a decode engine's worker waits for them, then
#                                computes the prompt itself (kv_load_failure_policy recompute)
#   KVPOOL_SIDE_CHANNEL_HOST [127.0.0.1]  the address decode workers reach prefill workers at
#   KVPOOL_DEVICE [cpu], KVPOOL_MODEL [the tiny checkpoint], KVPOOL_MAX_MODEL_LEN [2048],
#   KVPOOL_KV_CACHE_MEMORY [8MiB], KVPOOL_BLOCK_SIZE [16], KVPOOL_SERVE_ARGS (word-split):
#                                as in deploy/run.sh, for every engine
#   KVPOOL_READY_TIMEOUT [120]   seconds to wait for every engine's /health and the router
#   KVPOOL_STOP_TIMEOUT [10]     seconds between SIGTERM and SIGKILL at shutdown
#   KVPOOL_LOG_DIR [mktemp -d]   router.log, and prefill-I/, decode-J/ with each engine's logs
# Exit status: the load generator's (0 = every request completed), 0 after --hold or
# --dry-run, or 1 when something did not come up.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${ROUTER:-}" ]; then
    ROUTER="$(dirname "$PYTHON")/vllm-router"
    [ -x "$ROUTER" ] || ROUTER=$(command -v vllm-router || true)
fi
NUM_PREFILL=${KVPOOL_PREFILL:-1}
NUM_DECODE=${KVPOOL_DECODE:-1}
ROUTER_PORT=${KVPOOL_ROUTER_PORT:-8100}
POLICY=${KVPOOL_ROUTER_POLICY:-round_robin}
PIN_CORES=${KVPOOL_PIN_CORES:-1}
LEASE=${KVPOOL_KV_LEASE:-30}
READ_TIMEOUT=${KVPOOL_READ_TIMEOUT:-10}
SIDE_CHANNEL_HOST=${KVPOOL_SIDE_CHANNEL_HOST:-127.0.0.1}
DEVICE=${KVPOOL_DEVICE:-cpu}
MODEL=${KVPOOL_MODEL:-}
MAX_MODEL_LEN=${KVPOOL_MAX_MODEL_LEN:-2048}
KV_CACHE_MEMORY=${KVPOOL_KV_CACHE_MEMORY:-8MiB}
BLOCK_SIZE=${KVPOOL_BLOCK_SIZE:-16}
READY_TIMEOUT=${KVPOOL_READY_TIMEOUT:-120}
STOP_TIMEOUT=${KVPOOL_STOP_TIMEOUT:-10}
HOLD=0
DRY_RUN=0
case "${1:-}" in
    --hold) HOLD=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
esac

log() { echo "run-pd.sh: $*" >&2; }

if [ "$DRY_RUN" -eq 0 ] && { [ -z "$ROUTER" ] || [ ! -x "$ROUTER" ]; }; then
    log "vllm-router not found: \`make install\` installs it (the test extra), or pip install vllm-router, or set ROUTER"
    exit 1
fi
for n in "$NUM_PREFILL" "$NUM_DECODE"; do
    if ! [ "$n" -ge 1 ] 2>/dev/null; then
        log "KVPOOL_PREFILL and KVPOOL_DECODE must be positive numbers, got '$NUM_PREFILL' and '$NUM_DECODE'"
        exit 1
    fi
done
PIN=()
if [ "$PIN_CORES" != 0 ]; then
    if command -v taskset >/dev/null && command -v nproc >/dev/null; then
        PIN=(taskset -c)
        NUM_CORES=$(nproc)
    else
        log "taskset not found: the engines are not pinned to cores"
    fi
fi
LOG_DIR=${KVPOOL_LOG_DIR:-}
if [ "$DRY_RUN" -eq 1 ]; then
    LOG_DIR=${LOG_DIR:-LOG_DIR}
else
    LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvpool-pd.XXXXXX")}
    mkdir -p "$LOG_DIR"
fi

pids=()
names=()
stopping=0

show_logs() {
    local f
    for f in "$LOG_DIR"/router.log "$LOG_DIR"/prefill-*/serve.log "$LOG_DIR"/decode-*/serve.log; do
        if [ -s "$f" ]; then
            echo "----- last lines of $f -----" >&2
            tail -n 30 "$f" >&2
        fi
    done
}

# NOTE: start() puts the router first in pids, so stop_all stops it first: no request
# reaches an engine being stopped.
. deploy/processes.sh  # stop_all, alive_or_die, wait_http, trap_fleet_cleanup, serve_until_interrupted

trap_fleet_cleanup

start() {  # start NAME LOGFILE CMD...: in the background (with --dry-run: printed)
    local name=$1 logfile=$2
    shift 2
    if [ "$DRY_RUN" -eq 1 ]; then
        local line
        line=$(printf '%q ' "$@")
        echo "${line% }"
        return
    fi
    "$@" >"$logfile" 2>&1 &
    pids=("$!" "${pids[@]}")
    names=("$name" "${names[@]}")
    log "started $name (pid $!): $*"
}

if [ -z "$MODEL" ]; then
    if [ "$DRY_RUN" -eq 1 ]; then
        MODEL=MODEL
    else
        MODEL=$("$PYTHON" -c 'from worker.tiny.generate import default_checkpoint; print(default_checkpoint())')
    fi
fi

# A prefill engine lends a finished request's blocks; a decode engine reads them, and
# computes the prompt itself when a read fails (vLLM's default policy, "fail", would end
# the request). side_channel_port 0: each worker binds a free port and says which in the
# kv_transfer_params of its answers.
transfer_config() {  # transfer_config ROLE
    printf '{"kv_connector":"KVPoolConnector","kv_role":"%s","kv_load_failure_policy":"recompute",%s}' "$1" \
        "\"kv_connector_extra_config\":{\"kv_lease_duration\":$LEASE,\"side_channel_host\":\"$SIDE_CHANNEL_HOST\",\"side_channel_port\":0,\"read_timeout\":$READ_TIMEOUT}"
}

prefill_urls=()
decode_urls=()
engine_names=()
k=0
start_engine() {  # start_engine ROLE(prefill|decode) I KV_ROLE: engine k, then k+1
    local role=$1 i=$2 port dir pin=()
    port=$((ROUTER_PORT + k + 1))
    dir="$LOG_DIR/$role-$i"
    [ "$DRY_RUN" -eq 1 ] || mkdir -p "$dir"
    if [ "${#PIN[@]}" -gt 0 ]; then
        pin=("${PIN[@]}" "$((k % NUM_CORES))")
    fi
    # shellcheck disable=SC2086  # KVPOOL_SERVE_ARGS is meant to be word-split
    start "$role-$i" "$dir/serve.log" "${pin[@]}" "$PYTHON" -m frontend.serve.cli serve "$MODEL" --host 127.0.0.1 --port "$port" \
        --device "$DEVICE" --kv-cache-memory "$KV_CACHE_MEMORY" --block-size "$BLOCK_SIZE" \
        --max-model-len "$MAX_MODEL_LEN" --log-dir "$dir" --stop-timeout "$(( STOP_TIMEOUT > 2 ? STOP_TIMEOUT / 2 : 1 ))" \
        --kv-transfer-config "$(transfer_config "$3")" ${KVPOOL_SERVE_ARGS:-}
    engine_names+=("$role-$i")
    k=$((k + 1))
}
for i in $(seq 1 "$NUM_PREFILL"); do
    start_engine prefill "$i" kv_producer
    prefill_urls+=("http://127.0.0.1:$((ROUTER_PORT + k))")
done
for i in $(seq 1 "$NUM_DECODE"); do
    start_engine decode "$i" kv_consumer
    decode_urls+=("http://127.0.0.1:$((ROUTER_PORT + k))")
done
urls=("${prefill_urls[@]}" "${decode_urls[@]}")
if [ "$DRY_RUN" -eq 0 ]; then
    for url in "${urls[@]}"; do
        wait_http "$url/health" "kvpool serve at $url"
    done
fi

router_urls=()
for url in "${prefill_urls[@]}"; do router_urls+=(--prefill "$url"); done
for url in "${decode_urls[@]}"; do router_urls+=(--decode "$url"); done
# Health checked every 2 s, out after 2 failures, as in run-router.sh.
# shellcheck disable=SC2086  # KVPOOL_ROUTER_ARGS is meant to be word-split
start router "$LOG_DIR/router.log" "$ROUTER" --vllm-pd-disaggregation "${router_urls[@]}" --policy "$POLICY" \
    --host 127.0.0.1 --port "$ROUTER_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$((ROUTER_PORT + 90))" \
    --health-check-interval-secs 2 --health-failure-threshold 2 --worker-startup-check-interval 1 \
    ${KVPOOL_ROUTER_ARGS:-}
if [ "$DRY_RUN" -eq 1 ]; then
    exit 0
fi
wait_http "http://127.0.0.1:$ROUTER_PORT/readiness" "vllm-router"
log "ready: vllm-router (PD, $POLICY) at http://127.0.0.1:$ROUTER_PORT/v1: prefill ${prefill_urls[*]}, decode ${decode_urls[*]}"

if [ "$HOLD" -eq 1 ]; then
    serve_until_interrupted
fi

set +e
# NOTE: --metrics-url '': the figures are per engine, read below.
"$PYTHON" -m loadgen --backend openai --base-url "http://127.0.0.1:$ROUTER_PORT" --metrics-url '' \
    --dataset shared-prefix --num-requests 40 --num-prefixes 4 --prefix-len 128 \
    --suffix-len 32 --output-len 16 --request-timeout 300 --timeout 900 "$@"
rc=$?
set -e
report=()
for i in "${!urls[@]}"; do report+=("${engine_names[$i]}=${urls[$i]}"); done
"$PYTHON" - "${report[@]}" <<'EOF' >&2 || true
import sys, urllib.request

def total(text, name, label=""):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith((name + "{", name + " ")) and label in l)

p2p_total = 0.0
for arg in sys.argv[1:]:
    name, url = arg.split("=", 1)
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    h, q = total(text, "vllm:prefix_cache_hits_total"), total(text, "vllm:prefix_cache_queries_total")
    served = total(text, "vllm:request_success_total")
    p2p = total(text, "vllm:prompt_tokens_cached_by_source_total", 'source="p2p"')
    p2p_total += p2p
    print(f"run-pd.sh: {name} {url}: {served:.0f} requests, prefix-cache hit rate {h / q if q else 0:.3f} "
          f"({h:.0f}/{q:.0f} tokens), {p2p:.0f} prompt tokens read from a prefill engine (p2p)")
print(f"run-pd.sh: {p2p_total:.0f} prompt tokens moved from prefill to decode engines")
EOF
exit "$rc"
