"""The host tier in `python -m scheduler` as a real process: the handshake sizes it
from the worker's hello (or refuses a worker with none), plans carry its copies
(run and checked by the fake worker's KV model), /metrics shows the hits by tier,
and a reset leaves nothing to hit in either tier."""

from __future__ import annotations

import time

import pytest
import zmq
from kvtest.scheduler_harness import (
    BS,
    EOS,
    VOCAB,
    SchedulerProcess,
    Setup,
    expected_tokens,
    metric,
    prompt_of,
    tokens_of,
)

from protocol.codec import Codec
from protocol.worker_messages import (
    SchedulerToWorker,
    Shutdown,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NUM_BLOCKS = 12  # 11 usable: a 4-block prefix and its tail fit about twice
NUM_HOST_BLOCKS = 32


def cycle(setup: Setup, rounds: int, num_prefixes: int = 4) -> None:
    """Each prefix (4 blocks) with its own tail, one request at a time, ``rounds`` times."""
    for r in range(rounds):
        for p in range(num_prefixes):
            prompt = prompt_of(p, 4 * BS) + [2 + r, 3 + p]
            outs = setup.client.generate(f"r{r}-{p}", prompt, 3)
            assert tokens_of(outs) == expected_tokens(prompt, 3)


def test_a_working_set_over_the_device_hits_in_the_host_tier_and_metrics_say_so():
    s = Setup("--kv-offloading-size", "1", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1", "--dev-mode",
              start_worker=False)
    try:
        w = s.start_worker(num_host_blocks=NUM_HOST_BLOCKS)
        assert [r.num_host_blocks for r in w.readies] == [NUM_HOST_BLOCKS]
        cycle(s, 2)
        assert w.errors == []  # every read the fake worker checked held its own KV
        m = s.wait_idle()
        # Round 2: every prefix was evicted from the device, and each is loaded back.
        loads = metric(m, "kvpool_kv_offload_loaded_blocks_total")
        assert loads >= 4 * 4
        ext_hits = metric(m, "vllm:external_prefix_cache_hits_total")
        assert ext_hits == loads * BS
        queries = metric(m, "vllm:prefix_cache_queries_total")
        assert queries == 8 * (4 * BS + 2)
        local_hits = metric(m, "vllm:prefix_cache_hits_total")
        assert metric(m, "vllm:external_prefix_cache_queries_total") == queries - local_hits
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') == ext_hits
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') == local_hits
        assert metric(m, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') == queries - local_hits - ext_hits
        assert metric(m, "kvpool_kv_offload_stored_blocks_total") >= loads
        assert metric(m, "kvpool_kv_offload_num_cpu_blocks") == NUM_HOST_BLOCKS
        # Idle: no transfer in flight (vLLM's usage counts pinned slots), the device empty.
        assert metric(m, "vllm:kv_offload_cpu_cache_usage_perc") == 0.0
        assert metric(m, "vllm:kv_cache_usage_perc") == 0.0
        assert metric(m, "kvpool_kv_offload_cpu_cached_blocks") > 0
        # A reset clears both tiers: the same prompt then hits nowhere.
        assert s.sched.http("POST", "/reset_prefix_cache")[0] == 200
        m = s.sched.metrics()
        assert metric(m, "kvpool_kv_offload_cpu_cached_blocks") == 0
        before = metric(m, "vllm:prefix_cache_hits_total"), metric(m, "vllm:external_prefix_cache_hits_total")
        prompt = prompt_of(0, 4 * BS) + [2, 3]
        assert tokens_of(s.client.generate("again", prompt, 3)) == expected_tokens(prompt, 3)
        m = s.wait_idle()
        assert (metric(m, "vllm:prefix_cache_hits_total"), metric(m, "vllm:external_prefix_cache_hits_total")) == before
    finally:
        s.close()


def test_without_the_flag_the_worker_is_told_to_free_its_host_blocks():
    s = Setup("--num-gpu-blocks-override", str(NUM_BLOCKS), start_worker=False)
    try:
        w = s.start_worker(num_host_blocks=NUM_HOST_BLOCKS)
        assert [r.num_host_blocks for r in w.readies] == [0]
        cycle(s, 1, num_prefixes=2)
        assert w.errors == []
        m = s.wait_idle()
        assert metric(m, "vllm:external_prefix_cache_hits_total") == 0
        with pytest.raises(KeyError):
            metric(m, "vllm:kv_offload_cpu_cache_usage_perc")
    finally:
        s.close()


def test_a_worker_offering_no_host_blocks_is_refused_naming_the_flag():
    sched = SchedulerProcess("--kv-offloading-size", "2")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sched.wait_http()
        sock.connect(sched.worker_address)
        sock.send(Codec(WorkerToScheduler).encode(
            WorkerHello(rank=0, world_size=1, num_blocks=64, block_size=BS, vocab_size=VOCAB, eos_token_id=EOS)
        ))
        deadline = time.monotonic() + 10
        reply = None
        while time.monotonic() < deadline and not isinstance(reply, Shutdown | WorkerReady):
            if sock.poll(500):
                reply = Codec(SchedulerToWorker).decode(sock.recv())
        assert isinstance(reply, Shutdown), reply
        assert "--kv-offloading-size 2 GiB" in reply.reason and "offers no host KV blocks" in reply.reason
        assert sched.http("GET", "/health")[0] == 503
    finally:
        sock.close(linger=0)
        sched.stop()
        ctx.term()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-offloading-size", "-1"], "a number of GiB"),
        (["--kv-offloading-size", "nan"], "a number of GiB"),
        (["--kv-offloading-size", "inf"], "a number of GiB"),
        (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "needs the prefix cache"),
        (["--kv-offloading-store", "sometimes"], "invalid choice"),
    ],
)
def test_bad_offloading_flags_are_refused(argv, words, capsys):
    from scheduler.engine.args import config_from_args

    with pytest.raises(SystemExit):
        config_from_args(argv)
    assert words in capsys.readouterr().err


def test_offloading_flags_reach_the_config():
    from scheduler.engine.args import config_from_args

    c = config_from_args(["--kv-offloading-size", "4", "--kv-offloading-store", "full"])
    assert c.kv_offloading_size == 4.0 and c.kv_offloading_store == "full"
    d = config_from_args([])
    assert d.kv_offloading_size == 0.0 and d.kv_offloading_store == "eviction"


def test_a_lost_worker_voids_the_host_tier_too():
    s = Setup("--kv-offloading-size", "1", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1",
              "--worker-timeout", "2", start_worker=False)
    try:
        w = s.start_worker(num_host_blocks=NUM_HOST_BLOCKS)
        cycle(s, 1)
        m = s.wait_idle()
        assert metric(m, "kvpool_kv_offload_cpu_cached_blocks") > 0
        w.leave("test")
        s.sched.wait_health(503)
        m = s.sched.metrics()
        # Its host memory's contents are as unknown as its device's: both tiers are empty.
        assert metric(m, "kvpool_kv_offload_cpu_cached_blocks") == 0
        assert metric(m, "kvpool_cached_block_hashes") == 0
        w.close()
        w2 = s.start_worker(num_host_blocks=NUM_HOST_BLOCKS + 8)
        assert w2.readies[-1].num_host_blocks == NUM_HOST_BLOCKS  # the tier keeps its size
        before = metric(m, "vllm:external_prefix_cache_hits_total"), metric(m, "vllm:prefix_cache_hits_total")
        cycle(s, 1)  # the same prompts again: nothing of them is left to hit
        assert w2.errors == []
        m = s.wait_idle()
        assert (metric(m, "vllm:external_prefix_cache_hits_total"), metric(m, "vllm:prefix_cache_hits_total")) == before
    finally:
        s.close()


def test_kv_events_tell_a_subscriber_what_each_tier_holds():
    from kvtest.cluster import free_port

    from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, batch_codec

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    s = Setup("--kv-offloading-size", "1", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1", "--dev-mode",
              "--kv-events-endpoint", endpoint, start_worker=False)
    sub = s.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    held: dict[str, set] = {"GPU": set(), "CPU": set()}
    codec = batch_codec()

    def drain(until, bound_s: float = 10.0) -> None:
        deadline = time.monotonic() + bound_s
        while not until() and time.monotonic() < deadline:
            if not sub.poll(200):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            for e in codec.decode(payload).events:
                match e:
                    case BlockStored():
                        assert not held[e.medium] & set(e.block_hashes), "stored twice without a removal"
                        held[e.medium] |= set(e.block_hashes)
                        if e.medium == "CPU":  # as vLLM's offloading connector: no parent, no tokens
                            assert e.parent_block_hash is None and e.token_ids == [] and e.block_size == BS
                    case BlockRemoved():
                        assert set(e.block_hashes) <= held[e.medium]
                        held[e.medium] -= set(e.block_hashes)
                    case AllBlocksCleared():
                        held["GPU"].clear()

    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        s.start_worker(num_host_blocks=NUM_HOST_BLOCKS)
        cycle(s, 2)
        m = s.wait_idle()
        num_cpu = metric(m, "kvpool_kv_offload_cpu_cached_blocks")
        num_gpu = metric(m, "kvpool_cached_block_hashes")
        drain(lambda: len(held["CPU"]) == num_cpu and len(held["GPU"]) == num_gpu)
        assert len(held["CPU"]) == num_cpu > 0 and len(held["GPU"]) == num_gpu > 0
        assert s.sched.http("POST", "/reset_prefix_cache")[0] == 200
        drain(lambda: not held["CPU"] and not held["GPU"])
        assert held == {"GPU": set(), "CPU": set()}
    finally:
        sub.close(linger=0)
        s.close()
