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

from frontend.errors import APIError, bad_request
from protocol.sampling_params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingError, check_sampling

# vLLM's defaults where neither the request nor generation_config.json says.
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip
# generation_config.json keys vLLM reads as default sampling parameters (ModelConfig.get_diff_sampling_param).
_GENERATION_CONFIG_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                           "min_p", "max_new_tokens")  # fmt: skip
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
                  max_logprobs: int = MAX_LOGPROBS) -> EngineParams:  # fmt: skip
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
                          "environment variable.", "n")  # fmt: skip
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    fields = SimpleNamespace(
        **{name: pick(name) for name in VLLM_DEFAULTS}, min_tokens=req.min_tokens, max_tokens=max_tokens,
        logprobs=num_logprobs, seed=req.seed, stop_token_ids=list(req.stop_token_ids or []),
    )  # fmt: skip
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
    }  # fmt: skip
    if req.cache_salt is not None:
        generate["cache_salt"] = req.cache_salt
    return EngineParams(generate, stop, req.include_stop_str_in_output, req.skip_special_tokens, req.n,
                        spaces_between_special_tokens=req.spaces_between_special_tokens)


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


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's ``_validate_input`` for completion-like requests, its wording."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.", "input_tokens",
        )  # fmt: skip
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}).", "max_tokens",
        )  # fmt: skip
