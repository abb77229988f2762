"""Plain-HTTP helpers for the API tests (urllib: no SDK in the way of what is sent)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

PROMPT = "The scheduler owns every block of KV memory as a number, and the worker owns the memory itself."


def post(served, path: str, body: bytes | dict, content_type: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(served.base_url + path, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_stream(served, path: str, body: dict) -> list[dict]:
    """A streamed answer's events (its ``data: {...}`` lines), the status asserted 200."""
    req = urllib.request.Request(served.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]


def get_metrics(served) -> str:
    return urllib.request.urlopen(served.base_url + "/metrics", timeout=10).read().decode()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def complete_two_tokens(base_url: str, model: str, prompt: list[int]) -> None:
    """A 2-token completion of a token-id prompt (its KV events are what a test reads)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
