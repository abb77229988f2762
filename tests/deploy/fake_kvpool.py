"""Stand-ins for `python -m scheduler` / `python -m worker` to test deploy/run.sh.

    fake_kvpool.py scheduler --port P --http-port H ...   zmq ROUTER answering Generate
                                                         (2 tokens, "length"), /health 200
    fake_kvpool.py worker ...                            idles until SIGTERM

Both exit 0 on SIGTERM; with FAKE_IGNORE_TERM=<role> that role ignores SIGTERM (to test
the launcher's SIGKILL path). Unknown flags are accepted and ignored.
"""

from __future__ import annotations

import argparse
import http.server
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


def main() -> int:
    role = sys.argv[1]
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--http-port", type=int)
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
