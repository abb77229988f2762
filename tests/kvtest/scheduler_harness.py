"""A harness for running `python -m scheduler` as a real process over real loopback
sockets, with a worker that is a ZMQ DEALER thread in the test process: it speaks
protocol.worker_messages and executes plans with FakeWorker (which checks the
contract and samples deterministically, so expected outputs are known in advance).
Clients are DEALERs. Every process and socket is closed by its owner's close();
every receive has a timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq

from kvtest.fake_worker import FakeWorker, fake_sample
from kvtest.ports import free_port  # noqa: F401 (re-exported for the tests that import it from here)
from kvtest.replies import Replies
from protocol.client_messages import (
    ClientRequest,
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
    WorkerError,
    WorkerExit,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 64
BS = 16
VOCAB = 512
EOS = 1
MODEL = "test-model"
# What the fake worker's hello reports of its KV cache and weights: bfloat16, 2 layers with
# 1 KV head of 4 dims (tests/scheduler/engine/test_perf_metrics.py's TINY): K and V of BS tokens.
KV_BLOCK_BYTES = 2 * 2 * BS * 1 * 4 * 2


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
        ]
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

    def __init__(self, ctx: zmq.Context, address: str, num_blocks: int = NUM_BLOCKS, num_host_blocks: int = 0):
        self.ctx, self.address, self.num_blocks = ctx, address, num_blocks
        # Host-tier slots offered in the hello (the offload tier); 0: none.
        self.num_host_blocks = num_host_blocks
        self.to_worker: Codec = Codec(SchedulerToWorker)
        self.to_scheduler: Codec = Codec(WorkerToScheduler)
        self.delay_s = 0.0
        self.silent = False
        # Answer every plan with a WorkerError (a worker whose state went bad).
        self.refuse_plans = False
        self.ready = threading.Event()
        self.got_shutdown = threading.Event()
        self.readies: list[WorkerReady] = []
        self.errors: list[str] = []
        self.steps = 0
        self.fake: FakeWorker | None = None
        self._stop = threading.Event()
        self._rehello = threading.Event()
        self._leave: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def leave(self, reason: str) -> None:
        """Say WorkerExit (a worker stopping on SIGTERM), then go silent."""
        self._leave = reason

    def rehello(self) -> None:
        self.ready.clear()
        self.silent = False
        self._rehello.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _hello(self) -> WorkerHello:
        return WorkerHello(rank=0, world_size=1, num_blocks=self.num_blocks, block_size=BS, vocab_size=VOCAB, eos_token_id=EOS,
                           num_host_blocks=self.num_host_blocks, kv_cache_dtype="bfloat16", kv_cache_dtype_size=2,
                           kv_block_bytes=KV_BLOCK_BYTES, dtype="bfloat16", dtype_size=2)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            sock.send(self.to_scheduler.encode(self._hello()))
            last_sent = time.monotonic()
            while not self._stop.is_set():
                if self._leave is not None:
                    sock.send(self.to_scheduler.encode(WorkerExit(self._leave)))
                    self._leave, self.silent = None, True
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
                        self.fake = FakeWorker(msg.num_blocks, BS, VOCAB, num_host_blocks=msg.num_host_blocks)
                        self.fake.expected_step = msg.next_step_id
                        self.ready.set()
                        # The acknowledgement: the scheduler is ready only once it hears it.
                        sock.send(self.to_scheduler.encode(Heartbeat(time.time())))
                        last_sent = time.monotonic()
                    case StepPlan():
                        reply = WorkerError("refused on purpose", msg.step_id) if self.refuse_plans else self._execute(msg)
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
        self.replies = Replies(self.sock)

    def send(self, msg) -> None:
        self.sock.send(self.out.encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 5.0) -> TokenOutput | RequestError:
        """The next TokenOutput (of a step's EngineCoreOutputs frame) or RequestError."""
        return self.replies.recv(timeout_s)

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

    def start_worker(self, **kw) -> WorkerThread:
        self.worker = WorkerThread(self.ctx, self.sched.worker_address, **kw)
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
