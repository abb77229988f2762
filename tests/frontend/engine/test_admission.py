"""vLLM 0.32's queue limits in the frontend (frontend/engine/admission.py), as vLLM's API
server enforces them (AsyncLLM.check_admission): --max-num-queued-reqs over the
engine requests in flight (n > 1 counts n), --max-num-queued-tokens over the prompt
tokens of requests without a first output yet; vLLM's 503 body, no Retry-After;
vllm:admission_rejections once on the merged /metrics page, the scheduler's counts
and the frontend's summed. Counts in the comments are worked out by hand."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.waiting import wait_for

from frontend.config import config_from_args
from frontend.engine.admission import (
    BACKLOG_FULL,
    QUEUE_FULL,
    AdmissionControl,
    AdmissionRejected,
    merge_rejections,
)

QUEUE_FULL_BODY = {"error": {"message": QUEUE_FULL, "type": "Service Unavailable", "param": None, "code": 503}}
BACKLOG_FULL_BODY = {"error": {"message": BACKLOG_FULL, "type": "Service Unavailable", "param": None, "code": 503}}


def test_the_messages_are_vllms_word_for_word():
    assert QUEUE_FULL == ("The engine is currently busy and cannot accept new requests. "
                          "Please try again later or on a different instance.")
    assert BACKLOG_FULL == "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."


# --- the rules ------------------------------------------------------------------------


def rejected(adm: AdmissionControl, in_flight: int, n: int = 1) -> bool:
    try:
        adm.check(in_flight, n)
    except AdmissionRejected:
        return True
    return False


def test_queued_reqs_counts_in_flight_plus_the_requests_n():
    adm = AdmissionControl(max_num_queued_reqs=3)
    assert not rejected(adm, 0, 3)  # 0 + 3 <= 3
    assert rejected(adm, 1, 3)  # 1 + 3 > 3
    assert not rejected(adm, 2)  # 2 + 1 <= 3
    assert rejected(adm, 3)  # 3 + 1 > 3
    assert adm.rejections == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 0}


def test_zero_refuses_everything_as_vllm():
    assert rejected(AdmissionControl(max_num_queued_reqs=0), 0)  # 0 + 1 > 0
    assert rejected(AdmissionControl(max_num_queued_tokens=0), 0)  # 0 >= 0


def test_queued_tokens_is_the_backlog_before_the_request_not_after():
    adm = AdmissionControl(max_num_queued_tokens=10)
    assert not rejected(adm, 0)
    adm.started("a", 6)
    assert not rejected(adm, 1)  # backlog 6 < 10: admitted, whatever its own prompt
    adm.started("b", 4)
    assert rejected(adm, 2)  # backlog 6 + 4 = 10 >= 10
    adm.prefill_done("a")  # a's first token: backlog 4
    assert not rejected(adm, 2)
    adm.prefill_done("a")  # again (e.g. its abort after): nothing more taken off
    assert adm.num_prefill_tokens == 4
    adm.prefill_done("b")
    assert adm.num_prefill_tokens == 0 and adm.prefilling == {}
    assert adm.rejections == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 1}


def test_prompt_by_prompt_those_before_count_in():
    adm = AdmissionControl(max_num_queued_reqs=5)
    adm.check_prompts(1, [3, 3], 2)  # prompt 0: 1 + 2 <= 5; prompt 1: 1 + 2 + 2 <= 5
    with pytest.raises(AdmissionRejected):
        adm.check_prompts(2, [3, 3], 2)  # prompt 1: 2 + 2 + 2 > 5
    tokens = AdmissionControl(max_num_queued_tokens=10)
    tokens.check_prompts(0, [6, 6], 1)  # prompt 1: backlog 0 + 6 < 10
    tokens.check_prompts(0, [2, 2, 9], 2)  # prompt 2: 2 * 2 + 2 * 2 = 8 < 10
    with pytest.raises(AdmissionRejected, match="prefill token backlog"):
        tokens.check_prompts(0, [3, 2, 1], 2)  # prompt 2: 3 * 2 + 2 * 2 = 10 >= 10
    assert (adm.rejections["max_num_queued_reqs"], tokens.rejections["max_num_queued_tokens"]) == (1, 1)
    assert tokens.num_prefill_tokens == 0  # checks start nothing


def test_the_request_limit_is_checked_first():
    adm = AdmissionControl(max_num_queued_reqs=1, max_num_queued_tokens=5)
    adm.started("a", 5)
    assert rejected(adm, 1)  # both full: counted once, as max_num_queued_reqs
    assert adm.rejections == {"max_num_queued_reqs": 1, "max_num_queued_tokens": 0}


def test_without_a_token_limit_nothing_is_tracked():
    adm = AdmissionControl(max_num_queued_reqs=5)
    adm.started("a", 100)
    assert adm.prefilling is None and adm.num_prefill_tokens == 0


def test_the_refusal_is_vllms_503_without_retry_after():
    resp = AdmissionRejected(QUEUE_FULL).response()
    assert resp.status == 503 and "Retry-After" not in resp.headers
    assert json.loads(resp.body) == QUEUE_FULL_BODY


SCHEDULER_PAGE = b"""# HELP vllm:admission_rejections_total Number of admission attempts rejected by a queue limit, by reason.
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 2.0
vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 0.0
# HELP vllm:admission_rejections_created Number of admission attempts rejected by a queue limit, by reason.
# TYPE vllm:admission_rejections_created gauge
vllm:admission_rejections_created{model_name="m",reason="max_num_queued_reqs"} 1.7e+09
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
"""


def test_merging_adds_the_frontends_counts_reason_by_reason():
    merged = merge_rejections(SCHEDULER_PAGE, {"max_num_queued_reqs": 3, "max_num_queued_tokens": 1})
    assert b'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 5.0\n' in merged  # 2 + 3
    assert b'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 1.0\n' in merged  # 0 + 1
    # everything else as it was
    assert merged.replace(b"} 5.0", b"} 2.0").replace(b'tokens"} 1.0', b'tokens"} 0.0') == SCHEDULER_PAGE
    assert merge_rejections(SCHEDULER_PAGE, {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}) is SCHEDULER_PAGE


def test_the_flags_parse_as_vllms_and_negative_is_refused(capsys):
    c = config_from_args(["--model", "m", "--max-num-queued-reqs", "1k", "--max-num-queued-tokens", "2K"])
    assert (c.max_num_queued_reqs, c.max_num_queued_tokens) == (1000, 2048)
    assert config_from_args(["--model", "m"]).max_num_queued_reqs is None
    with pytest.raises(SystemExit) as e:
        config_from_args(["--model", "m", "--max-num-queued-tokens", "-1"])
    assert e.value.code == 2 and "--max-num-queued-tokens must be >= 0 (unset: no limit), got -1" in capsys.readouterr().err


# --- a real python -m frontend on the fake scheduler -----------------------------------


def post(front, path: str, body: dict):
    req = urllib.request.Request(front.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(front, sample: str) -> tuple[float | None, bytes]:
    with urllib.request.urlopen(front.base_url + "/metrics", timeout=30) as r:
        page = r.read()
    for line in page.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1]), page
    return None, page


class Background:
    """Requests posted from threads (they block while the engine holds them); joined on exit."""

    def __init__(self, front):
        self.front, self.threads, self.results = front, [], []

    def post(self, body: dict) -> None:
        t = threading.Thread(target=lambda: self.results.append(post(self.front, "/v1/completions", body)), daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads)


REQS = 'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"}'
TOKENS = 'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"}'


def test_queued_reqs_refuses_with_503_and_counts_on_the_merged_page(tiny_checkpoint, tmp_path):
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", "--served-model-name", "m",
                                                   "--max-num-queued-reqs", "2") as front:
        engine.metrics_page = SCHEDULER_PAGE.decode()  # the scheduler refused 2 itself
        one = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}
        assert post(front, "/v1/completions", {**one, "n": 3})[0] == 503  # idle: 0 + 3 > 2
        engine.holding.set()
        bg = Background(front)
        try:
            bg.post(one)
            bg.post(one)
            wait_for(lambda: len(engine.generated) == 2, "two requests at the engine")
            status, headers, body = post(front, "/v1/completions", one)  # 2 + 1 > 2
            assert (status, json.loads(body)) == (503, QUEUE_FULL_BODY) and "Retry-After" not in headers
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
            status, headers, body = post(front, "/v1/chat/completions", chat)  # refused before its stream starts
            assert (status, json.loads(body)) == (503, QUEUE_FULL_BODY) and "text/event-stream" not in headers.get("Content-Type", "")
        finally:
            engine.release()
            bg.join()
        assert [r[0] for r in bg.results] == [200, 200]
        assert post(front, "/v1/completions", {**one, "n": 2})[0] == 200  # idle again: 0 + 2 <= 2
        assert len(engine.generated) == 2 + 2  # no request refused so far reached the engine
        # as vLLM's add_request, prompt by prompt, those before counted in: 3 prompts pass the
        # preflight (0 + 1 <= 2), then prompt 0 (0 + 1), prompt 1 (1 + 1), prompt 2: 2 + 1 > 2
        status, _, body = post(front, "/v1/completions", {**one, "prompt": [[5], [6], [7]]})
        assert (status, json.loads(body)) == (503, QUEUE_FULL_BODY)
        # n=2, 2 prompts: preflight 0 + 2 <= 2, prompt 0: 0 + 2, prompt 1: 2 + 2 > 2
        assert post(front, "/v1/completions", {**one, "prompt": [[5], [6]], "n": 2})[0] == 503
        # 2 prompts, n=1: 0 + 1, then 1 + 1 <= 2: both run
        assert post(front, "/v1/completions", {**one, "prompt": [[8], [9]]})[0] == 200
        # the refused requests started none (the checks run before any starts)
        assert [g.prompt_token_ids for g in engine.generated[4:]] == [[8], [9]]
        # streamed, the same refusal comes after the preflight: vLLM's error event, then [DONE]
        status, _, body = post(front, "/v1/completions", {**one, "prompt": [[5], [6], [7]], "stream": True})
        events = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
        assert status == 200 and [json.loads(e) for e in events[:-1]] == [QUEUE_FULL_BODY] and events[-1] == b"[DONE]"
        # the scheduler's 2 and the frontend's 6 (n=3, the completion, the chat, 3 prompts, n=2, streamed), in one family
        value, page = metric(front, REQS)
        assert value == 8.0 and page.count(b"# TYPE vllm:admission_rejections_total counter") == 1
        assert metric(front, TOKENS)[0] == 0.0


def stream_first_chunk(front, body: dict, first: threading.Event, results: list) -> threading.Thread:
    """A streamed completion in a thread: ``first`` is set once its first event is read
    (its first output has been through the frontend's reader), then it reads to the end."""

    def run():
        req = urllib.request.Request(front.base_url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            for line in r:
                if line.startswith(b"data: "):
                    first.set()
            results.append(r.status)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_queued_tokens_refuses_until_the_backlogs_first_token(tiny_checkpoint, tmp_path):
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", "--served-model-name", "m",
                                                   "--max-num-queued-tokens", "0.02k") as front:
        prompt20 = {"model": "m", "prompt": list(range(5, 25)), "max_tokens": 2}
        engine.holding.set()
        bg = Background(front)
        try:
            bg.post(prompt20)
            wait_for(lambda: len(engine.generated) == 1, "the first request at the engine")
            # backlog: its 20 prompt tokens, no output yet; 20 >= 0.02k = 20, whatever the new prompt
            status, headers, body = post(front, "/v1/completions", {**prompt20, "prompt": [5]})
            assert (status, json.loads(body)) == (503, BACKLOG_FULL_BODY) and "Retry-After" not in headers
            assert post(front, "/v1/completions", {**prompt20, "n": 2})[0] == 503
        finally:
            engine.release()
            bg.join()
        assert [r[0] for r in bg.results] == [200]
        # the scheduler's page has no such family here: the frontend's own stands in
        value, page = metric(front, TOKENS)
        assert value == 2.0 and page.count(b"# TYPE vllm:admission_rejections_total counter") == 1
        assert metric(front, REQS)[0] == 0.0
        # a request held after its first token is out of prefill: backlog 0, the next is admitted
        engine.holding.set()
        engine.first_token_while_holding = True
        first, streamed = threading.Event(), []
        t = stream_first_chunk(front, {**prompt20, "prompt": list(range(30, 60))}, first, streamed)
        bg = Background(front)
        try:
            assert first.wait(20), "no first token"
            bg.post(prompt20)
            wait_for(lambda: len(engine.generated) == 3, "the third request at the engine")
        finally:
            engine.release()
            bg.join()
            t.join(timeout=30)
        assert [r[0] for r in bg.results] == [200] and streamed == [200] and metric(front, TOKENS)[0] == 2.0
