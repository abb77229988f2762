"""``vllm serve``'s MultiModalConfig, LoRAConfig, LoggingConfig and ObservabilityConfig
groups. kvpool serves text and the base model only; its logs and metrics are its own."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags import values
from frontend.serve.flags.rules import (
    BOOL,
    MANY,
    ONE,
    Group,
    declared,
    passed,
    refused,
    same,
)
from protocol.serve_flags.engine import (
    CUSTOM_HISTOGRAM_BUCKETS,
    ENABLE_LOGGING_ITERATION_DETAILS,
    ENABLE_MFU_METRICS,
    KV_CACHE_METRICS,
    KV_CACHE_METRICS_SAMPLE,
    LOG_LEVEL,
)

_MULTIMODAL_BOOLS = ("--enable-mm-embeds", "--interleave-mm-strings", "--mm-encoder-only", "--skip-mm-profiling")
_MULTIMODAL_VALUES = (
    "--limit-mm-per-prompt", "--media-io-kwargs", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
    "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path",
    "--mm-encoder-tp-mode", "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb", "--mm-processor-cache-gb",
    "--mm-processor-cache-type", "--mm-processor-device", "--mm-processor-kwargs", "--mm-shm-cache-max-object-size-mb",
    "--mm-tensor-ipc", "--video-pruning-method", "--video-pruning-rate",
)
_MULTIMODAL = sorted(
    [refused(f, BOOL, why.MULTIMODAL, accepts=(False,)) for f in _MULTIMODAL_BOOLS]
    + [refused("--language-model-only", BOOL, why.MULTIMODAL, accepts=(True,)),
       refused("--mm-device-do-normalize", BOOL, why.MULTIMODAL)]
    + [refused(f, ONE, why.MULTIMODAL) for f in _MULTIMODAL_VALUES],
    key=lambda r: r.name,
)

_LORA_BOOLS = ("--enable-lora", "--enable-mixed-moe-lora-format", "--enable-moe-shared-loras", "--enable-tower-connector-lora",
               "--fully-sharded-loras", "--specialize-active-lora")
_LORA_VALUES = ("--default-mm-loras", "--lora-dtype", "--max-cpu-loras", "--max-lora-cls-labels", "--max-lora-rank", "--max-loras")
_LORA = sorted(
    [refused(f, BOOL, why.LORA, accepts=(False,)) for f in _LORA_BOOLS]
    + [refused(f, ONE, why.LORA) for f in _LORA_VALUES]
    + [refused("--lora-target-modules", MANY, why.LORA)],
    key=lambda r: r.name,
)

_LOGGING = [
    refused("--log-config-file", ONE,
            "kvpool's processes log as frontend, scheduler and worker and its access log as frontend.access, "
            "not vLLM's vllm.* and uvicorn.* loggers that a vLLM dictConfig file configures"),
    declared(LOG_LEVEL, ONE, "scheduler, worker and frontend"),
    refused("--logging-config", ONE, why.NOT_YET),
]

_OBSERVABILITY = [
    refused("--collect-detailed-traces", MANY, why.TRACING),
    refused("--cudagraph-metrics", BOOL, why.GRAPHS, accepts=(False,)),
    passed(CUSTOM_HISTOGRAM_BUCKETS),
    refused("--enable-layerwise-nvtx-tracing", BOOL, why.TRACING, accepts=(False,)),
    passed(ENABLE_LOGGING_ITERATION_DETAILS),
    declared(ENABLE_MFU_METRICS, BOOL, "scheduler"),
    refused("--jit-monitor-mode", ONE, why.GRAPHS),
    refused("--jit-monitor-verbose", BOOL, why.GRAPHS, accepts=(False,)),
    declared(KV_CACHE_METRICS, BOOL, "scheduler"),
    passed(KV_CACHE_METRICS_SAMPLE),
    refused("--otlp-traces-endpoint", ONE, why.TRACING),
    refused("--per-request-spec-decode-metrics", ONE, why.SPECULATIVE, accepts=("none",)),
    same("--show-hidden-metrics-for-version", ONE,
         "vLLM 0.32 hides no metric behind it (its value is only checked to be a version)", type=values.version),
]

GROUPS = [
    Group("MultiModalConfig", "Controls the behavior of multimodal models.", _MULTIMODAL),
    Group("LoRAConfig", "Configuration for LoRA.", _LORA),
    Group("LoggingConfig", "vLLM logging.", _LOGGING),
    Group("ObservabilityConfig", "Configuration for observability - metrics and tracing.", _OBSERVABILITY),
]
