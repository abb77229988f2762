"""``kvpool serve``'s ready line: the pool's size as the scheduler exports it (its
worker's report), never re-derived from config.json; no size when the scheduler does
not export the block's bytes."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher


@pytest.fixture
def scheduler_metrics():
    """A fake scheduler /metrics; the test sets its text."""
    state = {"text": ""}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ready_line(url: str, capsys, *argv: str) -> str:
    la = Launcher(parse_serve(["serve", "m", *argv]), log=lambda *a, **k: None)
    la.build()
    la.scheduler_http = url
    la._print_ready()
    return capsys.readouterr().out


def test_the_pool_bytes_are_the_schedulers(scheduler_metrics, capsys):
    state, url = scheduler_metrics
    state["text"] = 'kvpool_num_gpu_blocks{model_name="m"} 256.0\nkvpool_kv_block_bytes{model_name="m"} 32768.0\n'
    assert "(KV cache: 256 blocks × 16 tokens, 8.0 MiB)" in ready_line(url, capsys)
    assert "8.0 MiB on each of 2 ranks" in ready_line(url, capsys, "-tp", "2")


def test_without_the_block_bytes_no_size_is_printed(scheduler_metrics, capsys):
    state, url = scheduler_metrics
    state["text"] = 'kvpool_num_gpu_blocks{model_name="m"} 256.0\n'
    assert "(KV cache: 256 blocks × 16 tokens)" in ready_line(url, capsys)
