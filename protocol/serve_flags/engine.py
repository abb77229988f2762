"""The settings table's rows of vLLM's SchedulerConfig, ParallelConfig, LoggingConfig,
ObservabilityConfig, VllmConfig and Frontend groups that reach a child process."""

from __future__ import annotations

import argparse

from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, flag
from protocol.serve_flags.values import LOG_LEVELS, human_readable_int

# vLLM's --max-num-batched-tokens with chunked prefill, when not given.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

MAX_NUM_SEQS = flag("--max-num-seqs", SCHEDULER, WORKER, type=int, default=256,
                    help="most requests running at once (default %(default)s)")
MAX_NUM_BATCHED_TOKENS = flag("--max-num-batched-tokens", SCHEDULER, WORKER, type=human_readable_int, default=None,
                              help="token budget of one step: 2048, 2k, 2K (default 2048; with --no-enable-chunked-prefill "
                                   "at least --max-model-len, as vLLM)")
SCHEDULER_RESERVE_FULL_ISL = flag("--scheduler-reserve-full-isl", SCHEDULER, action=argparse.BooleanOptionalAction, default=True,
                                  help="admit a request only if its whole prompt fits the free blocks, not only its first "
                                       "chunk (default: on, as vLLM)")
TENSOR_PARALLEL_SIZE = flag("--tensor-parallel-size -tp", WORKER, type=int, default=1, metavar="N",
                            help="worker ranks in one torch.distributed group (gloo on CPU, NCCL on CUDA), each with 1/N of "
                                 "the heads and MLP (default %(default)s)")
LOG_LEVEL = flag("--log-level", SCHEDULER, WORKER, FRONTEND, type=str.upper, default="INFO", choices=LOG_LEVELS,
                 accepts=("ERROR", "WARNING", "INFO", "DEBUG"), why_not="kvpool's processes log at DEBUG, INFO, WARNING or ERROR",
                 help="every process's log level (default %(default)s)")
DISABLE_LOG_STATS = flag("--disable-log-stats", SCHEDULER, action="store_true",
                         help="no periodic stats line (throughput, running/waiting, KV usage, hit rate) in the scheduler's "
                              "log (default: every VLLM_LOG_STATS_INTERVAL seconds, 10)")
KV_CACHE_METRICS = flag("--kv-cache-metrics", SCHEDULER, action=argparse.BooleanOptionalAction, default=False,
                        help="KV residency histograms (vllm:kv_block_lifetime_seconds, _idle_before_evict_, _reuse_gap_)")
ENABLE_MFU_METRICS = flag("--enable-mfu-metrics", SCHEDULER, action=argparse.BooleanOptionalAction, default=False,
                          help="vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu, estimated from the checkpoint's "
                               "config.json (--model) in the worker's --dtype")
ENABLE_LOGGING_ITERATION_DETAILS = flag("--enable-logging-iteration-details", SCHEDULER, action=argparse.BooleanOptionalAction,
                                        default=False, help="with the stats on, log each step's requests and tokens, as vLLM")
# NOTE: no type here: the scheduler checks the JSON against its own histogram families
# (scheduler/engine/metric_buckets.py), as add_flag's ``type``.
CUSTOM_HISTOGRAM_BUCKETS = flag("--custom-histogram-buckets", SCHEDULER, default=None, metavar="JSON",
                                help="vLLM's histogram bounds by family, as JSON")
KV_CACHE_METRICS_SAMPLE = flag("--kv-cache-metrics-sample", SCHEDULER, type=float, default=1.0, metavar="FRACTION",
                               help="fraction of block allocations watched, in (0, 1] (default %(default)s: every block; vLLM's is 0.01)")
SPECULATIVE_CONFIG = flag("--speculative-config -sc", SCHEDULER, default=None, metavar="JSON",
                          help="vLLM's SpeculativeConfig as JSON: method ngram (num_speculative_tokens, "
                               "prompt_lookup_min/max, default 5) or suffix (suffix_decoding_max_tree_depth, "
                               "_max_cached_requests, _max_spec_factor, _min_token_prob)")
KV_TRANSFER_CONFIG = flag("--kv-transfer-config", SCHEDULER, WORKER, FRONTEND, default=None, metavar="JSON",
                          help="vLLM's KVTransferConfig as JSON: kv_connector KVPoolConnector (or NixlConnector, its "
                               "contract), kv_role kv_producer, kv_consumer or kv_both, engine_id, kv_load_failure_policy, "
                               "kv_connector_extra_config (kv_lease_duration, side_channel_host, side_channel_port, "
                               "read_timeout) (docs/pd-disaggregation.md; default: none)")
ENABLE_LOG_REQUESTS = flag("--enable-log-requests", FRONTEND, action=argparse.BooleanOptionalAction, default=False,
                           help="log each request received: its id, sampling parameters and prompt lengths (default off, "
                                "as vLLM)")
RETURN_TOKENS_AS_TOKEN_IDS = flag("--return-tokens-as-token-ids", FRONTEND, action=argparse.BooleanOptionalAction, default=False,
                                  help="logprobs name tokens as token_id:N (default off)")

ROWS = (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, SCHEDULER_RESERVE_FULL_ISL, TENSOR_PARALLEL_SIZE, LOG_LEVEL, DISABLE_LOG_STATS,
        KV_CACHE_METRICS, ENABLE_MFU_METRICS, ENABLE_LOGGING_ITERATION_DETAILS, CUSTOM_HISTOGRAM_BUCKETS, KV_CACHE_METRICS_SAMPLE,
        SPECULATIVE_CONFIG, KV_TRANSFER_CONFIG, ENABLE_LOG_REQUESTS,
        RETURN_TOKENS_AS_TOKEN_IDS)
