"""frontend/sampling/params.py: a request's sampling fields checked with protocol's ranges
(the scheduler's own) and vLLM's wording, the first bad field named in a 400."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.sampling.params import engine_params, with_header_priority
from frontend.schema.errors import APIError
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest
from protocol.client_messages import Generate


def rejected(defaults: dict | None = None, max_tokens: int = 16, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        engine_params(CompletionRequest(prompt="x", **fields), max_tokens, fields.get("logprobs"), defaults or {})
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"n": 0}, "n", "n must be at least 1, got 0."),
        ({"temperature": -1.0}, "temperature", "temperature must be non-negative, got -1.0."),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0."),
        ({"top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5."),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be greater than zero, got 0.0."),
        ({"min_tokens": 99}, "min_tokens", "min_tokens must be less than or equal to max_tokens=16, got 99."),
        ({"logprobs": 21}, "logprobs", "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ],
)
def test_the_first_bad_field_is_named_in_vllms_words(fields, param, message):
    e = rejected(**fields)
    assert (e.param, e.message) == (param, message)


def test_a_non_finite_temperature_is_refused_as_vllm_does():
    # JSON cannot carry inf, but generation_config.json (read with json.loads) can:
    # vLLM refuses it ("must be a finite number"), and so do the frontend and the scheduler.
    e = rejected(defaults={"temperature": float("inf")})
    assert (e.param, e.message) == ("temperature", "temperature must be a finite number, got inf.")
    assert rejected(defaults={"repetition_penalty": float("inf")}).param == "repetition_penalty"


def test_a_good_request_becomes_the_generate_fields():
    req = CompletionRequest(prompt="x", temperature=0.5, top_k=5, seed=7, stop="\n", stop_token_ids=[2])
    p = engine_params(req, 8, 3, {"top_p": 0.9, "temperature": 0.1})
    assert p.generate == {
        "max_tokens": 8, "ignore_eos": False, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "seed": 7,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
        "stop_token_ids": [2], "logprobs": 3, "priority": 0,
    }
    assert p.stop == ["\n"] and p.n == 1


def test_priority_travels_to_the_generate_message():
    # vLLM's CompletionRequest/ChatCompletionRequest ``priority``: an int64, default 0,
    # accepted whatever the scheduling policy (vLLM 0.32 checks it nowhere else).
    for req in (CompletionRequest(prompt="x", priority=-7), ChatCompletionRequest(messages=[], priority=2**63 - 1)):
        p = engine_params(req, 4, None, {})
        assert p.generate["priority"] == req.priority
        msg = Generate(request_id="r", prompt_token_ids=[3], **p.generate)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=Generate).priority == req.priority
    assert engine_params(CompletionRequest(prompt="x"), 4, None, {}).generate["priority"] == 0


@pytest.mark.parametrize("body", [{"priority": 2**63}, {"priority": -(2**63) - 1}, {"priority": "high"}, {"priority": 1.5}])
def test_a_priority_outside_int64_is_refused_naming_the_field(body):
    with pytest.raises(msgspec.ValidationError, match=r"\$\.priority"):
        msgspec.json.decode(json.dumps({"prompt": "x", **body}), type=CompletionRequest)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [({}, 3), ({"X-Vllm-Priority": "-4"}, -4), ({"X-Vllm-Priority": " 12 "}, 12), ({"X-Vllm-Priority": "high"}, 3),
     ({"X-Vllm-Priority": "1.5"}, 3), ({"X-Vllm-Priority": str(2**63)}, 3)],
)
def test_vllms_priority_header_wins_over_the_body_when_it_reads_as_an_int(headers, expected):
    params = engine_params(CompletionRequest(prompt="x", priority=3), 4, None, {})
    assert with_header_priority(params, headers).generate["priority"] == expected
    assert params.generate["priority"] == 3  # the shared params are not changed


def test_n_is_bounded_as_vllm_bounds_it():
    # vLLM 0.32's SamplingParams: n up to VLLM_MAX_N_SEQUENCES (16384 unless set).
    assert engine_params(CompletionRequest(prompt="x", n=16384), 4, None, {}).n == 16384
    with pytest.raises(APIError) as info:
        engine_params(CompletionRequest(prompt="x", n=5), 4, None, {}, max_n=4)
    assert info.value.param == "n" and str(info.value).startswith("n must be at most 4, got 5.")


def test_the_bound_comes_from_vllms_environment_variable(monkeypatch, capsys):
    from frontend.config import config_from_args

    assert config_from_args(["--model", "m"]).max_n_sequences == 16384
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "8")
    assert config_from_args(["--model", "m"]).max_n_sequences == 8
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "lots")
    with pytest.raises(SystemExit):
        config_from_args(["--model", "m"])
    assert "VLLM_MAX_N_SEQUENCES must be a positive integer, got 'lots'" in capsys.readouterr().err
