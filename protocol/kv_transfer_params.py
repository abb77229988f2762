"""A request's ``kv_transfer_params`` (vLLM's, as vllm-router's PD mode sends and reads them).

To a prefill engine the router sends ``{"do_remote_decode": true, ...}`` (the other keys
null); its answer carries the params a decode engine needs to read the blocks:
``do_remote_prefill`` true, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``remote_block_ids`` (the prefill worker's blocks of the prompt, one
list per KV-cache group as vLLM 0.32's, in table order: a full-attention group's from the
prompt's first block, a sliding-window group's only its in-window tail), ``remote_num_tokens``
(the tokens they hold) and ``tp_size``. The router passes them on to a decode engine
unchanged. A flat list of block ids (older vLLMs') is one group's.

`parse_kv_transfer_params` checks the keys this contract names (a wrong type is a
``ValueError`` naming ``kv_transfer_params.KEY``, the API's 400) and keeps the rest as
they came: vLLM hands the whole dict to its connector.
"""

from __future__ import annotations

from typing import Any

import msgspec

# A decode engine's request must name its blocks' source by all of these.
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")
MAX_BLOCK_ID = 2**31 - 1


class KVTransferParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """The checked params of one request (the client protocol's ``Generate.kv_transfer_params``)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[list[int]] | None = None  # one list per KV-cache group
    remote_num_tokens: int | None = None
    tp_size: int = 1


def _fail(key: str, what: str, value: Any) -> ValueError:
    return ValueError(f"kv_transfer_params.{key} must be {what}, got {value!r}")


def _is_block_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BLOCK_ID


def _block_id_groups(ids: Any) -> list[list[int]]:
    """``remote_block_ids`` as one list per KV-cache group: vLLM 0.32's lists of lists, or a
    flat list (one group, as older vLLMs send)."""
    if isinstance(ids, list) and all(_is_block_id(i) for i in ids):
        return [ids]
    if isinstance(ids, list) and ids and all(isinstance(g, list) and all(_is_block_id(i) for i in g) for g in ids):
        return ids
    raise _fail("remote_block_ids", "a list of block ids (integers >= 0), or one such list per KV-cache group", ids)


def parse_kv_transfer_params(raw: Any) -> KVTransferParams:
    """The checked params of a request body's ``kv_transfer_params``."""
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {raw!r}")
    out: dict[str, Any] = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise _fail(key, "a boolean", value)
        out[key] = bool(value)
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _fail(key, "a non-empty string", value)
        out[key] = value
    for key, low, high in (("remote_port", 1, 65535), ("remote_num_tokens", 0, 2**31 - 1), ("tp_size", 1, 1 << 16)):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise _fail(key, f"an integer in [{low}, {high}]", value)
        if value is not None:
            out[key] = value
    ids = raw.get("remote_block_ids")
    if ids is not None:
        out["remote_block_ids"] = _block_id_groups(ids)
    if out["do_remote_prefill"]:
        for key in REMOTE_KEYS:
            if out.get(key) is None:
                raise ValueError(f"kv_transfer_params.{key} is required with do_remote_prefill")
    if out["do_remote_prefill"] and out["do_remote_decode"]:
        raise ValueError("kv_transfer_params.do_remote_decode and do_remote_prefill cannot both be true")
    if out.get("tp_size", 1) != 1:
        raise ValueError(f"kv_transfer_params.tp_size {out['tp_size']} is not supported by kvpool: its prefill engines have one worker")
    return KVTransferParams(**out)
