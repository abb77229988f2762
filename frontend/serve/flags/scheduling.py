"""``vllm serve``'s SchedulerConfig, CompilationConfig and KernelConfig groups: what
runs in each step, and how vLLM's GPU code would be compiled (which kvpool never does)."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, MANY, ONE, Group, declared, passed, refused
from protocol.serve_flags.engine import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SCHEDULER_RESERVE_FULL_ISL,
)

_SCHEDULER = [
    refused("--async-scheduling", BOOL, why.ASYNC, accepts=(False,)),
    passed("--disable-chunked-mm-input", BOOL, "scheduler"),
    passed("--disable-hybrid-kv-cache-manager", BOOL, "worker"),
    passed("--enable-chunked-prefill", BOOL, "scheduler", default_on=True),
    passed("--long-prefill-token-threshold", ONE, "scheduler"),
    passed("--long-prefill-token-threshold-adaptive", BOOL, "scheduler"),
    passed("--max-num-active-seqs", ONE, "scheduler"),
    declared(MAX_NUM_BATCHED_TOKENS, ONE, "scheduler and worker"),
    passed("--max-num-queued-reqs", ONE, "frontend"),  # NOTE: vLLM enforces both in its API server process
    passed("--max-num-queued-tokens", ONE, "frontend"),
    passed("--max-num-scheduled-tokens", ONE, "scheduler"),
    declared(MAX_NUM_SEQS, ONE, "scheduler and worker"),
    passed("--prefill-schedule-interval", ONE, "scheduler"),
    refused("--scheduler-cls", ONE, "kvpool's scheduler is its own process, not a vLLM scheduler class"),
    declared(SCHEDULER_RESERVE_FULL_ISL, BOOL, "scheduler"),
    passed("--scheduling-policy", ONE, "scheduler"),
    refused("--stream-interval", ONE, "kvpool streams each token as it is sampled (vLLM's 1)", accepts=("1",)),
    passed("--watermark", ONE, "scheduler"),
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
