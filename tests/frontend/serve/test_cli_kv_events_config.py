"""``kvpool serve --kv-events-config JSON`` (vLLM's KVEventsConfig): the scheduler's
flags it becomes, the scheduler's config built from them, and the publisher that
config makes, reaching real ZeroMQ subscribers as vLLM's would (it connects to a SUB
that binds, binds where a SUB connects)."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from kvtest.ports import free_port

from frontend.serve.cli import main, parse_serve
from frontend.serve.launcher import Launcher
from scheduler.core.kv_events import AllBlocksCleared
from scheduler.engine.args import config_from_args
from scheduler.engine.kv_event_publisher import make_kv_event_sink


def scheduler_argv(config: dict, *more: str) -> list[str]:
    la = Launcher(parse_serve(["serve", "m", "--kv-events-config", json.dumps(config), *more]), log=lambda *a, **k: None)
    la.build()
    return la.children["scheduler"].argv[3:]  # after: python -m scheduler


def publisher_of(argv: list[str]):
    """The publisher the scheduler would make from ``argv`` (engine_core's call)."""
    c = config_from_args(argv)
    _sink, pub = make_kv_event_sink(
        None, c.kv_events_endpoint, c.kv_events_replay_endpoint, c.kv_events_topic, c.kv_events_buffer_steps,
        int_block_hashes=c.kv_events_int_block_hashes, data_parallel_rank=c.data_parallel_rank,
        endpoint_mode=c.kv_events_endpoint_mode, hwm=c.kv_events_hwm,
    )
    return c, pub


def first_batch(pub, sub: zmq.Socket) -> list[bytes]:
    deadline = time.monotonic() + 10
    while not sub.poll(50):  # slow joiner: publish until the subscription is in
        assert time.monotonic() < deadline, "no batch within 10 s"
        pub.publish([AllBlocksCleared()])
    return sub.recv_multipart()


def test_vllms_fields_become_the_schedulers_flags():
    argv = scheduler_argv({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://router:5557",
                           "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv", "buffer_steps": 50, "hwm": 7,
                           "max_queue_size": 9})
    c = config_from_args(argv)
    assert c.kv_events_max_queue_size == 9  # reported back in /kv_event_sources, as vLLM
    assert (c.kv_events_endpoint, c.kv_events_endpoint_mode, c.kv_events_replay_endpoint) == ("tcp://router:5557", "vllm", "tcp://127.0.0.1:5558")
    assert (c.kv_events_topic, c.kv_events_buffer_steps, c.kv_events_hwm) == ("kv", 50, 7)


def test_a_data_parallel_rank_would_offset_both_ports_as_vllm():
    # NOTE: vLLM's ZmqEventPublisher rule; kvpool serve's rank is always 0 (no offset), see test_cli_refusals.
    from frontend.serve.flags.kv_events_config import offset_endpoint_port

    assert offset_endpoint_port("tcp://router:5557", 2) == "tcp://router:5559"
    assert offset_endpoint_port("inproc://ev", 2) == "inproc://ev_dp2" and offset_endpoint_port("tcp://h:0", 2) == "tcp://h:0"
    assert offset_endpoint_port("tcp://router:5557", 0) == "tcp://router:5557"


@pytest.mark.parametrize("config", [{}, {"enable_kv_cache_events": False}, {"enable_kv_cache_events": True, "publisher": "null"}])
def test_no_events_without_enable_or_with_the_null_publisher(config):
    assert not any(a.startswith("--kv-events") for a in scheduler_argv(config))


def test_the_scheduler_connects_to_a_subscriber_that_binds():
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub = None
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port}")
        c, pub = publisher_of(scheduler_argv({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "t"},
                                             "--data-parallel-rank", "0"))
        topic, _seq, payload = first_batch(pub, sub)
        assert topic == b"t" and msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        if pub is not None:
            pub.close()
        sub.close(linger=0)
        ctx.term()


def test_the_scheduler_binds_an_ipc_endpoint_a_subscriber_connects_to(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv.sock"
    _c, pub = publisher_of(scheduler_argv({"enable_kv_cache_events": True, "endpoint": endpoint}))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        topic, _seq, _payload = first_batch(pub, sub)
        assert topic == b""
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"enable_kv_cache_events": True}, "endpoint tcp://*:5557 would be bound on every interface"),  # vLLM's default endpoint
        ({"enable_kv_cache_events": True, "endpoint": "tcp://[::]:5557"}, "would be bound on every interface"),
        ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558", "endpoint": "tcp://r:1"}, "replay_endpoint tcp://*:5558"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "unknown publisher 'kafka'"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm must be a positive integer, got 0"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
        ({"enable_kv_cache_events": True, "endpont": "tcp://r:1"}, "unknown field 'endpont'"),
    ],
    ids=["vllm-default-wildcard", "ipv6-wildcard", "wildcard-replay", "publisher", "hwm", "enable", "typo"],
)
def test_a_config_kvpool_cannot_honour_is_named_before_anything_starts(tmp_path, capsys, config, words):
    assert_refused(tmp_path, capsys, json.dumps(config), words)


def test_not_json_is_named(tmp_path, capsys):
    assert_refused(tmp_path, capsys, "{enable_kv_cache_events: true}", "--kv-events-config is not valid JSON")


def test_it_and_kvpools_own_endpoint_flag_do_not_mix(tmp_path, capsys):
    assert_refused(tmp_path, capsys, '{"enable_kv_cache_events": true, "endpoint": "tcp://r:1"}',
                   "--kv-events-config and --kv-events-endpoint both configure", "--kv-events-endpoint", "tcp://127.0.0.1:5557")


def test_with_curve_the_wildcard_is_left_to_the_schedulers_authentication():
    argv = scheduler_argv({"enable_kv_cache_events": True}, "--scheduler-args", "--curve-secret-key k.key_secret --curve-authorized-keys d")
    assert argv[argv.index("--kv-events-endpoint") + 1] == "tcp://*:5557"


def assert_refused(tmp_path, capsys, config: str, words: str, *more: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--kv-events-config", config, "--log-dir", str(tmp_path / "logs"), *more])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()
