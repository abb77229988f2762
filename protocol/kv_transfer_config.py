"""``--kv-transfer-config``: vLLM's flag and JSON for a KV connector, as kvpool reads it.

kvpool has one connector of this kind, ``KVPoolConnector``: prefill/decode
disaggregation, its blocks moved between workers over ZMQ (docs/pd-disaggregation.md).
``NixlConnector`` is taken as another name for it: vllm-router's PD mode and vLLM's
deployment recipes name that one, and kvpool keeps its contract (the
``kv_transfer_params`` of a prefill's answer, a decode engine that reads the blocks and a
prefill engine that keeps them until then). It does not speak NIXL: a kvpool engine
moves KV to and from kvpool engines only.

Keys read (vLLM's ``KVTransferConfig``; any other is refused by name):

* ``kv_connector``, ``kv_role`` (``kv_producer``: a prefill engine; ``kv_consumer``: a
  decode engine; ``kv_both``: either, by each request's params), ``engine_id`` (a uuid
  when unset), ``kv_load_failure_policy`` (``fail``, vLLM's default: a request whose
  blocks could not be read ends with an error; ``recompute``: they are computed here);
* ``kv_connector_extra_config``: ``kv_lease_duration`` (seconds a prefill engine keeps a
  finished request's blocks for its decode engine, vLLM's NixlConnector's, default 30),
  ``side_channel_host`` (the address decode engines reach this engine's worker at;
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``, else 127.0.0.1), ``side_channel_port`` (0, the
  default: any free port), ``read_timeout`` (seconds a decode engine's worker waits for
  a prefill worker's blocks before it gives up on them, default 10).
* ``kv_port``, ``kv_buffer_device``, ``kv_buffer_size``, ``kv_rank``,
  ``kv_parallel_size``, ``enable_permute_local_kv``: accepted and not used (vLLM's other
  connectors read them).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import msgspec

CONNECTORS = ("KVPoolConnector", "NixlConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_LEASE_S = 30.0
DEFAULT_READ_TIMEOUT_S = 10.0
_UNUSED = {"kv_port", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "enable_permute_local_kv",
           "kv_connector_module_path"}
_EXTRA = {"kv_lease_duration", "side_channel_host", "side_channel_port", "read_timeout"}


class KVTransferConfig(msgspec.Struct, frozen=True):
    """A checked ``--kv-transfer-config``."""

    kv_connector: str
    kv_role: str
    engine_id: str
    kv_load_failure_policy: str = "fail"
    kv_lease_duration: float = DEFAULT_LEASE_S
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    read_timeout: float = DEFAULT_READ_TIMEOUT_S

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_json(self) -> str:
        """The JSON that `parse_kv_transfer_config` reads back to this config (a child's flag)."""
        extra = {"kv_lease_duration": self.kv_lease_duration, "side_channel_host": self.side_channel_host,
                 "side_channel_port": self.side_channel_port, "read_timeout": self.read_timeout}
        return json.dumps({"kv_connector": self.kv_connector, "kv_role": self.kv_role, "engine_id": self.engine_id,
                           "kv_load_failure_policy": self.kv_load_failure_policy, "kv_connector_extra_config": extra})


def _number(extra: dict[str, Any], key: str, default: float, low: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < float("inf"):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a number >= {low:g}, got {value!r}")
    return float(value)


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """The config of ``--kv-transfer-config TEXT``; ValueError naming the key otherwise."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(raw) - {"kv_connector", "kv_role", "engine_id", "kv_load_failure_policy",
                                 "kv_connector_extra_config"} - _UNUSED)
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key {unknown[0]!r}")
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not supported by kvpool (supported: "
                         f"{', '.join(CONNECTORS)}; NixlConnector is kvpool's own over ZMQ)")
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role {role!r} is not one of {', '.join(ROLES)}")
    policy = raw.get("kv_load_failure_policy", "fail")
    if policy not in FAILURE_POLICIES:
        raise ValueError(f"--kv-transfer-config: kv_load_failure_policy {policy!r} is not one of {', '.join(FAILURE_POLICIES)}")
    engine_id = raw.get("engine_id") or str(uuid.uuid4())
    if not isinstance(engine_id, str):
        raise ValueError(f"--kv-transfer-config: engine_id must be a string, got {engine_id!r}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(extra) - _EXTRA)
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown kv_connector_extra_config key {unknown[0]!r} (known: {', '.join(sorted(_EXTRA))})")
    host = extra.get("side_channel_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1"
    if not isinstance(host, str):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.side_channel_host must be a string, got {host!r}")
    port = extra.get("side_channel_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.side_channel_port must be a port (0: any free one), got {port!r}")
    return KVTransferConfig(connector, role, engine_id, policy, _number(extra, "kv_lease_duration", DEFAULT_LEASE_S, 0.0),
                            host, port, _number(extra, "read_timeout", DEFAULT_READ_TIMEOUT_S, 0.001))
