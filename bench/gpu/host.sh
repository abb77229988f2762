#!/usr/bin/env bash
# The one call on a CUDA host that has no kvpool venv (its own Python with torch, Triton and
# transformers): the wheels bench/gpu/wheels.sh fetched (.whl/, beside the tree) installed
# into a scratch folder, then `python -m bench.gpu` with this script's arguments
# (e.g. --out DIR; the log folder may also come from KVPOOL_GPU_OUT).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/kvpool-site}
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 3
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
unset TRITON_INTERPRET  # the kernels compiled for the device, never interpreted
export PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu "$@"
