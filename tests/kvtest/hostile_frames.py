"""Hostile frames for the client port, each with the reply it must get: random
bytes, every truncation of valid frames, valid msgpack of wrong shapes, worker
messages, multi-part garbage, frames over the size limit. Used by
tests/e2e/test_hostile_frames.py."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import msgspec

from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
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


def id_in(d) -> frozenset:
    """The request_id a refusal of the map ``d`` names: its own when it is a string
    (read even when the rest of the frame is not a valid request), else None."""
    rid = d.get("request_id") if isinstance(d, dict) else None
    return frozenset([rid]) if isinstance(rid, str) else NONE


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
    cases = [one(pack(v), id_in(v)) for v in ([], [1, 2], 5, -1, 2**63, 1.5, "generate", None, True, b"bytes", {}, {"type": "nope"},
                                     {"type": 7}, {"type": None}, {"type": "generate"}, {"type": "abort"}, {"type": "output", "request_id": "x", "new_token_ids": []},
                                     ["generate", "x", [1, 2]], {"type": "generate", "type2": "x"})]
    # Raw msgpack: lengths far past the frame, a byte msgpack never uses, deep nesting, trailing data.
    for raw in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffa", b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",
                b"\xc1", b"\x91" * 60000 + b"\x00", b"\x81\xa1a" * 20000 + b"\x00", b"\x80\x00", pack({"type": "abort", "request_id": "x"}) + b"\x00"):
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
            # NOTE: names Generate does not have ("seed" is one of its fields now).
            d[rng.choice(["foo", "prompt", "max_new_tokens", "random_seed", ""])] = rng.choice([1, "x", None, [1]])
        cases.append(one(pack(d), id_in(d)))

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
        return
    assert msg.request_id in c.ids, c
    assert not isinstance(msg, Generate) or msg.max_tokens < 1 or not msg.prompt_token_ids or any(
        t >= VOCAB for t in msg.prompt_token_ids) or len(msg.prompt_token_ids) + msg.max_tokens > MAX_MODEL_LEN, c


def worker_messages(rng: random.Random) -> list[Case]:
    out = []
    for _ in range(30):
        r = rng.randrange(1 << 20)
        row = RequestRow(r, [rng.randrange(VOCAB) for _ in range(8)], [1, 2], 0)
        msgs = [
            WorkerHello(0, 1, r, 16, VOCAB, 1), WorkerReady(r, 16, 8, 4096, r),
            StepPlan(r, {r: 3}, [row], [], [AppendedBlocks(r, [3])], [r], []), StepResult(r, [r], [5]),
            WorkerError("no", r), Heartbeat(time.time()), Shutdown("bye"),
            EngineCoreOutputs([TokenOutput("x", [1], True, "length")]),
        ]
        out += [one(pack(m)) for m in msgs]
        out.append(one(pack(RequestError("echo", "x")), {"x"}))  # a map naming a request_id
    return out


def multipart(rng: random.Random, n: int) -> list[Case]:
    good = requests.encode(Generate("multi", [3, 4, 5], 2))
    pool = [b"", good, pack({"type": "abort", "request_id": "multi"})]
    out = []
    for _ in range(n):
        parts = [rng.choice(pool) if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(2, 6))]
        # the refusal names the request of the first part when it is one of the good frames
        out.append(Case(parts, frozenset(["multi"]) if parts[0] in pool[1:] else NONE))
    return out


def over_limit(rng: random.Random) -> list[Case]:
    words = f"{LIMIT}-byte limit"
    sizes = [LIMIT + 1, LIMIT + 2, 2 * LIMIT, 4 * LIMIT] + [rng.randrange(LIMIT + 1, 4 * LIMIT) for _ in range(40)]
    cases = [one(rng.randbytes(size), NONE, words) for size in sizes]
    # A well-formed Generate that is simply too big is refused for its size, not served.
    big = requests.encode(Generate("too-big", [rng.randrange(200, VOCAB) for _ in range(40_000)], 4))
    assert LIMIT < len(big) <= 4 * LIMIT
    return cases + [one(big, {"too-big"}, words)] * 5


# --- clients ------------------------------------------------------------------------------
