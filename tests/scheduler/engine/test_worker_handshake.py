"""Losing and regaining a worker, against `python -m scheduler` as a real process.

The workers here are scripted DEALER sockets driven step by step by the test (plans
executed by kvtest's FakeWorker), so a hello, a result or a silence can be placed
exactly: mid-step, after a loss, during the handshake. Every socket and process is
closed in a finally; every receive is bounded.
"""

from __future__ import annotations

import time

import pytest
import zmq
from kvtest.fake_worker import FakeWorker
from kvtest.scheduler_harness import (
    BS,
    EOS,
    VOCAB,
    Client,
    SchedulerProcess,
    expected_tokens,
    metric,
    prompt_of,
    tokens_of,
)

from protocol.client_messages import Generate, TokenOutput
from protocol.codec import Codec
from protocol.worker_messages import (
    Heartbeat,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    WorkerError,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


class ScriptedWorker:
    """One DEALER; the test says when it says hello, acknowledges, answers."""

    def __init__(self, ctx: zmq.Context, address: str, num_blocks: int = 64, **identity):
        self.identity = identity  # WorkerHello's model identity fields, if any
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.num_blocks = num_blocks
        self.out: Codec = Codec(WorkerToScheduler)
        self.inp: Codec = Codec(SchedulerToWorker)
        self.fake: FakeWorker | None = None

    def send(self, msg) -> None:
        self.sock.send(self.out.encode(msg))

    def recv(self, timeout_s: float = 10.0, skip_heartbeats: bool = True):
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            msg = self.inp.decode(self.sock.recv())
            if not (skip_heartbeats and isinstance(msg, Heartbeat)):
                return msg
        raise AssertionError(f"nothing from the scheduler within {timeout_s} s")

    def hello(self) -> WorkerReady | Shutdown:
        self.send(WorkerHello(rank=0, world_size=1, num_blocks=self.num_blocks, block_size=BS, vocab_size=VOCAB, eos_token_id=EOS, **self.identity))
        reply = self.recv()
        assert isinstance(reply, WorkerReady | Shutdown), reply
        return reply

    def join(self) -> WorkerReady:
        """Hello, WorkerReady, acknowledge; a fresh FakeWorker holds the rows."""
        ready = self.hello()
        assert isinstance(ready, WorkerReady), ready
        self.fake = FakeWorker(ready.num_blocks, BS, VOCAB)
        self.fake.expected_step = ready.next_step_id
        self.send(Heartbeat(time.time()))
        return ready

    def plan(self) -> StepPlan:
        msg = self.recv()
        assert isinstance(msg, StepPlan), msg
        return msg

    def answer(self, plan: StepPlan) -> None:
        # NOTE: after a loss every row comes back resumed; to a fresh fake worker they
        # come back after a preemption it never saw.
        for row in plan.resumed_rows:
            if row.seq_id not in self.fake.rows:
                self.fake.preempted.add(row.seq_id)
        self.send(self.fake.execute(plan))

    def serve_until(self, client: Client, request_id: str) -> list[TokenOutput]:
        """Answer plans until the client has every output of its request."""
        outs: list[TokenOutput] = []
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(client.sock, zmq.POLLIN)
        deadline = time.monotonic() + 30
        while not outs or not outs[-1].finished:
            assert time.monotonic() < deadline, f"{request_id} unfinished after 30 s"
            ready = dict(poller.poll(1000))
            if client.sock in ready:
                msg = client.recv()
                assert isinstance(msg, TokenOutput) and msg.request_id == request_id, msg
                outs.append(msg)
            if self.sock in ready:
                msg = self.inp.decode(self.sock.recv())
                if isinstance(msg, StepPlan):
                    self.answer(msg)
        return outs

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def setup():
    ctx = zmq.Context()
    sched = SchedulerProcess("--worker-timeout", "2")
    socks: list = []
    try:
        sched.wait_http()
        client = Client(ctx, sched.client_address)
        socks.append(client)

        def worker(**kw) -> ScriptedWorker:
            w = ScriptedWorker(ctx, sched.worker_address, **kw)
            socks.append(w)
            return w

        yield sched, client, worker
    finally:
        for s in socks:
            s.close()
        sched.stop()
        ctx.term()


def _start(sched, client, w, request_id: str, prompt: list[int], n: int) -> StepPlan:
    w.join()
    sched.wait_health(200)
    client.send(Generate(request_id, prompt, max_tokens=n, ignore_eos=True))
    return w.plan()


def test_hello_mid_step_from_the_same_worker_resumes_its_requests(setup):
    sched, client, worker = setup
    w = worker()
    prompt = prompt_of(1, 40)
    first = _start(sched, client, w, "same", prompt, 6)
    late = w.fake.execute(first)  # computed, but not sent before the hello
    ready = w.join()  # the same socket says hello mid-step
    assert ready.next_step_id == first.step_id + 1
    w.send(late)  # its late result of the lost step: dropped, nothing applied
    plan = w.plan()
    assert plan.step_id == first.step_id + 1 and [r.seq_id for r in plan.resumed_rows] == [first.new_rows[0].seq_id]
    w.answer(plan)
    outs = w.serve_until(client, "same")
    assert tokens_of(outs) == expected_tokens(prompt, 6)
    assert sched.proc.poll() is None
    # Recomputed for a lost worker, not preempted (vLLM's preemptions are the policy's).
    m = sched.metrics()
    assert metric(m, "vllm:num_preemptions_total") == 0
    assert metric(m, "kvpool_worker_loss_recomputes_total") == 1
    assert metric(m, "vllm:request_num_preemptions_sum") == 0 and metric(m, "vllm:request_num_preemptions_count") == 1


def test_hello_mid_step_from_a_new_worker_is_refused_while_the_old_one_lives(setup):
    sched, client, worker = setup
    a, b = worker(), worker()
    prompt = prompt_of(2, 20)
    plan = _start(sched, client, a, "r", prompt, 4)
    refused = b.hello()
    assert isinstance(refused, Shutdown) and "already connected" in refused.reason
    a.answer(plan)  # the step in flight is untouched
    outs = a.serve_until(client, "r")
    assert tokens_of(outs) == expected_tokens(prompt, 4)
    assert metric(sched.metrics(), "vllm:num_preemptions_total") == 0


def test_hello_mid_step_from_a_new_worker_after_the_old_one_died_takes_over(setup):
    sched, client, worker = setup
    a, b = worker(), worker()
    prompt = prompt_of(3, 30)
    _start(sched, client, a, "r", prompt, 5)
    a.close()  # dies mid-step
    # The new worker may say hello before the scheduler has noticed: it is probed,
    # found gone, and the new worker takes over the step's requests.
    deadline = time.monotonic() + 10
    while isinstance(reply := b.hello(), Shutdown):
        assert time.monotonic() < deadline, reply.reason
        time.sleep(0.2)
    b.fake = FakeWorker(reply.num_blocks, BS, VOCAB)
    b.fake.expected_step = reply.next_step_id
    b.send(Heartbeat(time.time()))
    outs = b.serve_until(client, "r")
    assert tokens_of(outs) == expected_tokens(prompt, 5)


def test_a_late_result_after_loss_is_dropped_and_the_worker_can_return(setup):
    sched, client, worker = setup
    w = worker()
    prompt = prompt_of(4, 25)
    plan = _start(sched, client, w, "late", prompt, 4)
    late = w.fake.execute(plan)
    sched.wait_health(503, bound_s=15)  # silent past --worker-timeout 2: lost
    w.send(late)
    assert sched.proc.poll() is None
    ready = w.join()
    assert ready.next_step_id == plan.step_id + 1
    outs = w.serve_until(client, "late")
    assert tokens_of(outs) == expected_tokens(prompt, 4)


def test_a_loss_during_the_handshake_builds_no_pool(setup):
    sched, client, worker = setup
    a = worker(num_blocks=40)
    ready = a.hello()
    assert isinstance(ready, WorkerReady) and ready.num_blocks == 40
    a.send(WorkerError("cannot install WorkerReady"))  # refuses it instead of acknowledging
    a.close()
    assert sched.http("GET", "/health")[0] == 503
    client.send(Generate("early", [2, 3, 4]))
    assert "no worker is ready" in client.error().message
    # No pool was built for the worker that never became ready: the next one sizes it.
    b = worker(num_blocks=24)
    assert b.join().num_blocks == 24
    sched.wait_health(200)
    assert metric(sched.metrics(), "kvpool_num_gpu_blocks") == 24
    client.send(Generate("r", prompt_of(5, 10), max_tokens=3, ignore_eos=True))
    assert tokens_of(b.serve_until(client, "r")) == expected_tokens(prompt_of(5, 10), 3)


LLAMA_A = {"architecture": "LlamaForCausalLM", "model_hash": "aa" * 16}


@pytest.mark.parametrize(
    ("other", "named"),
    [({"architecture": "LlamaForCausalLM", "model_hash": "bb" * 16}, "bb" * 16),
     ({"architecture": "Qwen3ForCausalLM", "model_hash": "aa" * 16}, "Qwen3ForCausalLM")],
)
def test_a_returning_worker_serving_another_model_is_refused_and_the_same_model_is_not(setup, other, named):
    sched, client, worker = setup
    a = worker(**LLAMA_A)
    prompt = prompt_of(6, 20)
    a.join()
    sched.wait_health(200)
    client.send(Generate("first", prompt, max_tokens=3, ignore_eos=True))
    assert tokens_of(a.serve_until(client, "first")) == expected_tokens(prompt, 3)
    a.close()
    sched.wait_health(503, bound_s=15)  # lost: silent past --worker-timeout 2
    # The pool holds ids (and, until the reset, hashes) of model A: model B is refused,
    # with both identities named.
    refused = worker(**other).hello()
    assert isinstance(refused, Shutdown), refused
    assert "another model" in refused.reason and named in refused.reason and "aa" * 16 in refused.reason
    assert sched.http("GET", "/health")[0] == 503
    # A worker of the same model is taken, and serves.
    c = worker(**LLAMA_A)
    c.join()
    sched.wait_health(200)
    client.send(Generate("again", prompt, max_tokens=3, ignore_eos=True))
    assert tokens_of(c.serve_until(client, "again")) == expected_tokens(prompt, 3)


def test_a_worker_silent_during_its_handshake_is_dropped(setup):
    sched, client, worker = setup
    a = worker(num_blocks=40)
    assert isinstance(a.hello(), WorkerReady)  # and never acknowledges
    b = worker(num_blocks=32)
    deadline = time.monotonic() + 15
    while isinstance(reply := b.hello(), Shutdown):  # refused while a is handshaking
        assert time.monotonic() < deadline, reply.reason
        time.sleep(0.5)
    assert reply.num_blocks == 32


def test_the_kv_block_bytes_gauge_is_the_hello_of_the_worker_attached(setup):
    sched, client, worker = setup
    # What a worker measured on its KV tensors, reported and exported as it said it: a
    # bfloat16 cache of 2 layers, 4 KV heads of 64 dims, 16 tokens: K and V, 2 bytes each.
    a = worker(kv_cache_dtype="bfloat16", kv_cache_dtype_size=2, kv_block_bytes=2 * 2 * BS * 4 * 64 * 2)
    a.join()
    sched.wait_health(200)
    assert metric(sched.metrics(), "kvpool_kv_block_bytes") == 32768
    a.close()
    sched.wait_health(503, bound_s=15)
    # The next worker's fp8 cache: one byte an element, half the block.
    b = worker(kv_cache_dtype="float8_e4m3fn", kv_cache_dtype_size=1, kv_block_bytes=2 * 2 * BS * 4 * 64 * 1)
    b.join()
    sched.wait_health(200)
    assert metric(sched.metrics(), "kvpool_kv_block_bytes") == 16384
