"""A fake scheduler for tests of ``python -m frontend`` as a real process: its client
port (a ZMQ ROUTER in a thread, answering every Generate with ``max_tokens`` tokens
and ``num_cached_tokens`` cached) and its HTTP port (``/health``, ``/metrics``,
``POST /reset_prefix_cache``, in a thread). Both bind 127.0.0.1 on free ports; the
frontend process and both threads are stopped when the block ends, also on failure.
Every wait is bounded."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvtest import unix_http
from kvtest.ports import free_port
from protocol.client_messages import Abort, ClientRequest, EngineCoreOutputs, Generate, TokenOutput
from protocol.codec import Codec

STARTUP_S = 60.0


class FakeEngine:
    """The scheduler's two ports. ``generated`` holds every Generate received;
    ``reset_status`` is what POST /reset_prefix_cache answers (200 or 409). While
    ``holding`` is set, requests are kept unanswered until ``release()`` (with
    ``first_token_while_holding``, each gets one unfinished token first, then is held).
    ``metrics_page`` is what GET /metrics answers; ``kv_transfer_params``, what each
    request's finished output carries (a prefill engine's, for P/D disaggregation)."""

    def __init__(self, num_cached_tokens: int = 16):
        self.num_cached_tokens = num_cached_tokens
        self.generated: list[Generate] = []
        self.reset_status = 200
        self.resets = 0
        self.holding = threading.Event()
        self.first_token_while_holding = False
        self.metrics_page = ""
        self.kv_transfer_params: dict | None = None
        self._held: list[tuple[bytes, Generate]] = []
        self._release = threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._zmq_thread = threading.Thread(target=self._serve_zmq, name="fake-engine-zmq", daemon=True)
        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.http_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="fake-engine-http", daemon=True)
        self._zmq_thread.start()
        self._http_thread.start()

    def _serve_zmq(self) -> None:
        codec: Codec = Codec(ClientRequest)
        while not self._stop.is_set():
            if self._release.is_set():
                self._release.clear()
                held, self._held = self._held, []
                for ident, msg in held:
                    self._answer(codec, ident, msg)
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = codec.decode(frame)
            if isinstance(msg, Abort):
                continue
            self.generated.append(msg)
            if self.holding.is_set():
                if self.first_token_while_holding:
                    first = TokenOutput(request_id=msg.request_id, new_token_ids=[5], num_cached_tokens=self.num_cached_tokens)
                    self.sock.send_multipart([ident, codec.encode(EngineCoreOutputs([first]))])
                self._held.append((ident, msg))
            else:
                self._answer(codec, ident, msg)

    def release(self) -> None:
        """Answer the held requests (from the engine's thread) and hold no more."""
        self.holding.clear()
        self._release.set()

    def _answer(self, codec: Codec, ident: bytes, msg: Generate) -> None:
        tokens = [2 + (sum(msg.prompt_token_ids) + 7 * k) % 200 for k in range(msg.max_tokens)]
        out = TokenOutput(request_id=msg.request_id, new_token_ids=tokens, finished=True, finish_reason="length",
                          num_cached_tokens=self.num_cached_tokens, kv_transfer_params=self.kv_transfer_params)
        self.sock.send_multipart([ident, codec.encode(EngineCoreOutputs([out]))])

    def _handler(self):
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, text: str) -> None:
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                self._answer(200, "ok\n" if self.path == "/health" else engine.metrics_page if self.path == "/metrics" else "")

            def do_POST(self):  # noqa: N802
                if self.path != "/reset_prefix_cache":
                    return self._answer(404, "not found\n")
                engine.resets += 1
                self._answer(engine.reset_status, "prefix cache reset\n" if engine.reset_status == 200 else "refused\n")

            def log_message(self, *args):
                pass

        return Handler

    def stop(self) -> None:
        self._stop.set()
        self._zmq_thread.join(timeout=5)
        self._http.shutdown()
        self._http.server_close()
        self.sock.close(linger=0)
        self.ctx.term()


@dataclass
class Frontend:
    proc: subprocess.Popen
    port: int
    log: Path
    scheme: str = "http"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _answers(url: str, ctx: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def frontend_process(model_dir, engine: FakeEngine, log: Path, *flags: str, env: dict | None = None, scheme: str = "http",
                     probe_context: ssl.SSLContext | None = None, uds: Path | None = None):
    """``python -m frontend`` of ``model_dir`` against ``engine`` on a free port, with
    ``flags``; yields once /health answers 200 (over HTTPS with ``probe_context``,
    else one that trusts any certificate: it only asks "is it up"; over the socket
    ``uds``, given with ``--uds`` in ``flags``)."""
    if scheme == "https" and probe_context is None:
        probe_context = ssl._create_unverified_context()
    port = free_port()
    argv = [sys.executable, "-m", "frontend", "--model", str(model_dir), "--port", str(port), "--scheduler", engine.address,
            "--scheduler-http", engine.http_url, "--connect-timeout", "20", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)
    f = Frontend(proc, port, Path(log), scheme)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not (unix_http.answers(str(uds)) if uds is not None else _answers(f.base_url + "/health", probe_context)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"python -m frontend did not get ready (status {proc.poll()}):\n{f.output()}")
            time.sleep(0.1)
        yield f
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@contextlib.contextmanager
def fake_engine(**kwargs):
    engine = FakeEngine(**kwargs)
    try:
        yield engine
    finally:
        engine.stop()
