"""Every bad frame becomes a `ProtocolError` and nothing else: malformed,
truncated, oversized, empty, of the wrong shape or the wrong union, with
out-of-range values or unknown fields — and random bytes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

CODECS = {
    "client_in": Codec(ClientRequest),
    "client_out": Codec(ClientResponse),
    "to_worker": Codec(SchedulerToWorker),
    "to_scheduler": Codec(WorkerToScheduler),
}
ALL_CODECS = list(CODECS.values())
raw = msgspec.msgpack.encode

VALID = [
    (CODECS["client_in"], Generate("req-1", [3, 4, 5], max_tokens=7, ignore_eos=True, cache_salt="s")),
    (CODECS["client_in"], Abort("req-1")),
    (CODECS["client_out"], EngineCoreOutputs([TokenOutput("req-1", [9], finished=True, finish_reason="stop", num_cached_tokens=16)])),
    (CODECS["client_out"], RequestError("nope", "req-1")),
    (CODECS["to_worker"], WorkerReady(64, 16, 8, 512, 3)),
    (CODECS["to_worker"], StepPlan(5, {1: 0}, [RequestRow(2, [5] * 17, [6, 7])], [], [AppendedBlocks(1, [8])], [3], [4])),
    (CODECS["to_worker"], Shutdown("bye")),
    (CODECS["to_scheduler"], WorkerHello(0, 1, 64, 16, 512, 1, 2, 2, 8, "cpu")),
    (CODECS["to_scheduler"], StepResult(5, [1, 2], [10, 11], 0.5)),
    (CODECS["to_scheduler"], WorkerError("bad", 5)),
    (CODECS["to_scheduler"], Heartbeat(1.5)),
]


def rejects(codec: Codec, frame) -> str:
    with pytest.raises(ProtocolError) as info:
        codec.decode(frame)
    # ProtocolError is the only exception type, and it says something.
    assert type(info.value) is ProtocolError and str(info.value)
    return str(info.value)


@pytest.mark.parametrize("codec,msg", VALID, ids=lambda x: type(x).__name__)
def test_every_truncation_of_a_valid_frame_is_rejected(codec, msg):
    frame = codec.encode(msg)
    assert codec.decode(frame) == msg
    for cut in range(len(frame)):
        rejects(codec, frame[:cut])
    # Trailing garbage after a whole message is not a message either.
    rejects(codec, frame + b"\x00")


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_empty_frame(codec):
    assert "empty" in rejects(codec, b"")
    assert "empty" in rejects(codec, memoryview(b""))


def test_oversized_frame_is_rejected_before_decoding():
    codec = Codec(ClientRequest, max_frame_bytes=100)
    small = codec.encode(Generate("a", [1] * 10))
    assert codec.decode(small).request_id == "a"
    big = codec.encode(Generate("a", [1] * 200))
    assert len(big) > 100
    assert "limit" in rejects(codec, big)
    # Exactly at the limit is fine.
    at_limit = Codec(ClientRequest, max_frame_bytes=len(big))
    assert at_limit.decode(big).request_id == "a"
    assert "limit" in rejects(codec, bytearray(big))


@pytest.mark.parametrize(
    "frame",
    [b"\xc1", b"\xff\xff\xff", b"\x93\x01", b"\xdb\xff\xff\xff\xff", b"not msgpack at all", b"\x91" * 100_000,
     b"\xdd\xff\xff\xff\xff" + b"\x00" * 10],
    ids=["reserved-opcode", "fixints", "short-array", "huge-str-header", "text", "deep-nesting", "huge-array-header"],
)
@pytest.mark.parametrize("name", list(CODECS))
def test_malformed_frames(name, frame):
    rejects(CODECS[name], frame)


@pytest.mark.parametrize(
    "value",
    [
        1,
        "generate",
        [],
        {},
        None,
        {"type": "generate"},  # required fields missing
        {"type": "launch", "request_id": "a"},  # unknown tag
        {"request_id": "a", "prompt_token_ids": [1]},  # no tag
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1, -1]},  # negative token id
        {"type": "generate", "request_id": "a", "prompt_token_ids": [2**31]},  # token id past int32
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1.5]},
        {"type": "generate", "request_id": "a", "prompt_token_ids": "abc"},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "max_tokens": "5"},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "ignore_eos": 1},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "cache_salt": 7},
        {"type": "generate", "request_id": "", "prompt_token_ids": [1]},  # request_id too short
        {"type": "generate", "request_id": "x" * 257, "prompt_token_ids": [1]},  # request_id too long
        {"type": "generate", "request_id": 5, "prompt_token_ids": [1]},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "best_of": 3},  # unknown field
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "priority": 2**63},  # priority past int64
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "priority": "high"},
        {"type": "abort", "request_id": "a", "force": True},  # unknown field
        {"type": "abort"},
        {"type": "output", "request_id": "a", "new_token_ids": [1]},  # a response, not a request
        {"type": "error", "message": "x"},
        [4, 0],  # a StepPlan: the other conversation
        [2, 0, 1, 64, 16, 512, 1],  # a WorkerHello
    ],
    ids=repr,
)
def test_wrong_shapes_on_the_client_port(value):
    rejects(CODECS["client_in"], raw(value))


@pytest.mark.parametrize(
    "name,value",
    [
        ("to_scheduler", [4, 0]),  # a StepPlan sent the wrong way
        ("to_scheduler", [3, 64, 16, 8, 512]),  # a WorkerReady sent the wrong way
        ("to_scheduler", [8, "bye"]),  # Shutdown
        ("to_scheduler", [99, 0]),  # unknown tag
        ("to_scheduler", ["4", 0]),  # tag of the wrong type
        ("to_scheduler", [5, "zero"]),  # StepResult.step_id not an int
        ("to_scheduler", [5, 0, [1], "x"]),
        ("to_scheduler", [5, 0, [1], [2], "fast"]),
        ("to_scheduler", [2, 0, 1, 64]),  # WorkerHello missing required fields
        ("to_scheduler", {"type": "generate", "request_id": "a", "prompt_token_ids": [1]}),  # client message
        ("to_scheduler", [0, 1, [2], [3], 0]),  # a bare RequestRow is not a message
        ("to_worker", [5, 0, [1], [2]]),  # StepResult sent the wrong way
        ("to_worker", [2, 0, 1, 64, 16, 512, 1]),  # WorkerHello sent the wrong way
        ("to_worker", [4]),  # StepPlan without step_id
        ("to_worker", [4, 0, {"1": 2}]),  # num_scheduled_tokens keys are ints
        ("to_worker", [4, 0, {}, [[1, 2]]]),  # a new row that is not a RequestRow
        ("to_worker", [4, 0, {}, [[0, 1, "tokens", [3]]]]),
        ("to_worker", [4, 0, {}, [], [], [[0, 1, [2]]]]),  # appended entry tagged as a RequestRow
        ("to_worker", [3, 64, 16, 8, "512"]),  # WorkerReady.max_model_len not an int
        ("client_out", {"type": "output", "request_id": "a", "new_token_ids": "x"}),
        ("client_out", {"type": "generate", "request_id": "a", "prompt_token_ids": [1]}),
    ],
    ids=repr,
)
def test_wrong_shapes_on_the_worker_port_and_back(name, value):
    rejects(CODECS[name], raw(value))


def test_a_message_of_the_other_union_is_rejected():
    client_only = [Generate("a", [1]), Abort("a")]
    for msg in client_only:
        frame = CODECS["client_in"].encode(msg)
        for name in ("to_worker", "to_scheduler", "client_out"):
            rejects(CODECS[name], frame)
    for msg in (StepPlan(0), WorkerReady(1, 2, 3, 4), Shutdown("x")):
        frame = CODECS["to_worker"].encode(msg)
        rejects(CODECS["to_scheduler"], frame)
        rejects(CODECS["client_in"], frame)
    for msg in (StepResult(0), WorkerHello(0, 1, 2, 3, 4, 5), WorkerError("x")):
        frame = CODECS["to_scheduler"].encode(msg)
        rejects(CODECS["to_worker"], frame)
        rejects(CODECS["client_in"], frame)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_protocol_error(frame):
    for codec in ALL_CODECS:
        try:
            codec.decode(frame)
        except ProtocolError:
            pass


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(range(len(VALID))), st.data())
def test_mutated_valid_frames_decode_or_raise_protocol_error(index, data):
    codec, msg = VALID[index]
    frame = bytearray(codec.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] = data.draw(st.integers(0, 255))
    try:
        back = codec.decode(bytes(frame))
    except ProtocolError:
        return
    # Whatever decodes is a well-typed message of the codec's union.
    assert isinstance(back, msgspec.Struct)


@settings(max_examples=500, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5) | st.integers(-(2**63), 2**64 - 1), children, max_size=5),
    max_leaves=30,
))
def test_random_msgpack_values_decode_or_raise_protocol_error(value):
    frame = raw(value)
    for codec in ALL_CODECS:
        try:
            codec.decode(frame)
        except ProtocolError:
            pass
