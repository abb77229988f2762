"""``vllm serve``'s SchedulerConfig, CompilationConfig and KernelConfig groups: what
runs in each step, and how vLLM's GPU code would be compiled (which kvpool never does)."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, MANY, ONE, Group, declared, passed, refused, same
from protocol.serve_flags.engine import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SCHEDULER_RESERVE_FULL_ISL,
)
from protocol.serve_flags.scheduling import (
    DISABLE_HYBRID_KV_CACHE_MANAGER,
    ENABLE_CHUNKED_PREFILL,
    LONG_PREFILL_TOKEN_THRESHOLD,
    LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE,
    MAX_NUM_ACTIVE_SEQS,
    MAX_NUM_QUEUED_REQS,
    MAX_NUM_QUEUED_TOKENS,
    MAX_NUM_SCHEDULED_TOKENS,
    PREFILL_SCHEDULE_INTERVAL,
    SCHEDULING_POLICY,
    WATERMARK,
)

_SCHEDULER = [
    refused("--async-scheduling", BOOL, why.ASYNC, accepts=(False,)),
    same("--disable-chunked-mm-input", BOOL, "kvpool serves text only: there is no multimodal item to keep unsplit"),
    passed(DISABLE_HYBRID_KV_CACHE_MANAGER),
    passed(ENABLE_CHUNKED_PREFILL),
    passed(LONG_PREFILL_TOKEN_THRESHOLD),
    passed(LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE),
    passed(MAX_NUM_ACTIVE_SEQS),
    declared(MAX_NUM_BATCHED_TOKENS, ONE, "scheduler and worker"),
    passed(MAX_NUM_QUEUED_REQS),  # NOTE: vLLM enforces both in its API server process
    passed(MAX_NUM_QUEUED_TOKENS),
    passed(MAX_NUM_SCHEDULED_TOKENS),
    declared(MAX_NUM_SEQS, ONE, "scheduler and worker"),
    passed(PREFILL_SCHEDULE_INTERVAL),
    refused("--scheduler-cls", ONE, "kvpool's scheduler is its own process, not a vLLM scheduler class"),
    declared(SCHEDULER_RESERVE_FULL_ISL, BOOL, "scheduler"),
    passed(SCHEDULING_POLICY),
    refused("--stream-interval", ONE, "kvpool streams each token as it is sampled (vLLM's 1)", accepts=("1",)),
    passed(WATERMARK),
]

GROUPS = [
    Group("SchedulerConfig", "Scheduler configuration.", _SCHEDULER),
    Group("CompilationConfig", "Configuration for compilation.", [
        refused("--cudagraph-capture-sizes", MANY, why.GRAPHS),
        refused("--max-cudagraph-capture-size", ONE, why.GRAPHS),
    ]),
    Group("KernelConfig", "Configuration for kernel selection and warmup behavior.", [
        refused("--enable-flashinfer-autotune", BOOL, why.KERNELS),
        refused("--ir-op-priority", ONE, why.KERNELS),
        refused("--linear-backend", ONE, why.KERNELS, accepts=("auto",)),
        refused("--moe-backend", ONE, why.EXPERTS, accepts=("auto",)),
        refused("--sparse-indexer-topk-backend", ONE, why.KERNELS),
    ]),
]
