"""The client port under hostile input: thousands of bad frames from several
DEALER sockets at once, while a well-behaved client is being served.

Each frame that can be answered gets exactly one RequestError, naming the request
whenever the frame is a map with a string request_id (refused for a bad field, a
wrong shape or its size, so that its refusal reaches whoever waits on it), else
request_id None: random bytes, every truncation of valid frames, valid msgpack of the
wrong shape, worker messages on the client port, multi-part garbage, frames just
over --max-frame-bytes (the error names the limit) and a flood sent without
reading. Frames over 4 x --max-frame-bytes make ZeroMQ drop that connection (no
reply); the DEALER reconnects by itself and is served again. Through all of it the
scheduler's RSS stays bounded, the good client's request completes, and afterwards
a fresh client is served and nothing is left holding a block.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq
from kvtest.cluster import Cluster
from kvtest.hostile_frames import (
    BATCH,
    LIMIT,
    MAX_MODEL_LEN,
    NONE,
    RSS_GROWTH_LIMIT_KB,
    VOCAB,
    Case,
    multipart,
    one,
    over_limit,
    random_frames,
    replies,
    requests,
    truncations,
    worker_messages,
    wrong_shapes,
)
from kvtest.replies import Replies
from prometheus_client.parser import text_string_to_metric_families

from protocol.client_messages import (
    Abort,
    Generate,
    RequestError,
    TokenOutput,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def recv_reply(sock: zmq.Socket, timeout_s: float):
    """One frame of a hostile client (it has no requests: only RequestErrors)."""
    assert sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
    return replies.decode(sock.recv())


def check_reply(reply, case: Case) -> None:
    assert isinstance(reply, RequestError), reply
    assert reply.request_id in case.ids, (reply, case.parts[0][:60])
    assert case.words in reply.message, (reply.message, case.words)


def ordered_client(c: Cluster, cases: list[Case], counts: dict, name: str) -> None:
    """Send in batches; each batch's replies come back one per frame, in order."""
    sock = c.client()
    try:
        for start in range(0, len(cases), BATCH):
            batch = cases[start : start + BATCH]
            for case in batch:
                sock.send_multipart(case.parts)
            for case in batch:
                check_reply(recv_reply(sock, 10), case)
            counts[name] += len(batch)
        assert not sock.poll(300), f"an extra reply: {replies.decode(sock.recv())}"
    finally:
        sock.close(linger=0)


def flooding_client(c: Cluster, cases: list[Case], counts: dict, name: str) -> None:
    """Send everything without reading, then read: still one reply per frame."""
    sock = c.client()
    try:
        for case in cases:
            sock.send_multipart(case.parts)
        for case in cases:
            check_reply(recv_reply(sock, 20), case)
            counts[name] += 1
        assert not sock.poll(300), f"an extra reply: {replies.decode(sock.recv())}"
    finally:
        sock.close(linger=0)


def oversize_client(c: Cluster, rng: random.Random, counts: dict, name: str) -> None:
    """Frames over 4 x the limit: ZeroMQ drops the connection, no reply; the DEALER
    reconnects by itself and its next frames are answered."""
    sock = c.client()
    probe = one(b"\xc1")
    try:
        sock.send(probe.parts[0])
        check_reply(recv_reply(sock, 10), probe)
        for size in (4 * LIMIT + 1, 5 * LIMIT, 16 * LIMIT):
            sock.send(rng.randbytes(size))
            # Probes sent while the connection is being dropped may be lost with it.
            for _ in range(40):
                sock.send(probe.parts[0])
                if sock.poll(500):
                    break
            else:
                raise AssertionError(f"no reply within 20 s after a {size}-byte frame: the DEALER did not get back")
            while sock.poll(300):
                reply = replies.decode(sock.recv())
                check_reply(reply, probe)
                assert "limit" not in reply.message, "a frame over 4 x the limit was answered, so it was buffered"
            counts[name] += 1
    finally:
        sock.close(linger=0)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_thousands_of_hostile_frames_each_answered_once_and_the_port_survives(tmp_path):
    rng = random.Random(2024)
    shapes = wrong_shapes(rng)
    ordered = random_frames(rng, 900) + truncations() + shapes + worker_messages(rng) + multipart(rng, 300) + over_limit(rng)
    rng.shuffle(ordered)
    shares = [ordered[i::3] for i in range(3)]
    flood = random_frames(rng, 600) + multipart(rng, 200) + shapes[:200]
    total = len(ordered) + len(flood)
    assert total > 4000

    with Cluster(["--max-frame-bytes", str(LIMIT), "--max-model-len", str(MAX_MODEL_LEN)], log_dir=tmp_path) as c:
        pid = c.procs["scheduler"].pid
        # Warm up (first request, first metrics) so the RSS baseline is the serving state.
        assert c.generate([Generate("warm", [3, 4, 5], 4, ignore_eos=True)])["warm"].finish_reason == "length"
        c.metrics()
        rss_before = rss_kb(pid)
        # A well-behaved client with a request in flight during the whole flood.
        good = c.client()
        good.send(requests.encode(Generate("good", [rng.randrange(2, VOCAB) for _ in range(50)], 300, ignore_eos=True)))

        counts = {f"ordered-{i}": 0 for i in range(3)} | {"flood": 0, "oversize": 0}
        errors: list[BaseException] = []
        rss_max = [rss_before]
        done = threading.Event()

        def guarded(fn, *args):
            try:
                fn(*args)
            except BaseException as e:  # reported after join
                errors.append(e)

        def sample_rss():
            while not done.wait(0.02):
                rss_max[0] = max(rss_max[0], rss_kb(pid))

        threads = [threading.Thread(target=guarded, args=(ordered_client, c, share, counts, f"ordered-{i}")) for i, share in enumerate(shares)]
        threads += [
            threading.Thread(target=guarded, args=(flooding_client, c, flood, counts, "flood")),
            threading.Thread(target=guarded, args=(oversize_client, c, random.Random(9), counts, "oversize")),
        ]
        sampler = threading.Thread(target=sample_rss)
        t0 = time.monotonic()
        for t in [*threads, sampler]:
            t.start()
        for t in threads:
            t.join(90)
        flood_s = time.monotonic() - t0
        done.set()
        sampler.join(5)
        assert not any(t.is_alive() for t in threads), "a hostile client hung"
        if errors:
            raise errors[0]
        assert sum(counts.values()) == total + 3, counts
        rss_after = rss_kb(pid)

        # The good client's request ran to the end through the flood.
        tokens: list[int] = []
        good_replies = Replies(good)
        while True:
            msg = good_replies.recv(60)
            assert isinstance(msg, TokenOutput) and msg.request_id == "good", msg
            tokens += msg.new_token_ids
            if msg.finished:
                break
        good.close(linger=0)
        assert msg.finish_reason == "length" and len(tokens) == 300

        assert c.procs["scheduler"].poll() is None
        fresh = c.generate([Generate("after", [rng.randrange(2, VOCAB) for _ in range(40)], 20, ignore_eos=True)], timeout=30)["after"]
        assert fresh.error is None and fresh.finish_reason == "length" and len(fresh.token_ids) == 20
        assert c.health() == 200
        m = c.metrics()
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0

    growth = rss_max[0] - rss_before
    print(f"{total} hostile frames in {flood_s:.1f} s; scheduler RSS {rss_before} kB -> max {rss_max[0]} kB, after {rss_after} kB")
    assert growth < RSS_GROWTH_LIMIT_KB, f"scheduler RSS grew by {growth} kB during the flood"


def itl_over(c: Cluster, seconds: float) -> int:
    """Inter-token gaps longer than ``seconds`` the scheduler has observed."""
    buckets, count = {}, 0.0
    for family in text_string_to_metric_families(c.metrics_text()):
        for s in family.samples:
            if s.name == "vllm:inter_token_latency_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == "vllm:inter_token_latency_seconds_count":
                count = s.value
    return int(count - buckets[seconds])


def test_one_message_of_many_empty_frames_is_counted_not_held(tmp_path):
    """MAXMSGSIZE bounds a frame, not how many frames one message has: 600,000
    empty frames are 1.2 MB on the wire. The scheduler answers once, its memory
    grows by no more than ZeroMQ's own buffering, and its loop never stalls (a
    request decoding beside it never waits a second for a token)."""
    n = 600_000
    with Cluster(["--max-frame-bytes", str(LIMIT)], log_dir=tmp_path) as c:
        pid = c.procs["scheduler"].pid
        assert c.generate([Generate("warm", [3, 4, 5], 4, ignore_eos=True)])["warm"].finish_reason == "length"
        c.metrics_text()
        rss_before = rss_kb(pid)
        good = c.client()
        good.send(requests.encode(Generate("good", list(range(2, 42)), 3000, ignore_eos=True)))
        good_replies = Replies(good)
        assert isinstance(good_replies.recv(30), TokenOutput)

        rss_max = [rss_before]
        done = threading.Event()

        def sample_rss():
            while not done.wait(0.02):
                rss_max[0] = max(rss_max[0], rss_kb(pid))

        sampler = threading.Thread(target=sample_rss)
        sampler.start()
        try:
            bad = c.client()
            bad.send_multipart([b""] * n)
            check_reply(recv_reply(bad, 60), Case([], NONE, f"expected one frame per message, got {n}"))
            assert not bad.poll(300)
            bad.close(linger=0)
        finally:
            done.set()
            sampler.join(5)

        good.send(requests.encode(Abort("good")))
        while not (msg := good_replies.recv(30)).finished:
            assert isinstance(msg, TokenOutput)
        assert msg.finish_reason == "abort"
        good.close(linger=0)
        assert itl_over(c, 1.0) == 0, "the scheduler's loop stalled for a second or more"
        assert c.health() == 200
        assert c.generate([Generate("after", [3, 4, 5], 8, ignore_eos=True)])["after"].finish_reason == "length"
    growth = rss_max[0] - rss_before
    print(f"{n} empty frames: scheduler RSS {rss_before} kB -> max {rss_max[0]} kB")
    # ZeroMQ itself holds a message whole until it is read: about 64 bytes a frame.
    assert growth < n * 100 // 1024, f"scheduler RSS grew by {growth} kB"
