"""`python -m scheduler` as a real process over real loopback sockets.

The worker is a ZMQ DEALER in this test process (a thread) that speaks
protocol.worker_messages and executes plans with kvtest's FakeWorker, which checks
the contract on every plan and samples deterministically from a row's tokens, so
the expected outputs are known in advance. Clients are DEALERs. Every process and
socket is closed in a finally; every receive has a timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import msgspec
import pytest
from kvtest.scheduler_harness import (
    NUM_BLOCKS,
    REPO,
    VOCAB,
    Client,
    Setup,
    expected_tokens,
    free_port,
    metric,
    prompt_of,
    tokens_of,
)

from protocol.client_messages import (
    Abort,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec
from protocol.worker_messages import (
    StepResult,
    WorkerToScheduler,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

@pytest.fixture(scope="module")
def served():
    """One scheduler + worker shared by the tests that leave it idle."""
    s = Setup("--max-model-len", "2048")
    try:
        yield s
        assert s.worker.errors == []
    finally:
        s.close()


# --- tests ------------------------------------------------------------------------------


def test_health_and_generate_wait_for_the_workers_hello():
    s = Setup(start_worker=False)
    try:
        status, body = s.sched.http("GET", "/health")
        assert status == 503 and "worker" in body
        s.client.send(Generate("early", [2, 3, 4]))
        err = s.client.error()
        assert err.request_id == "early" and "worker" in err.message
        s.start_worker()
        assert s.sched.http("GET", "/health")[0] == 200
        outs = s.client.generate("later", [2, 3, 4], 3)
        assert tokens_of(outs) == expected_tokens([2, 3, 4], 3)
        assert metric(s.sched.metrics(), "kvpool_num_gpu_blocks") == NUM_BLOCKS
    finally:
        s.close()


def test_generate_streams_tokens_and_reports_cached_tokens(served):
    prompt = prompt_of(1, 48)
    outs = served.client.generate("g1", prompt, 5)
    assert len(outs) == 5 and all(len(o.new_token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == "length"
    assert tokens_of(outs) == expected_tokens(prompt, 5)
    assert outs[0].num_cached_tokens == 0
    # Same 48 tokens again: 2 full blocks hit (the third is capped: the last prompt
    # token is always computed).
    again = served.client.generate("g2", prompt, 5)
    assert tokens_of(again) == tokens_of(outs)
    assert again[0].num_cached_tokens == 32 and again[-1].num_cached_tokens == 32
    served.wait_idle()


def test_one_frame_per_client_per_step_carries_all_its_requests(served):
    """Four requests on one socket run side by side for 20 steps: each step's tokens
    come in one EngineCoreOutputs frame, each request at most once in it."""
    prompts = {f"b{i}": prompt_of(40 + i, 20) for i in range(4)}
    for rid, prompt in prompts.items():
        served.client.send(Generate(rid, prompt, max_tokens=20, ignore_eos=True))
    outs: dict[str, list[TokenOutput]] = {rid: [] for rid in prompts}
    first_frame = len(served.client.replies.frames)
    while not all(o and o[-1].finished for o in outs.values()):
        msg = served.client.recv(15)
        assert isinstance(msg, TokenOutput), msg
        outs[msg.request_id].append(msg)
    frames = served.client.replies.frames[first_frame:]
    for rid, prompt in prompts.items():
        assert tokens_of(outs[rid]) == expected_tokens(prompt, 20)
    assert all(len(ids) == len(set(ids)) for ids in frames), frames
    assert sum(map(len, frames)) == 80
    # Once the last of the four has its first token and until the first finishes, every
    # step's frame carries all four. How early that is depends on when each send arrives
    # (a loaded machine delays the later ones), so only a non-empty stretch is asked for.
    counts = {rid: 0 for rid in prompts}
    together = []
    for ids in frames:
        for rid in ids:
            counts[rid] += 1
        if all(counts.values()) and max(counts.values()) < 20:
            together.append(ids)
    assert together and all(len(ids) == 4 for ids in together), frames
    served.wait_idle()


@pytest.mark.parametrize(
    "msg,words",
    [
        (Generate("v-empty", []), ["The decoder prompt cannot be empty"]),
        (Generate("v-vocab", [2, 3, VOCAB]), ["vocabulary", str(VOCAB)]),
        (Generate("v-max0", [2, 3], max_tokens=0), ["max_tokens", "at least 1"]),
        (Generate("v-len", [2] * 100, max_tokens=2000), ["max_model_len", "2048"]),
        (Generate("v-pool", [2] * 10, max_tokens=1100), ["blocks", "pool", str(NUM_BLOCKS - 1)]),
    ],
    ids=lambda x: x.request_id if isinstance(x, Generate) else None,
)
def test_bad_requests_are_refused_and_change_nothing(served, msg, words):
    before = served.sched.metrics()
    served.client.send(msg)
    err = served.client.error()
    assert err.request_id == msg.request_id
    for w in words:
        assert w in err.message, err.message
    after = served.sched.metrics()
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total"):
        assert metric(after, name) == metric(before, name), name
    # A valid request afterwards works, and leaves the pool empty.
    prompt = prompt_of(2, 20)
    assert tokens_of(served.client.generate("v-ok-" + msg.request_id, prompt, 3)) == expected_tokens(prompt, 3)
    served.wait_idle()


def test_duplicate_request_id_is_refused_while_it_runs(served):
    served.worker.delay_s = 0.01
    try:
        served.client.send(Generate("dup", prompt_of(3, 20), max_tokens=50, ignore_eos=True))
        first = served.client.recv()
        assert isinstance(first, TokenOutput) and first.request_id == "dup"
        served.client.send(Generate("dup", prompt_of(4, 20), max_tokens=5, ignore_eos=True))
        # Tokens of the first keep coming; the refusal is among them.
        outs, errors = [first], []
        while not outs[-1].finished:
            msg = served.client.recv()
            (errors if isinstance(msg, RequestError) else outs).append(msg)
        if not errors:
            errors.append(served.client.error())
        assert "duplicate" in errors[0].message and errors[0].request_id == "dup"
        assert tokens_of(outs) == expected_tokens(prompt_of(3, 20), 50)
    finally:
        served.worker.delay_s = 0.0
    served.wait_idle()


def test_unreadable_frames_get_an_error_and_the_process_survives(served):
    c = served.client
    c.send_raw(b"\xc1garbage")
    assert c.error().request_id is None
    c.send_raw(b"")
    assert "empty" in c.error().message
    c.send_raw(Codec(WorkerToScheduler).encode(StepResult(0, [1], [2])))  # a worker message
    assert c.error().request_id is None
    c.send_raw(c.out.encode(Generate("mp", [2, 3])), b"second frame")
    err = c.error()
    assert "frame" in err.message and err.request_id == "mp"
    # A frame that is a map with a request_id is refused naming it, whatever else is
    # wrong with it, so that the refusal reaches the request's waiter (issue 23's hang).
    c.send_raw(msgspec.msgpack.encode({"type": "generate", "request_id": "neg", "prompt_token_ids": [2, -3]}))
    err = c.error()
    assert "prompt_token_ids" in err.message and err.request_id == "neg"
    long_id = "r" * 300  # over the wire's 256 characters
    c.send_raw(msgspec.msgpack.encode({"type": "generate", "request_id": long_id, "prompt_token_ids": [2, 3]}))
    err = c.error()
    assert "request_id" in err.message and err.request_id == long_id
    # A stop id past int32 decodes (any int64 does) and is refused in vLLM's words, naming the field.
    c.send(Generate("huge-stop", [2, 3], stop_token_ids=[2**40]))
    err = c.error()
    assert (err.request_id, err.param) == ("huge-stop", "stop_token_ids")
    assert err.message.startswith(f"token_id(s) [{2**40}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size:")
    c.send(Abort("nobody"))
    err = c.error()
    assert err.request_id == "nobody" and "unknown request" in err.message
    assert served.sched.proc.poll() is None
    prompt = prompt_of(5, 17)
    assert tokens_of(c.generate("after-garbage", prompt, 4)) == expected_tokens(prompt, 4)
    served.wait_idle()


def test_abort_of_a_running_request_frees_its_blocks(served):
    served.worker.delay_s = 0.01
    other = Client(served.ctx, served.sched.client_address)
    try:
        c = served.client
        c.send(Generate("ab", prompt_of(6, 40), max_tokens=900, ignore_eos=True))
        first = c.recv()
        assert isinstance(first, TokenOutput) and not first.finished
        assert metric(served.sched.metrics(), "vllm:kv_cache_usage_perc") > 0
        # Only the client that sent a request may abort it.
        other.send(Abort("ab"))
        assert "unknown request" in other.error().message
        c.send(Abort("ab"))
        outs = [first]
        while not outs[-1].finished:
            outs.append(c.recv())
        assert outs[-1].finish_reason == "abort" and outs[-1].new_token_ids == []
        assert len(tokens_of(outs)) < 900
        assert tokens_of(outs) == expected_tokens(prompt_of(6, 40), len(tokens_of(outs)))
    finally:
        served.worker.delay_s = 0.0
        other.close()
    served.wait_idle()


def test_metrics_have_vllm_names_and_move(served):
    names = [
        "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "kvpool_free_cached_blocks",
        "kvpool_evictions_total", "kvpool_steps_total", "kvpool_plan_bytes_total", "kvpool_num_gpu_blocks",
    ]
    histograms = [
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds", "kvpool_step_duration_seconds",
    ]
    before = served.wait_idle()
    for name in names:
        metric(before, name)
    for name in histograms:
        metric(before, f"{name}_bucket", 'le="+Inf"')
        metric(before, f"{name}_count")
    assert metric(before, "kvpool_num_gpu_blocks") == NUM_BLOCKS

    shared = prompt_of(7, 32)
    a, b = shared + prompt_of(8, 16), shared + prompt_of(9, 16)
    served.client.generate("m1", a, 4)
    outs = served.client.generate("m2", b, 4)
    assert outs[0].num_cached_tokens == 32
    after = served.wait_idle()

    def delta(name, extra=""):
        return metric(after, name, extra) - metric(before, name, extra)

    assert delta("vllm:prefix_cache_queries_total") == 96
    assert delta("vllm:prefix_cache_hits_total") == 32
    assert delta("vllm:prompt_tokens_total") == 96
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    # Prefills of both, then 3 decode steps each.
    assert delta("kvpool_steps_total") == 8
    assert delta("kvpool_step_duration_seconds_count") == 8
    assert delta("kvpool_plan_bytes_total") > 0
    assert delta("vllm:num_preemptions_total") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    # Both requests' full blocks stay cached while free.
    assert metric(after, "kvpool_free_cached_blocks") >= 4


def test_reset_prefix_cache_is_404_without_dev_mode(served):
    assert served.sched.http("POST", "/reset_prefix_cache")[0] == 404


@pytest.mark.parametrize("how", ["flag", "env"])
def test_reset_prefix_cache_in_dev_mode(how):
    s = Setup("--dev-mode") if how == "flag" else Setup(env_extra={"KVPOOL_DEV_MODE": "1"})
    try:
        prompt = prompt_of(10, 48)
        assert s.client.generate("d1", prompt, 2)[0].num_cached_tokens == 0
        assert s.client.generate("d2", prompt, 2)[0].num_cached_tokens == 32
        s.wait_idle()
        status, body = s.sched.http("POST", "/reset_prefix_cache")
        assert status == 200, body
        assert metric(s.sched.metrics(), "kvpool_free_cached_blocks") == 0
        assert s.client.generate("d3", prompt, 2)[0].num_cached_tokens == 0
        # While a request holds blocks: refused, with the reason.
        s.worker.delay_s = 0.01
        s.client.send(Generate("d4", prompt, max_tokens=500, ignore_eos=True))
        first = s.client.recv()
        assert isinstance(first, TokenOutput)
        status, body = s.sched.http("POST", "/reset_prefix_cache")
        assert status == 409 and "held" in body, body
        s.client.send(Abort("d4"))
        while not s.client.recv().finished:
            pass
        s.wait_idle()
        assert s.sched.http("POST", "/reset_prefix_cache")[0] == 200
        assert s.worker.errors == []
    finally:
        s.close()


def test_sigterm_aborts_running_requests_and_shuts_the_worker_down():
    s = Setup()
    try:
        s.worker.delay_s = 0.02
        s.client.send(Generate("t1", prompt_of(11, 20), max_tokens=900, ignore_eos=True))
        assert isinstance(s.client.recv(), TokenOutput)
        s.sched.proc.send_signal(signal.SIGTERM)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(s.client.recv())
        assert outs[-1].finish_reason == "abort"
        # NOTE: a bound for a loaded machine; shutdown waits at most one step.
        assert s.sched.proc.wait(timeout=30) == 0, s.sched.output()
        assert s.worker.got_shutdown.wait(2), "the worker never got Shutdown"
        assert s.worker.errors == []
    finally:
        s.close()


def test_a_silent_worker_is_dropped_and_a_returning_one_resumes_the_requests():
    s = Setup("--worker-timeout", "1")
    try:
        s.worker.delay_s = 0.01
        prompt = prompt_of(12, 30)
        s.client.send(Generate("w1", prompt, max_tokens=60, ignore_eos=True))
        outs = [s.client.recv() for _ in range(5)]
        s.worker.silent = True
        s.sched.wait_health(503, bound_s=15)  # after --worker-timeout 1
        # The worker comes back (same socket, hello again): the request is resumed
        # by recompute and its outputs are what they would have been.
        s.worker.rehello()
        assert s.worker.ready.wait(5)
        assert s.worker.readies[-1].next_step_id > 0
        s.sched.wait_health(200)
        while not outs[-1].finished:
            outs.append(s.client.recv())
        assert outs[-1].finish_reason == "length"
        assert tokens_of(outs) == expected_tokens(prompt, 60)
        m = s.wait_idle()
        # Its one request was recomputed for the lost worker: not a preemption.
        assert metric(m, "kvpool_worker_loss_recomputes_total") == 1
        assert metric(m, "vllm:num_preemptions_total") == 0
        assert s.worker.errors == []
    finally:
        s.close()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler", *args], cwd=REPO, capture_output=True, text=True, timeout=30)


def test_a_non_loopback_host_is_refused():
    r = _run_cli("--host", "0.0.0.0", "--port", str(free_port()))
    assert r.returncode != 0
    assert "CURVE" in r.stderr and "loopback" in r.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["--block-size", "0"], ["--block-size", "positive"]),
        (["--max-num-seqs", "-1"], ["--max-num-seqs", "positive"]),
        (["--worker-timeout", "0"], ["--worker-timeout", "positive"]),
        (["--max-num-waiting", "0"], ["--max-num-waiting", "positive"]),
        (["--num-gpu-blocks-override", "1"], ["--num-gpu-blocks-override", "at least 2"]),
        (["--port", "70000"], ["--port", "port number"]),
        (["--block-size", "sixteen"], ["--block-size", "invalid int"]),
    ],
)
def test_bad_flag_values_exit_non_zero_with_a_clear_message(args, words):
    r = _run_cli(*args)
    assert r.returncode != 0
    for w in words:
        assert w in r.stderr, r.stderr
