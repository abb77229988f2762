"""The fleet simulator's kv_aware (simulator/routers.py `KvAware`) decides as the real
vllm-router 0.1.17 does, on states the test sets up exactly.

The router runs for real. Its two workers are test doubles: HTTP servers that answer
what the router asks (/health, /v1/models, /v1/completions/render: the prompt's
numbers are its token ids) and hold each completion until the test releases it, each
with a ZMQ publisher of vLLM's KV events that the test fills. So the test knows what
the router knows: the blocks each worker holds, the requests in flight on each, which
of them are still prefilling (held before any byte of a non-streamed answer, or after
the first chunk of a streamed one). For each case the router's pick must be the
simulator's pick from the same state; each case's costs are far from a tie (a tie goes
to the first worker of the router's own hash order, random per process).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import zmq
from kvtest.router import require_router

from bench.replicas import Router, kv_aware_args
from protocol import kv_events as wire
from protocol.kv_events import KVEventBatch, batch_codec, encode_seq
from scheduler.core.kv_events import BlockStored
from simulator.routers import KvAware

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "probe-model"
BLOCK = 16
RELEASE_TIMEOUT_S = 60


class FakeWorker:
    """An HTTP worker the router can route to, and the KV events it "publishes"."""

    def __init__(self, name: str, ctx: zmq.Context):
        self.name = name
        self.holds: dict[str, threading.Event] = {}  # prompt tag -> released
        self.received: list[str] = []  # prompt tags, in arrival order
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.kv_events_endpoint = f"tcp://127.0.0.1:{port}"  # bench.replicas.kv_aware_args reads it
        self.seq = 0
        self.codec = batch_codec()

    def store(self, tokens: list[int]) -> None:
        """BlockStored for the whole blocks of ``tokens``, one chain from the root."""
        n = len(tokens) // BLOCK
        hashes = [hash((self.name, tuple(tokens[: (i + 1) * BLOCK]))) & (2**63 - 1) for i in range(n)]
        ev = wire.BlockStored(hashes, None, tokens[: n * BLOCK], BLOCK, None, "GPU", None)
        payload = self.codec.encode(KVEventBatch(time.time(), [ev], 0))
        self.pub.send_multipart([b"", encode_seq(self.seq), payload])
        self.seq += 1

    def close(self) -> None:
        for ev in list(self.holds.values()):
            ev.set()
        self.server.shutdown()
        self.server.server_close()
        self.pub.close()

    def _handler(self):
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, obj, code: int = 200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/health":
                    return self._json({})
                if path == "/v1/models":
                    return self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                self._json({"error": "not here"}, 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                tag, *ids = body.get("prompt", "").split()
                if self.path == "/v1/completions/render":
                    req = {"request_id": tag, "token_ids": [int(t) for t in ids], "model": MODEL, "stream": False,
                           "sampling_params": {"max_tokens": body.get("max_tokens", 1)}}
                    return self._json([req])
                if self.path != "/v1/completions":
                    return self._json({"error": "not here"}, 404)
                with worker.lock:
                    worker.received.append(tag)
                    release = worker.holds.get(tag)
                choice = {"index": 0, "text": "x", "finish_reason": "length"}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b"data: " + json.dumps({"choices": [{**choice, "finish_reason": None}]}).encode() + b"\n\n")
                    self.wfile.flush()
                    if release is not None:
                        release.wait(RELEASE_TIMEOUT_S)
                    self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\ndata: [DONE]\n\n")
                    self.close_connection = True
                    return
                if release is not None:
                    release.wait(RELEASE_TIMEOUT_S)
                self._json({"id": tag, "object": "text_completion", "model": MODEL, "choices": [choice],
                            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}})

        return Handler


@dataclass
class Fleet:
    router_url: str
    workers: list[FakeWorker]
    tokens: itertools.count
    tags: itertools.count

    def fresh(self, blocks: int) -> list[int]:
        """Tokens no other case uses."""
        base = next(self.tokens) * 100_000
        return [base + i for i in range(blocks * BLOCK)]

    def send(self, tokens: list[int], stream: bool = False, hold: bool = False) -> tuple[str, threading.Thread]:
        tag = f"t{next(self.tags)}"
        if hold:
            release = threading.Event()
            for w in self.workers:
                w.holds[tag] = release
        body = {"model": MODEL, "prompt": " ".join([tag, *map(str, tokens)]), "max_tokens": 1, "stream": stream}
        req = urllib.request.Request(self.router_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})

        def post():
            with urllib.request.urlopen(req, timeout=RELEASE_TIMEOUT_S + 30) as r:
                r.read()

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        if not hold:
            thread.join(30)
        return tag, thread

    def where(self, tag: str, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, w in enumerate(self.workers):
                if tag in w.received:
                    return i
            time.sleep(0.02)
        raise TimeoutError(f"request {tag} reached no worker within {timeout:g} s")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_router()
    ctx = zmq.Context()
    workers = [FakeWorker(name, ctx) for name in ("w0", "w1")]
    router = None
    try:
        router = Router([w.url for w in workers], "kv_aware", tmp_path_factory.mktemp("router") / "router.log",
                        *kv_aware_args(workers, BLOCK, MODEL), "--worker-startup-check-interval", "1")
        router.wait_ready()
        time.sleep(1.0)  # the event subscribers connect (a PUB drops what no one reads)
        yield Fleet(router.url, workers, itertools.count(1), itertools.count())
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.close()
        ctx.term()


# Each case: the requests in flight on worker 0 (blocks of it held there, blocks past
# them, streamed), then the request routed (blocks worker 0 holds, blocks past them),
# and where it goes, by hand: worker 0 costs (its tokens to prefill + those of its
# requests still prefilling) x (1 + its requests in flight), the idle worker 1 the
# whole prompt.
CASES = {
    "idle, the holder wins": ([], 8, 2, 0),  # 32 < 160
    "one in flight prefilling 64 tokens, 8 held blocks do not pay for it": ([(4, 4, False)], 8, 1, 1),  # 160 > 144
    "one in flight prefilling 64 tokens, 10 held blocks do": ([(4, 4, False)], 10, 1, 0),  # 160 < 176
    "one in flight, streamed past its first token: only the count weighs": ([(4, 4, True)], 8, 1, 0),  # 32 < 144
    "two in flight multiply the cost": ([(4, 1, False), (4, 1, False)], 8, 2, 1),  # (32 + 32) x 3 > 160
    "one of them": ([(4, 1, False)], 8, 2, 0),  # (32 + 16) x 2 < 160
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_picks_what_vllm_router_picks(fleet, case):
    holds, held_blocks, new_blocks, by_hand = CASES[case]
    w0 = fleet.workers[0]
    model = KvAware(2, BLOCK)
    loads, prefilling = [0, 0], [0, 0]
    threads, tags = [], []
    try:
        for q, extra, stream in holds:
            prefix = fleet.fresh(q)
            w0.store(prefix)
            time.sleep(0.5)  # the router has read the event
            tag, thread = fleet.send(prefix + fleet.fresh(extra), stream=stream, hold=True)
            tags.append(tag)
            threads.append(thread)
            assert fleet.where(tag) == 0, "the set-up request went to worker 0"
            loads[0] += 1
            prefilling[0] += 0 if stream else extra * BLOCK
        time.sleep(0.5)  # a streamed request's first chunk has reached the router
        prefix = fleet.fresh(held_blocks)
        w0.store(prefix)
        time.sleep(0.5)  # the router has read the event
        hashes = [b"held-%d" % i for i in range(held_blocks)]
        model.index.apply(0, [BlockStored(hashes, None, None, BLOCK)])
        simulated, _ = model.choose((held_blocks + new_blocks) * BLOCK, hashes + [b"new"] * new_blocks, loads, prefilling)
        tag, _ = fleet.send(prefix + fleet.fresh(new_blocks))
        assert (fleet.where(tag), simulated) == (by_hand, by_hand)
    finally:
        for tag in tags:
            w0.holds[tag].set()
        for thread in threads:
            thread.join(30)

