"""What the scheduler tells its frontend about the engine (GET /engine_info on its HTTP port):
the facts a KV-aware router needs and only the scheduler knows.

* ``cache_config``: vLLM's CacheConfig fields a router reads (block size, whether
  prefix caching is on, its hash algorithm);
* ``data_parallel_rank``: the rank stamped on every KV event batch;
* ``kv_events_config``: the publisher's resolved configuration (vLLM's KVEventsConfig,
  as its ZmqEventPublisher.get_publisher_config() gives it: the endpoints after the
  rank offset), or None when no events are published.

The frontend turns these into vLLM's ``/kv_event_sources`` and the ``vllm_config`` of
``/get_server_info`` (frontend/routes/router_probes.py).
"""

from __future__ import annotations

from scheduler.engine.config import SchedulerConfig


def kv_events_config(config: SchedulerConfig) -> dict | None:
    """vLLM's KVEventsConfig of this engine's publisher, field for field; None without one."""
    if config.kv_events_endpoint is None:
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": config.kv_events_endpoint,
            "replay_endpoint": config.kv_events_replay_endpoint, "buffer_steps": config.kv_events_buffer_steps,
            "hwm": config.kv_events_hwm, "max_queue_size": config.kv_events_max_queue_size, "topic": config.kv_events_topic}


def engine_info(config: SchedulerConfig) -> dict:
    return {
        "cache_config": {"block_size": config.block_size, "enable_prefix_caching": config.enable_prefix_caching,
                         "prefix_caching_hash_algo": config.prefix_caching_hash_algo},
        "data_parallel_rank": config.data_parallel_rank,
        "kv_events_config": kv_events_config(config),
    }
