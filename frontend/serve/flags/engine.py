"""``vllm serve``'s VllmConfig group: the JSON configs of whole subsystems."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import ONE, Group, declared, handled, refused
from protocol.serve_flags.engine import KV_TRANSFER_CONFIG, SPECULATIVE_CONFIG

_RULES = [
    refused("--additional-config", ONE, "platform-specific configs are not supported", accepts=("{}",)),
    refused("--attention-config -ac", ONE, why.KERNELS),
    refused("--aux-output-config", ONE, why.NOT_YET),
    refused("--compilation-config -cc", ONE, why.GRAPHS),
    refused("--diffusion-config -dc", ONE, why.NOT_YET),
    refused("--ec-manager-config", ONE, why.MULTIMODAL),
    refused("--ec-transfer-config", ONE, why.MULTIMODAL),
    refused("--engram-config", ONE, why.NOT_YET),
    refused("--kernel-config", ONE, why.KERNELS),
    handled("--kv-events-config", ONE, "scheduler: its KV events publisher, by vLLM's bind/connect rule", default=None, metavar="JSON",
            help="vLLM's KVEventsConfig as JSON: enable_kv_cache_events, publisher, endpoint (a wildcard, ipc:// or "
                 "inproc:// endpoint is bound, any other connected to), replay_endpoint, topic, buffer_steps, hwm"),
    declared(KV_TRANSFER_CONFIG, ONE, "scheduler, worker and API server: P/D disaggregation (docs/pd-disaggregation.md), "
             "checked once and given to each with the same engine_id"),
    refused("--optimization-level", ONE, why.GRAPHS, accepts=("0",)),
    refused("--performance-mode", ONE, why.NOT_YET, accepts=("balanced",)),
    refused("--profiler-config", ONE, why.TRACING),
    refused("--reasoning-config", ONE, why.REASONING),
    # Speculative decoding: n-gram drafts (protocol/speculative_config.py); the three shortcuts
    # fill the JSON's method, model and num_speculative_tokens, as vLLM's create_speculative_config.
    handled("--spec-method", ONE, "scheduler: --speculative-config's method", default=None, metavar="METHOD"),
    handled("--spec-model", ONE, "scheduler: --speculative-config's model (refused: no draft model)", default=None, metavar="MODEL"),
    handled("--spec-tokens", ONE, "scheduler: --speculative-config's num_speculative_tokens", type=int, default=None, metavar="N"),
    declared(SPECULATIVE_CONFIG, ONE, "scheduler: n-gram or suffix drafting, its proposer and vLLM's spec-decode metrics"),
    refused("--structured-outputs-config", ONE, "structured outputs are xgrammar with vLLM's default settings (no other backend, no disable_any_whitespace): not configurable"),
    refused("--watermark-config", ONE, why.NOT_YET),
    refused("--weight-transfer-config", ONE, why.NOT_YET),
]

GROUPS = [Group("VllmConfig", "Dataclass which contains all vllm-related configuration.", _RULES)]
