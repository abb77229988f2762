"""Every message of both wire unions survives encode -> decode unchanged, and a
step plan is as small as the contract says (DESIGN.md rule 5): a decode step in
which the batch goes on unchanged is a few bytes whatever the batch size, and a
plan grows with the number of requests that change, not with the batch."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest.fake_worker import FakeWorker

from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    RequestError,
    TokenLogprobs,
    TokenOutput,
)
from protocol.codec import Codec
from protocol.sampling_params import SamplingParams
from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupRequestRow,
    Heartbeat,
    NulledBlocks,
    RequestRow,
    RowSampling,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    StepResult,
    TierCopies,
    WorkerError,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

CLIENT_IN = Codec(ClientRequest)
CLIENT_OUT = Codec(ClientResponse)
TO_WORKER = Codec(SchedulerToWorker)
TO_SCHEDULER = Codec(WorkerToScheduler)


def roundtrip(codec: Codec, msg):
    frame = codec.encode(msg)
    assert isinstance(frame, bytes) and frame
    back = codec.decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    # Decoding is deterministic: re-encoding gives the same bytes.
    assert codec.encode(back) == frame
    return back


# --- hand-written instances, every field away from its default ------------------------

ROW = RequestRow(seq_id=7, token_ids=[3, 4, 5, 2**31 - 1], block_ids=[9, 10], num_computed_tokens=16)

CLIENT_REQUESTS = [
    Generate("req-1", [0, 1, 2, 2**31 - 1], max_tokens=99, ignore_eos=True, cache_salt="tenant-a"),
    Generate("x" * 256, [5]),
    Abort("req-1"),
]
CLIENT_RESPONSES = [
    EngineCoreOutputs([
        TokenOutput("req-1", [7, 8], finished=True, finish_reason="length", num_cached_tokens=32),
        TokenOutput("req-2", []),
        TokenOutput("req-3", [9], logprobs=[TokenLogprobs(-0.25, [9, 4], [-0.25, -2.0])]),
    ]),
    EngineCoreOutputs(),
    RequestError("token id 999 is outside the vocabulary", request_id="req-1"),
    RequestError("malformed frame"),
]
TO_WORKER_MSGS = [
    WorkerReady(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512, next_step_id=42, num_host_blocks=128),
    StepPlan(
        step_id=3,
        num_scheduled_tokens={7: 0, 8: 12},
        new_rows=[ROW],
        resumed_rows=[RequestRow(8, [1, 2, 3], [11], 0)],
        appended=[AppendedBlocks(9, [12, 13])],
        finished_seq_ids=[1, 2],
        preempted_seq_ids=[4],
        tier_copies=TierCopies(store_device_ids=[5, 6], store_host_ids=[0, 1], load_host_ids=[2], load_device_ids=[5]),
    ),
    StepPlan(step_id=0),
    Heartbeat(sent_at=1700000000.25),
    Shutdown(reason="scheduler shutting down"),
]
TO_SCHEDULER_MSGS = [
    WorkerHello(rank=1, world_size=2, num_blocks=64, block_size=16, vocab_size=512, eos_token_id=1,
                num_layers=2, num_kv_heads=4, head_dim=32, device="cuda:1"),
    StepResult(step_id=5, seq_ids=[7, 8], sampled_token_ids=[100, 3], execute_time_s=0.0125),
    WorkerError(message="step 5, expected 4", step_id=5),
    Heartbeat(sent_at=2.5),
]


@pytest.mark.parametrize("msg", CLIENT_REQUESTS, ids=lambda m: type(m).__name__)
def test_client_requests_roundtrip(msg):
    roundtrip(CLIENT_IN, msg)


@pytest.mark.parametrize("msg", CLIENT_RESPONSES, ids=lambda m: type(m).__name__)
def test_client_responses_roundtrip(msg):
    roundtrip(CLIENT_OUT, msg)


@pytest.mark.parametrize("msg", TO_WORKER_MSGS, ids=lambda m: type(m).__name__)
def test_scheduler_to_worker_roundtrip(msg):
    roundtrip(TO_WORKER, msg)


@pytest.mark.parametrize("msg", TO_SCHEDULER_MSGS, ids=lambda m: type(m).__name__)
def test_worker_to_scheduler_roundtrip(msg):
    roundtrip(TO_SCHEDULER, msg)


def test_client_messages_are_maps_tagged_by_type():
    # A hand-written client (any msgpack library) can speak them.
    raw = msgspec.msgpack.decode(CLIENT_IN.encode(Generate("a", [1, 2], max_tokens=3)))
    assert raw == {"type": "generate", "request_id": "a", "prompt_token_ids": [1, 2], "max_tokens": 3}
    assert msgspec.msgpack.decode(CLIENT_OUT.encode(RequestError("no"))) == {"type": "error", "message": "no"}
    # One frame per client per step: the TokenOutputs inside carry no tag of their own.
    batch = EngineCoreOutputs([TokenOutput("a", [5]), TokenOutput("b", [6], True, "stop", 16)])
    assert msgspec.msgpack.decode(CLIENT_OUT.encode(batch)) == {"type": "outputs", "outputs": [
        {"request_id": "a", "new_token_ids": [5]},
        {"request_id": "b", "new_token_ids": [6], "finished": True, "finish_reason": "stop", "num_cached_tokens": 16},
    ]}
    assert msgspec.msgpack.decode(CLIENT_OUT.encode(EngineCoreOutputs())) == {"type": "outputs"}


def test_one_plan_type_carries_group_data_only_in_a_hybrid_models_rows_and_deltas():
    row = GroupRequestRow(7, [1, 2], [3], group_block_ids=[[4]])
    plan = StepPlan(step_id=9, new_rows=[row], appended=[AppendedBlocks(7, [6]), GroupAppendedBlocks(7, 1, [5]), NulledBlocks(7, 0, 2)])
    wire = msgspec.msgpack.decode(TO_WORKER.encode(plan))
    assert wire[0] == 4 and wire[3] == [[20, 7, [1, 2], [3], 0, None, [[4]]]]
    assert wire[5] == [[1, 7, [6]], [13, 7, 1, [5]], [14, 7, 0, 2]]
    back = TO_WORKER.decode(TO_WORKER.encode(plan))
    assert type(back) is StepPlan and back == plan and type(back.new_rows[0]) is GroupRequestRow
    # What the worker reads of a one-group plan's rows and appends: group 0, no other tables.
    one = TO_WORKER.decode(TO_WORKER.encode(StepPlan(step_id=9, new_rows=[RequestRow(7, [1, 2], [3])], appended=[AppendedBlocks(7, [6])])))
    assert one.new_rows[0].group_block_ids == [] and one.appended[0].group == 0
    assert msgspec.msgpack.decode(TO_WORKER.encode(one))[3] == [[0, 7, [1, 2], [3], 0, None]]


def test_worker_messages_are_arrays_tag_first():
    # NOTE: msgspec ignores omit_defaults on array_like structs (jcrist/msgspec#720):
    # every field is encoded. A sender may still leave trailing defaults out.
    assert msgspec.msgpack.decode(TO_WORKER.encode(StepPlan(step_id=9))) == [4, 9, {}, [], [], [], [], [], None, None, None]
    # A greedy row's sampling is None: one byte.
    assert msgspec.msgpack.decode(TO_WORKER.encode(ROW)) == [0, 7, [3, 4, 5, 2**31 - 1], [9, 10], 16, None]
    sampled = RequestRow(1, [2], [3], 0, RowSampling(1, SamplingParams(temperature=0.5, seed=3)))
    assert msgspec.msgpack.decode(TO_WORKER.encode(sampled), type=RequestRow) == sampled
    assert TO_WORKER.decode(msgspec.msgpack.encode([4, 9])) == StepPlan(step_id=9)
    assert TO_WORKER.decode(msgspec.msgpack.encode([7])) == Heartbeat()


# --- hypothesis-generated instances ---------------------------------------------------

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)
request_ids = st.text(min_size=1, max_size=256)
small_ints = st.integers(0, 2**40)
any_ints = st.integers(-(2**63), 2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
rows = st.builds(RequestRow, small_ints, token_ids, st.lists(small_ints, max_size=20), small_ints)

client_requests = st.one_of(
    st.builds(Generate, request_ids, st.lists(st.integers(0, 2**31 - 1), max_size=40), any_ints, st.booleans(),
              st.none() | st.text(max_size=40)),
    st.builds(Abort, request_ids),
)
token_outputs = st.builds(TokenOutput, st.text(max_size=300), st.lists(any_ints, max_size=10), st.booleans(),
                          st.none() | st.sampled_from(["length", "stop", "abort", "error"]), small_ints)
client_responses = st.one_of(
    st.builds(EngineCoreOutputs, st.lists(token_outputs, max_size=8)),
    st.builds(RequestError, st.text(max_size=200), st.none() | st.text(max_size=300)),
)
to_worker = st.one_of(
    st.builds(WorkerReady, small_ints, small_ints, small_ints, small_ints, small_ints),
    st.builds(
        StepPlan, small_ints, st.dictionaries(small_ints, small_ints, max_size=8), st.lists(rows, max_size=3),
        st.lists(rows, max_size=3), st.lists(st.builds(AppendedBlocks, small_ints, st.lists(small_ints, max_size=4)), max_size=4),
        st.lists(small_ints, max_size=8), st.lists(small_ints, max_size=8),
    ),
    st.builds(Heartbeat, finite),
    st.builds(Shutdown, st.text(max_size=100)),
)
to_scheduler = st.one_of(
    st.builds(WorkerHello, small_ints, small_ints, small_ints, small_ints, small_ints, small_ints, small_ints,
              small_ints, small_ints, st.text(max_size=20)),
    st.builds(StepResult, small_ints, st.lists(small_ints, max_size=8), st.lists(st.integers(0, 2**31 - 1), max_size=8), finite),
    st.builds(WorkerError, st.text(max_size=200), any_ints),
    st.builds(Heartbeat, finite),
)


@settings(max_examples=300, deadline=None)
@given(client_requests)
def test_generated_client_requests_roundtrip(msg):
    roundtrip(CLIENT_IN, msg)


@settings(max_examples=300, deadline=None)
@given(client_responses)
def test_generated_client_responses_roundtrip(msg):
    roundtrip(CLIENT_OUT, msg)


@settings(max_examples=300, deadline=None)
@given(to_worker)
def test_generated_scheduler_to_worker_roundtrip(msg):
    roundtrip(TO_WORKER, msg)


@settings(max_examples=300, deadline=None)
@given(to_scheduler)
def test_generated_worker_to_scheduler_roundtrip(msg):
    roundtrip(TO_SCHEDULER, msg)


# --- rule 5: plan sizes through the real scheduler ------------------------------------

BS = 16
VOCAB = 512


class Batch:
    """A real Scheduler + KVCacheManager driven by a FakeWorker (which checks the
    contract on every plan)."""

    def __init__(self, num_blocks: int = 4096, max_num_seqs: int = 512):
        self.kv = KVCacheManager(num_blocks, BS, 4096)
        self.sched = Scheduler(self.kv, max_num_seqs, 1 << 20, 4096)
        self.worker = FakeWorker(num_blocks, BS, VOCAB, check_reads=False)
        self.hasher = BlockHasher(BS)
        self.next_seq_id = 0

    def add(self, prompt_len: int, max_tokens: int = 1000) -> None:
        i = self.next_seq_id
        self.next_seq_id += 1
        # Distinct prompts (no prefix sharing), token ids < 128 so sizes stay comparable.
        prompt = [2 + (i + j) % 100 for j in range(prompt_len)]
        self.sched.add_request(Request(f"r{i}", prompt, max_tokens, seq_id=i, ignore_eos=True, block_hasher=self.hasher))

    def step(self) -> StepPlan:
        out = self.sched.schedule()
        assert out is not None
        self.sched.update_from_output(self.worker.execute(out.plan))
        return out.plan


def plan_bytes(plan: StepPlan) -> int:
    return len(TO_WORKER.encode(plan))


def test_unchanged_decode_step_of_256_requests_is_at_most_64_bytes():
    b = Batch()
    for _ in range(256):
        b.add(20)  # positions 20..31 sit in the second block: 12 decode steps need no block
    admit = b.step()
    assert len(admit.new_rows) == 256
    for _ in range(5):
        plan = b.step()
        assert b.sched.num_running == 256
        assert not plan.new_rows and not plan.appended and not plan.finished_seq_ids and not plan.num_scheduled_tokens
        size = plan_bytes(plan)
        assert size <= 64, size
    b.kv.check_invariants()


def _plan_with_changes(batch: int, k: int, change: str) -> StepPlan:
    """The first decode step after admitting ``batch`` requests, in which ``k`` of
    them change: get a new block (``append``), finish (``finish``), or k new
    requests join (``join``)."""
    b = Batch()
    for i in range(batch):
        if change == "append" and i < k:
            b.add(32)  # full blocks only: its first decode token needs a third block
        elif change == "finish" and i < k:
            b.add(20, max_tokens=1)  # done after its prefill samples one token
        else:
            b.add(20)
    b.step()
    if change == "join":
        for _ in range(k):
            b.add(20)
    plan = b.step()
    if change == "append":
        assert len(plan.appended) == k
    elif change == "finish":
        assert len(plan.finished_seq_ids) == k
    else:
        assert len(plan.new_rows) == k
    return plan


ID_WIDTH_SLACK = {"append": 2, "finish": 0, "join": 8}


@pytest.mark.parametrize("change", ["append", "finish", "join"])
def test_plan_grows_with_changed_requests_not_with_the_batch(change):
    sizes = {}
    # NOTE: 32 finishing requests out of 32 would leave no step to carry the news.
    small_batch = 48 if change == "finish" else 32
    for k in (1, 2, 4, 8, 16, 32):
        small = plan_bytes(_plan_with_changes(small_batch, k, change))
        large = plan_bytes(_plan_with_changes(256, k, change))
        # Same changes, 8x the batch: only the width of ids may differ (msgpack packs
        # ints < 128 in one byte, < 65536 in three): 2 bytes per id that grows, i.e. a
        # block id (append), none (finish: seq_ids 0..k-1 either way), or a joining
        # row's seq_id twice and its two block ids.
        assert abs(large - small) <= ID_WIDTH_SLACK[change] * k, (change, k, small, large)
        sizes[k] = large
    ks = sorted(sizes)
    assert all(sizes[a] < sizes[b] for a, b in zip(ks, ks[1:], strict=False)), (change, sizes)
    # And the cost of one change is a handful of bytes (a whole 20-token row for a join).
    per_change = (sizes[32] - sizes[1]) / 31
    assert per_change <= (40 if change == "join" else 8), (change, sizes)
