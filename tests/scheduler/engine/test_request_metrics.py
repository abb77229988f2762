"""The scheduler's vllm:* families against vLLM 0.32's PrometheusStatLogger: names,
types, label names, bucket bounds and help text (written here from vLLM's
vllm/v1/metrics/loggers.py, buckets.py and perf.py, not read from kvpool); then
their values after small workloads on the real policy and a fake worker, with a
fake clock, worked out by hand."""

from __future__ import annotations

import time

import pytest
from kvtest.fake_worker import FakeWorker
from prometheus_client.parser import text_string_to_metric_families

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

INF = float("inf")
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0, 7680.0)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
        640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTIONS = (1, 2, 3, 4, 5, 10, 20)
TOKENS_4096 = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)  # build_1_2_5_buckets(4096)
ENGINE = ("model_name", "engine")

# name (as the text page's family) -> (type, label names, buckets, help)
FAMILIES = {
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE, TTFT, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE, ITL, "Histogram of inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": ("histogram", ENGINE, ITL, "Histogram of time_per_output_token_seconds per request."),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE, REQUEST_LATENCY, "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY, "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY, "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY, "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("histogram", ENGINE, REQUEST_LATENCY, "Histogram of time spent in DECODE phase for request."),
    "vllm:request_num_preemptions": ("histogram", ENGINE, PREEMPTIONS, "Histogram of the number of times a request was preempted."),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ENGINE, TOKENS_4096,
                                                "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
    "vllm:iteration_tokens_total": ("histogram", ENGINE, ITERATION_TOKENS, "Histogram of number of tokens per engine_step."),
    "vllm:num_preemptions": ("counter", ENGINE, None, "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": ("counter", ENGINE, None, "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", ENGINE, None, "Number of generation tokens processed."),
    "vllm:prompt_tokens_by_source": ("counter", (*ENGINE, "source"), None, "Number of prompt tokens by source."),
    "vllm:prompt_tokens_cached": ("counter", ENGINE, None, "Number of cached prompt tokens (local + external)."),
    "vllm:prompt_tokens_cached_by_source": ("counter", (*ENGINE, "source"), None,
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, "
        "p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to "
        "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits."),
    "vllm:mm_cache_queries": ("counter", ENGINE, None, "Multi-modal cache queries, in terms of number of queried items."),
    "vllm:mm_cache_hits": ("counter", ENGINE, None, "Multi-modal cache hits, in terms of number of cached items."),
    "vllm:num_requests_running": ("gauge", ENGINE, None, "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", ENGINE, None, "Number of requests waiting to be processed."),
    "vllm:num_requests_waiting_by_reason": ("gauge", (*ENGINE, "reason"), None,
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = "
        "deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
        "vllm:num_requests_waiting."),
    "vllm:engine_sleep_state": ("gauge", (*ENGINE, "sleep_state"), None,
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 "
        "means sleep level 1; discard_all = 1 means sleep level 2."),
    "vllm:admission_rejections": ("counter", ("model_name", "reason"), None,
                                  "Number of admission attempts rejected by a queue limit, by reason."),
    "vllm:estimated_flops_per_gpu": ("counter", ENGINE, None,
                                     "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations)."),
    "vllm:estimated_read_bytes_per_gpu": ("counter", ENGINE, None,
                                          "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations)."),
    "vllm:estimated_write_bytes_per_gpu": ("counter", ENGINE, None,
                                           "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations)."),
}
# Label values every child is exported with from the start, as vLLM's.
LABEL_VALUES = {
    "vllm:prompt_tokens_by_source": ("source", {"local_compute", "local_cache_hit", "external_kv_transfer"}),
    "vllm:prompt_tokens_cached_by_source": ("source", {"device", "host", "p2p", "disk", "external_unspecified"}),
    "vllm:num_requests_waiting_by_reason": ("reason", {"capacity", "deferred"}),
    "vllm:admission_rejections": ("reason", {"max_num_queued_reqs", "max_num_queued_tokens"}),
    "vllm:engine_sleep_state": ("sleep_state", {"awake", "weights_offloaded", "discard_all"}),
}
# vLLM 0.32's CacheConfig.metrics_info() keys (CacheConfig().metrics_info()), and "engine".
CACHE_CONFIG_LABELS = [
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization", "cache_dtype",
    "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching", "prefix_caching_hash_algo",
    "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers", "mamba_page_size_padded", "skip_page_size_padded",
    "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len", "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks",
    "effective_attention_block_size", "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size",
    "cache_hit_alignment_tokens", "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved", "engine",
]
LABELS = {"model_name": "m", "engine": "0"}


def page(m: SchedulerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_is_vllms(name):
    kind, labels, buckets, doc = FAMILIES[name]
    family = page(SchedulerMetrics("m"))[name]
    assert family.type == kind
    assert family.documentation == doc
    samples = [s for s in family.samples if not s.name.endswith("_created")]
    assert samples, "no child exported"
    for s in samples:
        assert set(s.labels) - {"le"} == set(labels), s
    if buckets is not None:
        bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        assert bounds == [*map(float, buckets), INF]
    if name in LABEL_VALUES:
        label, values = LABEL_VALUES[name]
        assert {s.labels[label] for s in samples} == values


def test_always_awake():
    get = SchedulerMetrics("m").registry.get_sample_value
    states = {s: get("vllm:engine_sleep_state", {**LABELS, "sleep_state": s}) for s in ("awake", "weights_offloaded", "discard_all")}
    assert states == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_cache_config_info_has_vllms_labels_once_the_pool_exists():
    from scheduler.engine.cache_config_info import cache_config_info
    from scheduler.engine.config import SchedulerConfig

    m = SchedulerMetrics("m")
    assert "vllm:cache_config_info" not in page(m)
    config = SchedulerConfig(block_size=32, enable_prefix_caching=False, max_model_len=1000)
    m.set_cache_config_info(cache_config_info(config, 1000))
    m.set_cache_config_info(cache_config_info(config, 1000))  # once only
    family = page(m)["vllm:cache_config_info"]
    assert family.type == "gauge" and family.documentation == "Information of the LLMEngine CacheConfig"
    (sample,) = family.samples
    assert sorted(sample.labels) == sorted(CACHE_CONFIG_LABELS) and sample.value == 1.0
    assert sample.labels["block_size"] == "32" and sample.labels["enable_prefix_caching"] == "False"
    assert sample.labels["num_gpu_blocks"] == "1000" and sample.labels["engine"] == "0"
    assert sample.labels["prefix_caching_hash_algo"] == "kvpool_sha256" and sample.labels["kv_offloading_size"] == "None"
    # 1000 tokens take 32 blocks: 1000 / 32 = 31.25 such requests at once, 31250 tokens.
    assert sample.labels["kv_cache_max_concurrency"] == "31.25" and sample.labels["kv_cache_size_tokens"] == "31250"
    assert sample.labels["effective_attention_block_size"] == "32"
    # The page sorts labels (prometheus_client, as vLLM's page).
    assert 'vllm:cache_config_info{_block_size_resolved="True",block_size="32",' in m.render().decode()


# --- values after a known workload -------------------------------------------------------


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def value(m: SchedulerMetrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, {**LABELS, **labels})
    assert v is not None, (name, labels)
    return v


def policy(num_blocks: int, block_size: int = 4, caching: bool = True, reserve_full_sequence: bool = True):
    kv = KVCacheManager(num_blocks, block_size, 64, enable_caching=caching)
    return kv, Scheduler(kv, 8, 64, 64, reserve_full_sequence), FakeWorker(num_blocks, block_size, 64)


def request(request_id: str, prompt: list[int], max_tokens: int, seq_id: int, **kw) -> Request:
    return Request(request_id, prompt, max_tokens, seq_id=seq_id, block_hasher=BlockHasher(4), **kw)


def run_step(kv, sched, worker, m, clock, schedule_at: float, result_at: float) -> None:
    clock.t = schedule_at
    out = sched.schedule()
    assert out is not None
    clock.t = result_at
    outputs = sched.update_from_output(worker.execute(out.plan))
    m.observe_step(outputs, 0, 0.0)
    m.update(sched, kv)


def test_a_requests_phases_as_vllm_times_them(monkeypatch):
    clock = Clock(0.0)
    monkeypatch.setattr(time, "monotonic", clock)
    kv, sched, worker = policy(16)
    m = SchedulerMetrics("m")
    sched.add_request(request("r", list(range(2, 10)), 3, 0, arrival_time=100.0))  # 8 prompt tokens, 3 out
    run_step(kv, sched, worker, m, clock, 103.0, 104.5)  # admitted at 103, first token at 104.5
    run_step(kv, sched, worker, m, clock, 105.0, 105.5)
    run_step(kv, sched, worker, m, clock, 106.0, 106.5)  # its last token: it ends (length)
    assert not sched.has_unfinished_requests()
    # queue 103 - 100 = 3; prefill 104.5 - 103 = 1.5; decode 106.5 - 104.5 = 2;
    # inference 106.5 - 103 = 3.5; e2e 6.5; time per output token 2 / (3 - 1) = 1.
    for name, seconds, le_below, le_at in [
        ("vllm:request_queue_time_seconds", 3.0, "2.5", "5.0"), ("vllm:request_prefill_time_seconds", 1.5, "1.0", "1.5"),
        ("vllm:request_decode_time_seconds", 2.0, "1.5", "2.0"), ("vllm:request_inference_time_seconds", 3.5, "2.5", "5.0"),
        ("vllm:e2e_request_latency_seconds", 6.5, "5.0", "10.0"), ("vllm:request_time_per_output_token_seconds", 1.0, "0.75", "1.0"),
        ("vllm:time_to_first_token_seconds", 4.5, "2.5", "5.0"),
    ]:
        assert value(m, name + "_count") == 1, name
        assert value(m, name + "_sum") == pytest.approx(seconds), name
        assert value(m, name + "_bucket", le=le_below) == 0 and value(m, name + "_bucket", le=le_at) == 1, name
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2  # two gaps of 1 s
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(2.0)
    # Steps: 8 prompt tokens computed + 1 token, then 1 and 1.
    assert value(m, "vllm:iteration_tokens_total_count") == 3 and value(m, "vllm:iteration_tokens_total_sum") == 11
    assert value(m, "vllm:iteration_tokens_total_bucket", le="1.0") == 2 and value(m, "vllm:iteration_tokens_total_bucket", le="8.0") == 2
    assert value(m, "vllm:iteration_tokens_total_bucket", le="16.0") == 3
    assert value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 8
    assert value(m, "vllm:request_num_preemptions_sum") == 0 and value(m, "vllm:request_num_preemptions_bucket", le="1.0") == 1
    assert value(m, "vllm:prompt_tokens_total") == 8 and value(m, "vllm:generation_tokens_total") == 3


def test_preemptions_in_a_tiny_pool(monkeypatch):
    monkeypatch.setattr(time, "monotonic", Clock(0.0))
    # 3 usable blocks of 4 tokens; a and b (4-token prompts, 5 tokens out: 9 tokens, 3
    # blocks each at the end) both get in, a block each (the whole sequence need not fit).
    # Step 2: each needs a second block for its 5th token; a takes the last free one, b
    # (the last running) preempts itself. Steps 3-5: a stays within its 8 slots up to its
    # 5th output (9 tokens) and ends; b, needing 2 blocks, waits till then, is recomputed
    # and finds its 3rd block free.
    kv, sched, worker = policy(4, caching=False, reserve_full_sequence=False)
    m = SchedulerMetrics("m")
    sched.add_request(request("a", [2, 3, 4, 5], 5, 0))
    sched.add_request(request("b", [6, 7, 8, 9], 5, 1))
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out is not None:
            m.observe_step(sched.update_from_output(worker.execute(out.plan)), 0, 0.0)
        steps += 1
        assert steps < 50
    m.update(sched, kv)
    assert value(m, "vllm:num_preemptions_total") == 1
    assert value(m, "kvpool_worker_loss_recomputes_total") == 0
    # Per finished request: a 0, b 1 (vLLM's first bucket, le=1, holds both).
    assert value(m, "vllm:request_num_preemptions_count") == 2 and value(m, "vllm:request_num_preemptions_sum") == 1
    assert value(m, "vllm:request_num_preemptions_bucket", le="1.0") == 2
    # Prompt tokens count once per request, at its first token, though b's prompt was computed twice.
    assert value(m, "vllm:prompt_tokens_total") == 8
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 8
    assert value(m, "vllm:generation_tokens_total") == 10


def test_a_lost_workers_recomputes_are_not_preemptions(monkeypatch):
    monkeypatch.setattr(time, "monotonic", Clock(0.0))
    kv, sched, worker = policy(32)
    m = SchedulerMetrics("m")
    sched.add_request(request("a", list(range(2, 12)), 4, 0))  # 10 tokens: 2 full blocks
    sched.add_request(request("b", list(range(20, 26)), 4, 1))  # 6 tokens: 1 full block
    out = sched.schedule()
    m.observe_step(sched.update_from_output(worker.execute(out.plan)), 0, 0.0)  # both have their first token
    sched.schedule()  # in flight when the worker is lost (as worker_side does it)
    sched.abandon_in_flight()
    sched.preempt_all()
    assert kv.reset_prefix_cache()
    worker = FakeWorker(32, 4, 64)  # the next worker: the requests come back to it as resumed rows
    worker.expected_step, worker.preempted = sched.next_step_id, {0, 1}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        m.observe_step(sched.update_from_output(worker.execute(out.plan)), 0, 0.0)
    m.update(sched, kv)
    assert value(m, "kvpool_worker_loss_recomputes_total") == 2
    assert value(m, "vllm:num_preemptions_total") == 0
    assert value(m, "vllm:request_num_preemptions_count") == 2 and value(m, "vllm:request_num_preemptions_sum") == 0
    # Resumed, not new: their second lookups are counted apart, and the prompts once.
    assert value(m, "vllm:prefix_cache_queries_total") == 16
    assert value(m, "kvpool_prefix_cache_preempted_queries_total") == 11 + 7
    assert value(m, "vllm:prompt_tokens_total") == 16
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 16


def test_cache_config_info_names_the_kv_cache_dtype_as_given():
    from scheduler.engine.args import config_from_args
    from scheduler.engine.cache_config_info import cache_config_info
    from scheduler.engine.config import SchedulerConfig

    assert cache_config_info(SchedulerConfig(), 100)["cache_dtype"] == "auto"
    # vLLM's CacheConfig keeps the name it was given (fp8 is not spelled fp8_e4m3 there).
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert cache_config_info(config_from_args(["--kv-cache-dtype", name]), 100)["cache_dtype"] == name
