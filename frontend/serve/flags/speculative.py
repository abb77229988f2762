"""``--speculative-config`` and vLLM's shortcuts for it, settled into the scheduler's JSON.

As vLLM's ``EngineArgs.create_speculative_config``: ``--spec-method``, ``--spec-model`` and
``--spec-tokens`` set the JSON's method, model and num_speculative_tokens, and each is refused
beside a JSON that sets the same key. The result is checked here (protocol/speculative_config.py),
so a bad config is refused before any process starts, and goes to the scheduler, which drafts.
"""

from __future__ import annotations

from protocol.speculative_config import load_speculative_fields, parse_speculative_config


def settled_speculative_config(config: str | None, method: str | None, model: str | None, tokens: int | None) -> str | None:
    """The scheduler's ``--speculative-config`` JSON (None: no speculation). Raises ValueError."""
    try:
        fields = load_speculative_fields(config)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    for flag, key, value in (("--spec-method", "method", method), ("--spec-model", "model", model), ("--spec-tokens", "num_speculative_tokens", tokens)):
        if value is None:
            continue
        if fields is None:
            fields = {}
        if key in fields:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        fields[key] = value
    if fields is not None:
        fields = {k.replace("-", "_"): v for k, v in fields.items()}
    try:
        spec = parse_speculative_config(fields)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    return None if spec is None else spec.to_json()
