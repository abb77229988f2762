"""Fakes for the load generator's tests: a scheduler (zmq ROUTER in a thread) and a
/metrics endpoint (http.server in a thread). Both bind 127.0.0.1 on a free port and
are stopped when the fixture ends."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator

import pytest
import zmq

from protocol.client_messages import (
    Abort,
    ClientRequest,
    EngineCoreOutputs,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec, ProtocolError

# behaviour(index) -> "ok" | "reject" | "silent" | "abort"; index parsed from "<prefix>-<index>".
Behaviour = Callable[[int], str]


def fake_tokens(prompt: list[int], n: int, vocab_size: int = 512) -> list[int]:
    """What the fake model 'generates': deterministic in the prompt."""
    base = sum(prompt)
    return [2 + (base + 7 * k) % (vocab_size - 2) for k in range(n)]


class FakeScheduler:
    """Answers Generate with max_tokens tokens (first alone, then pairs), finished='length',
    each TokenOutput in an EngineCoreOutputs frame of its own."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or (lambda i: "ok")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.received: list[Generate] = []
        self.aborted: list[str] = []
        self.bad_frames = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-scheduler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        req_codec: Codec[ClientRequest] = Codec(ClientRequest)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            try:
                msg = req_codec.decode(frame)
            except ProtocolError as e:
                self.bad_frames += 1
                self._send(ident, RequestError(message=str(e)), req_codec)
                continue
            if isinstance(msg, Abort):
                self.aborted.append(msg.request_id)
                continue
            self.received.append(msg)
            self._answer(ident, msg, req_codec)

    def _send(self, ident: bytes, msg, codec: Codec) -> None:
        self.sock.send_multipart([ident, codec.encode(msg)])

    def _answer(self, ident: bytes, msg: Generate, codec: Codec) -> None:
        index = int(msg.request_id.rsplit("-", 1)[1])
        what = self.behaviour(index)
        rid = msg.request_id
        if what == "silent":
            return
        if what == "reject":
            self._send(ident, RequestError(message="prompt too long", request_id=rid), codec)
            return
        if what == "abort":
            out = TokenOutput(
                request_id=rid, new_token_ids=[], finished=True, finish_reason="abort"
            )
            self._send(ident, EngineCoreOutputs([out]), codec)
            return
        tokens = fake_tokens(msg.prompt_token_ids, msg.max_tokens)
        chunks = [tokens[:1]] + [tokens[i : i + 2] for i in range(1, len(tokens), 2)]
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            out = TokenOutput(
                request_id=rid,
                new_token_ids=chunk,
                finished=last,
                finish_reason="length" if last else None,
                num_cached_tokens=16 if k == 0 else 0,
            )
            self._send(ident, EngineCoreOutputs([out]), codec)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fake_scheduler_factory() -> Iterator[Callable[..., FakeScheduler]]:
    started: list[FakeScheduler] = []

    def make(behaviour: Behaviour | None = None) -> FakeScheduler:
        s = FakeScheduler(behaviour)
        started.append(s)
        return s

    try:
        yield make
    finally:
        for s in started:
            s.stop()


METRICS_TEMPLATE = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {usage}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="tiny"}} {preemptions}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} 1.0
# HELP kvpool_free_cached_blocks Free blocks that still hold a cached hash.
# TYPE kvpool_free_cached_blocks gauge
kvpool_free_cached_blocks{{engine="0",model_name="tiny"}} 12.0
"""


class FakeMetrics:
    """Each scrape n (from 0): usage = 0.1*n capped at 1, queries += 100, hits += 40,
    preemptions += 1, so Δhits/Δqueries is exactly 0.4."""

    def __init__(self):
        self.scrapes = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                n = fake.scrapes
                fake.scrapes += 1
                body = METRICS_TEMPLATE.format(
                    usage=min(1.0, 0.1 * n), queries=100 * n, hits=40 * n, preemptions=n
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def fake_metrics() -> Iterator[FakeMetrics]:
    m = FakeMetrics()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def expected_tokens() -> Callable[[list[int], int], list[int]]:
    """The token ids the fake scheduler streams for a prompt."""
    return fake_tokens
