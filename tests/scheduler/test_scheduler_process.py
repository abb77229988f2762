"""`python -m scheduler` as a real process over real loopback sockets.

The worker is a ZMQ DEALER in this test process (a thread) that speaks
protocol.worker_messages and executes plans with kvtest's FakeWorker, which checks
the contract on every plan and samples deterministically from a row's tokens, so
the expected outputs are known in advance. Clients are DEALERs. Every process and
socket is closed in a finally; every receive has a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
from kvtest.fake_worker import FakeWorker, fake_sample

from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec
from protocol.worker_messages import (
    Heartbeat,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 64
BS = 16
VOCAB = 512
EOS = 1
MODEL = "test-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_sample(tokens, VOCAB))
    return tokens[len(prompt) :]


def prompt_of(seed: int, n: int) -> list[int]:
    return [2 + (seed * 7919 + i * 31) % (VOCAB - 2) for i in range(n)]


# --- the scheduler process ------------------------------------------------------------


class SchedulerProcess:
    def __init__(self, *args: str, env_extra: dict[str, str] | None = None):
        self.port, self.worker_port, self.http_port = free_port(), free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k != "KVPOOL_DEV_MODE"}
        env.update(env_extra or {})
        cmd = [
            sys.executable, "-m", "scheduler", "--port", str(self.port), "--worker-port", str(self.worker_port),
            "--http-port", str(self.http_port), "--served-model-name", MODEL, "--log-level", "WARNING", *args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.client_address = f"tcp://127.0.0.1:{self.port}"
        self.worker_address = f"tcp://127.0.0.1:{self.worker_port}"

    def http(self, method: str, path: str) -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=3) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_http(self, bound_s: float = 15.0) -> None:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"scheduler exited: {self.output()}"
            try:
                self.http("GET", "/health")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.05)
        raise AssertionError("the scheduler's HTTP server did not come up")

    def wait_health(self, status: int, bound_s: float = 5.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound_s:
            if self.http("GET", "/health")[0] == status:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"/health never returned {status}")

    def metrics(self) -> dict[str, float]:
        status, text = self.http("GET", "/metrics")
        assert status == 200
        return parse_metrics(text)

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, the labels sorted (so lookups ignore their order)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m:
            labels = ",".join(sorted(re.findall(r'[a-zA-Z_]\w*="[^"]*"', m.group(2) or "")))
            out[f"{m.group(1)}{{{labels}}}"] = float(m.group(3))
    return out


def metric(values: dict[str, float], name: str, extra: str = "") -> float:
    """The sample of ``name`` with our model_name/engine labels (plus ``extra``)."""
    labels = ",".join(sorted([f'model_name="{MODEL}"', 'engine="0"', *([extra] if extra else [])]))
    key = f"{name}{{{labels}}}"
    if key not in values:
        raise KeyError(f"{key} not in /metrics")
    return values[key]


# --- the fake worker, a thread --------------------------------------------------------


class WorkerThread:
    """A DEALER speaking the worker protocol, driven by FakeWorker.

    ``delay_s``: sleep before answering each plan (a slow model). ``silent``: drop
    every message and send nothing (a hung worker). ``rehello()``: say hello again.
    """

    def __init__(self, ctx: zmq.Context, address: str, num_blocks: int = NUM_BLOCKS):
        self.ctx, self.address, self.num_blocks = ctx, address, num_blocks
        self.to_worker: Codec = Codec(SchedulerToWorker)
        self.to_scheduler: Codec = Codec(WorkerToScheduler)
        self.delay_s = 0.0
        self.silent = False
        self.ready = threading.Event()
        self.got_shutdown = threading.Event()
        self.readies: list[WorkerReady] = []
        self.errors: list[str] = []
        self.steps = 0
        self.fake: FakeWorker | None = None
        self._stop = threading.Event()
        self._rehello = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rehello(self) -> None:
        self.ready.clear()
        self.silent = False
        self._rehello.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _hello(self) -> WorkerHello:
        return WorkerHello(rank=0, world_size=1, num_blocks=self.num_blocks, block_size=BS, vocab_size=VOCAB, eos_token_id=EOS)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            sock.send(self.to_scheduler.encode(self._hello()))
            last_sent = time.monotonic()
            while not self._stop.is_set():
                if self._rehello.is_set():
                    self._rehello.clear()
                    sock.send(self.to_scheduler.encode(self._hello()))
                    last_sent = time.monotonic()
                if not self.silent and self.ready.is_set() and time.monotonic() - last_sent > 0.3:
                    sock.send(self.to_scheduler.encode(Heartbeat(time.time())))
                    last_sent = time.monotonic()
                if not sock.poll(50):
                    continue
                frame = sock.recv()
                if self.silent:
                    continue
                try:
                    msg = self.to_worker.decode(frame)
                except Exception as e:  # noqa: BLE001 - recorded, the test fails on it
                    self.errors.append(f"bad frame: {e}")
                    continue
                match msg:
                    case WorkerReady():
                        self.readies.append(msg)
                        self.fake = FakeWorker(msg.num_blocks, BS, VOCAB)
                        self.fake.expected_step = msg.next_step_id
                        self.ready.set()
                    case StepPlan():
                        reply = self._execute(msg)
                        if self.silent or self._stop.is_set():
                            continue
                        sock.send(self.to_scheduler.encode(reply))
                        last_sent = time.monotonic()
                    case Shutdown():
                        self.got_shutdown.set()
                    case Heartbeat():
                        pass
        finally:
            sock.close(linger=0)

    def _execute(self, plan: StepPlan):
        if self.delay_s:
            time.sleep(self.delay_s)
        fake = self.fake
        # NOTE: after a reconnect the scheduler resends every live row as resumed;
        # to a fresh worker those rows come back after a preemption it never saw
        # (the real worker accepts a resumed row it does not hold, see plan_check).
        for row in plan.resumed_rows:
            if row.seq_id not in fake.rows:
                fake.preempted.add(row.seq_id)
        try:
            result = fake.execute(plan)
        except AssertionError as e:
            self.errors.append(f"step {plan.step_id}: {e}")
            return WorkerError(str(e), plan.step_id)
        self.steps += 1
        return result


# --- clients --------------------------------------------------------------------------


class Client:
    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.out: Codec = Codec(ClientRequest)
        self.inp: Codec = Codec(ClientResponse)

    def send(self, msg) -> None:
        self.sock.send(self.out.encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 5.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply from the scheduler within {timeout_s} s")
        return self.inp.decode(self.sock.recv())

    def error(self, timeout_s: float = 5.0) -> RequestError:
        msg = self.recv(timeout_s)
        assert isinstance(msg, RequestError), msg
        return msg

    def collect(self, request_id: str, timeout_s: float = 15.0) -> list[TokenOutput]:
        """Every TokenOutput of one request, up to and including the finished one."""
        outs: list[TokenOutput] = []
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(deadline - time.monotonic(), 0.01))
            assert isinstance(msg, TokenOutput), msg
            assert msg.request_id == request_id
            outs.append(msg)
            if msg.finished:
                return outs

    def generate(self, request_id: str, prompt: list[int], max_tokens: int, **kw) -> list[TokenOutput]:
        self.send(Generate(request_id, prompt, max_tokens=max_tokens, ignore_eos=True, **kw))
        return self.collect(request_id)

    def close(self) -> None:
        self.sock.close(linger=0)


def tokens_of(outs: list[TokenOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


class Setup:
    """A scheduler process, a fake worker, a client; all closed by ``close``."""

    def __init__(self, *args: str, env_extra=None, start_worker: bool = True):
        self.ctx = zmq.Context()
        self.sched = SchedulerProcess(*args, env_extra=env_extra)
        self.worker: WorkerThread | None = None
        self.client: Client | None = None
        try:
            self.sched.wait_http()
            self.client = Client(self.ctx, self.sched.client_address)
            if start_worker:
                self.start_worker()
        except BaseException:
            self.close()
            raise

    def start_worker(self) -> WorkerThread:
        self.worker = WorkerThread(self.ctx, self.sched.worker_address)
        assert self.worker.ready.wait(10), "no WorkerReady"
        self.sched.wait_health(200)
        return self.worker

    def wait_idle(self, bound_s: float = 5.0) -> dict[str, float]:
        """Metrics once no block is held and no step is in flight (an aborted
        request's last step may still be running on the worker)."""
        deadline = time.monotonic() + bound_s
        last_steps = None
        while True:
            m = self.sched.metrics()
            steps = metric(m, "kvpool_steps_total")
            if metric(m, "vllm:kv_cache_usage_perc") == 0 and metric(m, "vllm:num_requests_running") == 0 and steps == last_steps:
                return m
            last_steps = steps
            assert time.monotonic() < deadline, "blocks still held"
            time.sleep(0.1)

    def close(self) -> None:
        try:
            if self.client:
                self.client.close()
            self.sched.stop()
        finally:
            if self.worker:
                self.worker.close()
            self.ctx.term()


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


@pytest.mark.parametrize(
    "msg,words",
    [
        (Generate("v-empty", []), ["empty prompt"]),
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
    assert "frame" in c.error().message
    c.send_raw(msgspec.msgpack.encode({"type": "generate", "request_id": "neg", "prompt_token_ids": [2, -3]}))
    assert "prompt_token_ids" in c.error().message
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
    ]  # fmt: skip
    histograms = [
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds", "kvpool_step_duration_seconds",
    ]  # fmt: skip
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
        t0 = time.monotonic()
        s.sched.proc.send_signal(signal.SIGTERM)
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(s.client.recv())
        assert outs[-1].finish_reason == "abort"
        assert s.sched.proc.wait(timeout=8) == 0, s.sched.output()
        assert time.monotonic() - t0 < 5, "shutdown took too long"
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
        assert s.sched.wait_health(503, bound_s=4) < 3.5
        assert s.sched.http("GET", "/health")[0] == 503
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
        assert metric(m, "vllm:num_preemptions_total") >= 1
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
