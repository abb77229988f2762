"""Stand-ins for `python -m scheduler` / `python -m worker` / `kvpool serve` to test
deploy/run.sh.

    fake_kvpool.py scheduler --port P --http-port H ...   zmq ROUTER answering Generate
                                                         (2 tokens, "length"), /health 200
    fake_kvpool.py worker ...                            idles until SIGTERM
    fake_kvpool.py serve MODEL --port P ...              the OpenAI API on P: /health 200,
                                                         /v1/models, streamed /v1/completions
                                                         (max_tokens tokens, usage), /metrics
    fake_kvpool.py serve MODEL --port P --kv-transfer-config JSON
                                                         the same, as a P/D engine of that kv_role:
                                                         a "stream": false request is answered in
                                                         one JSON body, with kv_transfer_params when
                                                         it asked do_remote_decode; /metrics counts
                                                         requests, and a consumer's prompt tokens
                                                         under source="p2p"

Both exit 0 on SIGTERM; with FAKE_IGNORE_TERM=<role> that role ignores SIGTERM (to test
the launcher's SIGKILL path). Unknown flags are accepted and ignored.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading

import zmq

from protocol.client_messages import ClientRequest, EngineCoreOutputs, Generate, TokenOutput
from protocol.codec import Codec


def serve_http(port: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"ok\n" if self.path == "/health" else b"vllm:kv_cache_usage_perc 0.5\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class PDCounters:
    """What a fake P/D engine has served, for its /metrics (vLLM's names)."""

    def __init__(self, kv_role: str):
        self.kv_role = kv_role
        self.lock = threading.Lock()
        self.num_requests = 0
        self.num_p2p_tokens = 0

    def page(self) -> bytes:
        with self.lock:
            return (f"vllm:request_success_total{{finished_reason=\"length\"}} {self.num_requests}.0\n"
                    f"vllm:prefix_cache_queries_total 0.0\nvllm:prefix_cache_hits_total 0.0\n"
                    f"vllm:prompt_tokens_cached_by_source_total{{source=\"p2p\"}} {self.num_p2p_tokens}.0\n").encode()

    def served(self, body: dict) -> None:
        kv = body.get("kv_transfer_params") or {}
        with self.lock:
            self.num_requests += 1
            if kv.get("do_remote_prefill") and self.kv_role != "kv_producer":
                self.num_p2p_tokens += len(body["prompt"])

    def answer(self, body: dict) -> dict:
        """A non-streamed completion; a prefill's carries the params its decode engine needs."""
        kv = body.get("kv_transfer_params") or {}
        n = body.get("max_tokens", 16)
        answer = {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model", "fake"),
                  "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}}
        if kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake",
                                            "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": 0}
        return answer


def serve_api(port: int, pd: PDCounters | None = None) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, body: bytes, content_type: str = "application/json"):
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if self.path == "/v1/models":
                self._send(json.dumps({"data": [{"id": "fake", "root": "fake"}]}).encode())
            elif self.path == "/health":
                self._send(b"", "text/plain")
            else:
                self._send(b"vllm:kv_cache_usage_perc 0.5\n" + (pd.page() if pd else b""), "text/plain")

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if pd is not None:
                pd.served(body)
                if body.get("stream") is not True:
                    self._send(json.dumps(pd.answer(body)).encode())
                    return
            n = body.get("max_tokens", 16)
            events = [{"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]} for i in range(n)]
            events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                                    "prompt_tokens_details": {"cached_tokens": 0}}})
            self._send(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n",
                       "text/event-stream")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> int:
    role = sys.argv[1]
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--http-port", type=int)
    p.add_argument("--kv-transfer-config")
    args, _ = p.parse_known_args(sys.argv[2:])
    stop = threading.Event()
    if os.environ.get("FAKE_IGNORE_TERM") == role:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"fake {role} up", flush=True)
    if role == "worker":
        while not stop.wait(0.1):
            pass
        return 0
    if role == "serve":
        pd = PDCounters(json.loads(args.kv_transfer_config)["kv_role"]) if args.kv_transfer_config else None
        server = serve_api(args.port, pd)
        print(f"kvpool serve: fake ready at http://127.0.0.1:{args.port}/v1 (KV cache: 256 blocks × 16 tokens, 8.0 MiB)", flush=True)
        while not stop.wait(0.1):
            pass
        server.shutdown()
        return 0
    server = serve_http(args.http_port)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    codec: Codec = Codec(ClientRequest)
    try:
        while not stop.is_set():
            if not sock.poll(100):
                continue
            ident, frame = sock.recv_multipart()
            msg = codec.decode(frame)
            if isinstance(msg, Generate):
                out = TokenOutput(msg.request_id, [2] * msg.max_tokens, True, "length")
                sock.send_multipart([ident, codec.encode(EngineCoreOutputs([out]))])
    finally:
        sock.close(linger=0)
        ctx.term()
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
