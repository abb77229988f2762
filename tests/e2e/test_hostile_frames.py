"""The client port under hostile input: thousands of bad frames from several
DEALER sockets at once, while a well-behaved client is being served.

Each frame that can be answered gets exactly one RequestError (request_id None
when the frame could not be read that far, the request's id when it decoded but
was refused): random bytes, every truncation of valid frames, valid msgpack of the
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
from dataclasses import dataclass

import msgspec
import pytest
import zmq
from kvtest.cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec, ProtocolError
from protocol.worker_messages import (
    AppendedBlocks,
    Heartbeat,
    RequestRow,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerReady,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LIMIT = 65536
VOCAB = 512
MAX_MODEL_LEN = 4096
RSS_GROWTH_LIMIT_KB = 150 * 1024
BATCH = 50
NONE = frozenset([None])

replies: Codec = Codec(ClientResponse)
requests: Codec = Codec(ClientRequest, LIMIT)
pack = msgspec.msgpack.encode


@dataclass(frozen=True)
class Case:
    parts: list[bytes]
    # request_id values the one RequestError may carry.
    ids: frozenset
    # Text the error must contain.
    words: str = ""


def one(frame: bytes, ids=NONE, words: str = "") -> Case:
    return Case([frame], frozenset(ids), words)


# --- frame makers -------------------------------------------------------------------------


def random_frames(rng: random.Random, n: int) -> list[Case]:
    sizes = [0, 1, 2, LIMIT - 1, LIMIT]
    sizes += [rng.choice((rng.randrange(1, 16), rng.randrange(1, 256), rng.randrange(1, 4096), rng.randrange(1, LIMIT))) for _ in range(n - len(sizes))]
    return [one(rng.randbytes(size)) for size in sizes]


def truncations() -> list[Case]:
    """Every proper prefix of a few valid frames (the empty one included)."""
    rng = random.Random(1)
    valid = [
        Generate("trunc-long", [rng.randrange(2, VOCAB) for _ in range(400)], 8, ignore_eos=True, cache_salt="tenant"),
        Generate("t", [5], 1),
        Abort("trunc-abort"),
    ]
    return [one(frame[:k]) for frame in map(requests.encode, valid) for k in range(len(frame))]


def wrong_shapes(rng: random.Random) -> list[Case]:
    cases = [one(pack(v)) for v in ([], [1, 2], 5, -1, 2**63, 1.5, "generate", None, True, b"bytes", {}, {"type": "nope"},
                                     {"type": 7}, {"type": None}, {"type": "generate"}, {"type": "abort"}, {"type": "output", "request_id": "x", "new_token_ids": []},
                                     ["generate", "x", [1, 2]], {"type": "generate", "type2": "x"})]  # fmt: skip
    # Raw msgpack: lengths far past the frame, a byte msgpack never uses, deep nesting, trailing data.
    for raw in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffa", b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",
                b"\xc1", b"\x91" * 60000 + b"\x00", b"\x81\xa1a" * 20000 + b"\x00", b"\x80\x00", pack({"type": "abort", "request_id": "x"}) + b"\x00"):  # fmt: skip
        cases.append(one(raw))
    # A map with "type" twice: however it reads, one error.
    cases.append(one(b"\x83\xa4type\xa8generate\xaarequest_id\xa4dupk\xa4type\xa5abort", {None, "dupk"}))

    # One field of a valid Generate made the wrong type, or missing, or one field too many.
    wrong = {
        "request_id": [5, None, "", "x" * 257, ["a"], {"a": 1}, b"id", 1.5],
        "prompt_token_ids": ["abc", [-1], [2**31], [1.5], [None], 5, {"a": 1}, [[1]], ["1"], None],
        "max_tokens": ["5", 1.5, None, [1], True, {"n": 1}],
        "ignore_eos": [1, "true", None, [True]],
        "cache_salt": [5, [], b"x", {"s": "x"}, True],
    }
    for i in range(400):
        d = {"type": "generate", "request_id": f"shape-{i}", "prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]}
        what = rng.randrange(3)
        if what == 0:
            field = rng.choice(list(wrong))
            d[field] = rng.choice(wrong[field])
        elif what == 1:
            del d[rng.choice(["request_id", "prompt_token_ids"])]
        else:
            d[rng.choice(["foo", "prompt", "max_new_tokens", "seed", ""])] = rng.choice([1, "x", None, [1]])
        cases.append(one(pack(d)))

    # Frames that decode but are refused: the error carries the request's id.
    refused = [
        Generate("zero-max", [3, 4], 0),
        Generate("neg-max", [3, 4], -5),
        Generate("empty-prompt", [], 4),
        Generate("out-of-vocab", [3, VOCAB], 4),
        Generate("max-token-id", [2**31 - 1], 4),
        Generate("huge-max", [3], 2**62),
        Generate("over-model-len", [7] * (MAX_MODEL_LEN - 3), 4),
        Generate("x" * 250, [3], 0),  # a long id (with "-i": at most 253 characters)
        Abort("never-sent"),
    ]
    for i in range(20):
        cases += [one(requests.encode(msgspec.structs.replace(g, request_id=f"{g.request_id}-{i}")), {f"{g.request_id}-{i}"}) for g in refused]
    for c in cases:
        _check_expectation(c)
    return cases


def _check_expectation(c: Case) -> None:
    """The frames above are bad by construction; make sure no valid request slipped in."""
    try:
        msg = requests.decode(c.parts[0])
    except ProtocolError:
        assert None in c.ids, c
        return
    assert msg.request_id in c.ids, c
    assert not isinstance(msg, Generate) or msg.max_tokens < 1 or not msg.prompt_token_ids or any(
        t >= VOCAB for t in msg.prompt_token_ids) or len(msg.prompt_token_ids) + msg.max_tokens > MAX_MODEL_LEN, c  # fmt: skip


def worker_messages(rng: random.Random) -> list[Case]:
    out = []
    for _ in range(30):
        r = rng.randrange(1 << 20)
        row = RequestRow(r, [rng.randrange(VOCAB) for _ in range(8)], [1, 2], 0)
        msgs = [
            WorkerHello(0, 1, r, 16, VOCAB, 1), WorkerReady(r, 16, 8, 4096, r, [row]),
            StepPlan(r, {r: 3}, [row], [], [AppendedBlocks(r, [3])], [r], []), StepResult(r, [r], [5]),
            WorkerError("no", r), Heartbeat(time.time()), Shutdown("bye"),
            TokenOutput("x", [1], True, "length"), RequestError("echo", "x"),
        ]  # fmt: skip
        out += [one(pack(m)) for m in msgs]
    return out


def multipart(rng: random.Random, n: int) -> list[Case]:
    good = requests.encode(Generate("multi", [3, 4, 5], 2))
    pool = [b"", good, pack({"type": "abort", "request_id": "multi"})]
    return [
        Case([rng.choice(pool) if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(2, 6))], NONE)
        for _ in range(n)
    ]


def over_limit(rng: random.Random) -> list[Case]:
    words = f"{LIMIT}-byte limit"
    sizes = [LIMIT + 1, LIMIT + 2, 2 * LIMIT, 4 * LIMIT] + [rng.randrange(LIMIT + 1, 4 * LIMIT) for _ in range(40)]
    cases = [one(rng.randbytes(size), NONE, words) for size in sizes]
    # A well-formed Generate that is simply too big is refused for its size, not served.
    big = requests.encode(Generate("too-big", [rng.randrange(200, VOCAB) for _ in range(40_000)], 4))
    assert LIMIT < len(big) <= 4 * LIMIT
    return cases + [one(big, NONE, words)] * 5


# --- clients ------------------------------------------------------------------------------


def recv_reply(sock: zmq.Socket, timeout_s: float):
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
        while True:
            msg = recv_reply(good, 60)
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
        assert isinstance(recv_reply(good, 30), TokenOutput)

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
        while not (msg := recv_reply(good, 30)).finished:
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
