"""``--kv-events-config JSON``: vLLM's KVEventsConfig as the scheduler's KV events flags.

vLLM's fields and defaults (vllm/config/kv_events.py): ``enable_kv_cache_events``
(False), ``publisher`` ("zmq" when enabled, else "null"), ``endpoint``
("tcp://*:5557"), ``replay_endpoint`` (None), ``buffer_steps`` (10000), ``hwm``
(100000), ``max_queue_size`` (100000), ``topic`` (""). As vLLM's ZmqEventPublisher,
both endpoints would be offset by a data-parallel rank (a tcp port plus the rank, an
inproc name with ``_dpN``; ``kvpool serve``'s rank is always 0, so they are not), and the PUB socket binds a wildcard (``*``, ``::``),
ipc:// or inproc:// endpoint and connects to any other (the scheduler's
``--kv-events-endpoint-mode vllm``); the replay socket always binds.

NOTE: ``max_queue_size`` is checked and has nothing to bound: vLLM queues events for a
publishing thread, kvpool's step loop publishes each batch itself, without a queue. It
is passed on only to be reported, as vLLM does, in ``/kv_event_sources``.
"""

from __future__ import annotations

import ipaddress
import json

DEFAULTS = {"enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557", "replay_endpoint": None,
            "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000, "topic": ""}
_INTS = ("buffer_steps", "hwm", "max_queue_size")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's ZmqEventPublisher._is_bind_endpoint: bind wildcard and ipc/inproc endpoints."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's: the endpoint of data-parallel rank N (port + N; inproc name + _dpN; port 0 kept)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if "tcp" not in endpoint or not port.isdigit():
        raise ValueError(f"--kv-events-config: endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"


def _binds_beyond_loopback(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def parse(text: str) -> dict:
    """The config's fields, vLLM's defaults filled in; ValueError naming a bad one."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(given, dict):
        raise ValueError("--kv-events-config: expected a JSON object, e.g. '{\"enable_kv_cache_events\": true}'")
    if unknown := sorted(set(given) - set(DEFAULTS)):
        raise ValueError(f"--kv-events-config: unknown field {unknown[0]!r} (fields: {', '.join(DEFAULTS)})")
    c = DEFAULTS | given
    if not isinstance(c["enable_kv_cache_events"], bool):
        raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
    if c["publisher"] is None:
        c["publisher"] = "zmq" if c["enable_kv_cache_events"] else "null"
    if c["publisher"] not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown publisher {c['publisher']!r} (zmq or null)")
    for name in _INTS:
        if isinstance(c[name], bool) or not isinstance(c[name], int) or c[name] < 1:
            raise ValueError(f"--kv-events-config: {name} must be a positive integer, got {c[name]!r}")
    for name in ("endpoint", "topic") + (("replay_endpoint",) if c["replay_endpoint"] is not None else ()):
        if not isinstance(c[name], str):
            raise ValueError(f"--kv-events-config: {name} must be a string, got {c[name]!r}")
    return c


def kv_events_scheduler_flags(text: str, data_parallel_rank: int, scheduler_args: list[str]) -> list[str]:
    """The scheduler's flags for the config ``text``; [] when it publishes nothing."""
    c = parse(text)
    if not c["enable_kv_cache_events"] or c["publisher"] == "null":
        return []
    endpoint = offset_endpoint_port(c["endpoint"], data_parallel_rank)
    replay = offset_endpoint_port(c["replay_endpoint"], data_parallel_rank)
    curve = "--curve-secret-key" in scheduler_args
    for what, ep, binds in (("endpoint", endpoint, is_bind_endpoint(endpoint)), ("replay_endpoint", replay, True)):
        if ep is not None and binds and _binds_beyond_loopback(ep) and not curve:
            raise ValueError(
                f"--kv-events-config: {what} {ep} would be bound on every interface, and kvpool publishes KV events "
                "unauthenticated on loopback only: connect to a subscriber (tcp://HOST:PORT), use ipc://, kvpool's "
                "--kv-events-endpoint tcp://127.0.0.1:PORT, or CURVE (--scheduler-args '--curve-secret-key ...')"
            )
    flags = ["--kv-events-endpoint", endpoint, "--kv-events-endpoint-mode", "vllm", "--kv-events-topic", c["topic"],
             "--kv-events-buffer-steps", str(c["buffer_steps"]), "--kv-events-hwm", str(c["hwm"]),
             "--kv-events-max-queue-size", str(c["max_queue_size"])]
    return flags + (["--kv-events-replay-endpoint", replay] if replay is not None else [])
