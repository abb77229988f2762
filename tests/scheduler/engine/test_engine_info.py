"""GET /engine_info's answer (scheduler/engine/engine_info.py): vLLM's KVEventsConfig of the
publisher as the scheduler resolved it (what the frontend's /kv_event_sources serves, as
vLLM's ZmqEventPublisher.get_publisher_config()), the cache config a router reads, the rank."""

from __future__ import annotations

from scheduler.engine.args import config_from_args
from scheduler.engine.engine_info import engine_info


def test_without_kv_events_there_is_no_publisher_config():
    info = engine_info(config_from_args([]))
    assert info == {"cache_config": {"block_size": 16, "enable_prefix_caching": True, "prefix_caching_hash_algo": "kvpool_sha256"},
                    "data_parallel_rank": 0, "kv_events_config": None}


def test_the_publisher_config_has_vllms_fields_as_resolved():
    c = config_from_args(["--kv-events-endpoint", "tcp://127.0.0.1:5600", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5601",
                          "--kv-events-topic", "kv@a@m", "--kv-events-buffer-steps", "7", "--kv-events-hwm", "9",
                          "--kv-events-max-queue-size", "11", "--block-size", "32", "--prefix-caching-hash-algo", "sha256_cbor"])
    info = engine_info(c)
    # vLLM's KVEventsConfig, field for field (vllm/config/kv_events.py)
    assert info["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5600",
                                        "replay_endpoint": "tcp://127.0.0.1:5601", "buffer_steps": 7, "hwm": 9,
                                        "max_queue_size": 11, "topic": "kv@a@m"}
    assert info["cache_config"]["block_size"] == 32 and info["cache_config"]["prefix_caching_hash_algo"] == "sha256_cbor"
