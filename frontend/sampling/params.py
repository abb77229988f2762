"""From an HTTP request to the engine's ``Generate`` fields, with vLLM's checks and
wording (``vllm/sampling_params.py``, ``OpenAIServing._validate_input``).

Defaults not given by the request come from the checkpoint's
``generation_config.json`` (vLLM's ``--generation-config auto``), else vLLM's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from frontend.schema.errors import APIError, bad_request
from protocol.kv_transfer_params import parse_kv_transfer_params
from protocol.sampling_params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingError, check_sampling

# vLLM's defaults where neither the request nor generation_config.json says.
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}
# generation_config.json keys vLLM reads as default sampling parameters (ModelConfig.get_diff_sampling_param).
_GENERATION_CONFIG_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                           "min_p", "max_new_tokens")
# vLLM's bound on n (its VLLM_MAX_N_SEQUENCES default).
DEFAULT_MAX_N_SEQUENCES = 16384
# vLLM's header that overrides a request body's priority (``OpenAIServing._get_priority``).
PRIORITY_HEADER = "X-Vllm-Priority"


def default_sampling(generation_config: str, model_dir: str | Path, override: dict | None = None) -> dict:
    """``--generation-config``: "auto" (the model folder's file), "vllm" (none), or a
    folder; ``--override-generation-config``'s keys set over it, as vLLM's
    ``get_diff_sampling_param`` (with "vllm", only the override's). A key whose value
    is null is no default; ``max_new_tokens`` is returned as ``max_tokens``."""
    config = {}
    path = Path(model_dir if generation_config == "auto" else generation_config) / "generation_config.json"
    if generation_config != "vllm" and path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
    config.update(override or {})
    out = {k: config[k] for k in _GENERATION_CONFIG_KEYS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def max_tokens_cap(generation_config: str, defaults: dict, override: dict | None) -> int | None:
    """vLLM's ``override_max_tokens``, a bound on every request's max_tokens: a
    --generation-config folder's max_new_tokens, else --override-generation-config's."""
    if generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (override or {}).get("max_new_tokens")


def output_budget(requested: int | None, num_prompt_tokens: int, max_model_len: int, defaults: dict, cap: int | None) -> int:
    """vLLM's ``get_max_tokens``: the least of what the context leaves, the request's
    max_tokens (else the generation config's default) and ``cap``."""
    asked = requested if requested is not None else defaults.get("max_tokens")
    return min(v for v in (max_model_len - num_prompt_tokens, asked, cap) if v is not None)


@dataclass(frozen=True, slots=True)
class EngineParams:
    """What every engine request of one HTTP request shares (``Generate``'s fields less
    the id and prompt), plus what stays in the frontend (stop strings, detokenizing)."""

    generate: dict
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    n: int
    # A refusal vLLM's engine makes (its input processor), not its request parsing: raised
    # as the engine requests start, so a stream has started by then, as in vLLM.
    refusal: APIError | None = None
    spaces_between_special_tokens: bool = True


def engine_params(req, max_tokens: int, num_logprobs: int | None, defaults: dict, max_n: int = DEFAULT_MAX_N_SEQUENCES,
                  max_logprobs: int = MAX_LOGPROBS) -> EngineParams:
    """Check a request's sampling fields (the first bad one is named) and build them.
    The ranges are protocol's (``check_sampling``), the scheduler's own; ``n`` is the
    frontend's alone (it fans a request out into n), bounded by ``max_n`` as vLLM's
    VLLM_MAX_N_SEQUENCES bounds it; logprobs by ``max_logprobs`` (--max-logprobs, at
    most the scheduler's MAX_LOGPROBS)."""

    def pick(name):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, VLLM_DEFAULTS[name])

    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}.", "n")
    if req.n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {req.n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
                          "environment variable.", "n")
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    fields = SimpleNamespace(
        **{name: pick(name) for name in VLLM_DEFAULTS}, min_tokens=req.min_tokens, max_tokens=max_tokens,
        logprobs=num_logprobs, seed=req.seed, stop_token_ids=list(req.stop_token_ids or []),
    )
    if num_logprobs is not None and num_logprobs > max_logprobs:
        raise bad_request(f"Requested sample logprobs of {num_logprobs}, which is greater than max allowed: {max_logprobs}", "logprobs")
    try:
        check_sampling(fields)
    except SamplingError as e:
        raise bad_request(str(e), e.param) from None
    if req.n > 1 and fields.temperature < GREEDY_TEMPERATURE:
        # NOTE: vLLM's _verify_greedy_sampling: n greedy samples would all be the same.
        raise bad_request(f"n must be 1 when using greedy sampling, got {req.n}.")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    generate = {
        "max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "temperature": float(fields.temperature),
        "top_p": float(fields.top_p), "top_k": int(fields.top_k), "min_p": float(fields.min_p), "seed": req.seed,
        "presence_penalty": float(fields.presence_penalty), "frequency_penalty": float(fields.frequency_penalty),
        "repetition_penalty": float(fields.repetition_penalty), "min_tokens": req.min_tokens,
        "stop_token_ids": fields.stop_token_ids, "logprobs": num_logprobs, "priority": req.priority,
    }
    if req.cache_salt is not None:
        generate["cache_salt"] = req.cache_salt
    return EngineParams(generate, stop, req.include_stop_str_in_output, req.skip_special_tokens, req.n,
                        spaces_between_special_tokens=req.spaces_between_special_tokens)


def with_kv_transfer_params(params: EngineParams, raw: dict | None, kv_connector: bool) -> EngineParams:
    """A request's ``kv_transfer_params`` on its engine requests, checked
    (``protocol.kv_transfer_params``: a bad key is a 400 naming it), when this server has
    a KV connector (--kv-transfer-config). Without one they are ignored, unchecked, as
    vLLM ignores them; empty ones are none, as vLLM passes on only a non-empty dict."""
    if not kv_connector or not raw:
        return params
    try:
        checked = parse_kv_transfer_params(raw)
    except ValueError as e:
        raise bad_request(str(e), "kv_transfer_params") from None
    return replace(params, generate={**params.generate, "kv_transfer_params": checked})


def with_header_priority(params: EngineParams, headers) -> EngineParams:
    """vLLM's ``_get_priority``: the X-Vllm-Priority header, when it reads as an int,
    wins over the body's ``priority``; otherwise the body's stands."""
    value = headers.get(PRIORITY_HEADER)
    try:
        priority = int(value) if value is not None else None
    except ValueError:
        return params
    # NOTE: vLLM passes any int on; one outside int64 would not fit the engine's message.
    if priority is None or not -(2**63) <= priority < 2**63:
        return params
    return replace(params, generate={**params.generate, "priority": priority})


def check_output_tokens(max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """vLLM 0.32's ``TokenizeParams`` check, before tokenizing: no output budget over the
    whole context (one that only overflows with the prompt gets less: ``output_budget``)."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise bad_request(f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please request "
                          f"fewer output tokens. (parameter={param}, value={max_tokens})", param)


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, from_text: bool = False) -> None:
    """vLLM 0.32's renderer check (``_token_len_check``), its words: the prompt alone must
    fit the context. vLLM tokenizes a text at most max_model_len + 1 tokens deep, so for
    one it names "at least" that many."""
    if num_prompt_tokens <= max_model_len:
        return
    count = min(num_prompt_tokens, max_model_len + 1) if from_text else num_prompt_tokens
    at_least = "at least " if count == max_model_len + 1 else ""
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains {at_least}{count} "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        f"prompt. (parameter=input_tokens, value={count})", "input_tokens",
    )


def check_prompt_chars(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """vLLM 0.32's ``_text_len_check``: a text longer than the context could hold even at
    the vocabulary's longest token is refused before it is tokenized."""
    limit = max_model_len * max_chars_per_token
    if len(text) > limit:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains {len(text)} "
            f"characters (more than {limit} characters, which is the upper bound for {max_model_len} input tokens). "
            f"Please reduce the length of the input prompt. (parameter=input_text, value={len(text)})", "input_text",
        )
