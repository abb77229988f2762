"""The scheduler's flags checked together, after parsing (``p.error``: exit 2 with the
reason): the tiers, P/D, CURVE, the KV events' endpoints and the MFU estimates' checkpoint."""

from __future__ import annotations

import argparse
import ipaddress
import os

from protocol.curve import CurveKeyError, load_keypair
from protocol.kv_events import int_block_hashes_from_env
from protocol.kv_transfer_config import parse_kv_transfer_config
from scheduler.core.vllm_hashing import RANDOMLY_SEEDED_ALGOS
from scheduler.engine.kv_event_endpoints import (
    check_connect_endpoint,
    check_local_endpoint,
    is_bind_endpoint,
)
from scheduler.engine.model_shape import ModelShape


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_mfu_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> ModelShape | None:
    """The checkpoint's shape for --enable-mfu-metrics (None without it); read here, once."""
    if not a.enable_mfu_metrics:
        return None
    if a.model is None:
        p.error("--enable-mfu-metrics needs --model DIR (the checkpoint the worker serves)")
    try:
        return ModelShape.from_checkpoint(a.model)
    except ValueError as e:
        p.error(str(e))


def check_external_tier(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    backend = a.kv_offloading_backend
    if backend == "native":
        if a.mooncake_master or a.mooncake_metadata:
            p.error("--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake")
        return
    if not a.enable_prefix_caching:
        p.error(f"--kv-offloading-backend {backend} needs the prefix cache: blocks are saved and found by hash (drop --no-enable-prefix-caching)")
    if a.prefix_caching_hash_algo in RANDOMLY_SEEDED_ALGOS and not os.environ.get("PYTHONHASHSEED"):
        p.error(f"--kv-offloading-backend {backend} with --prefix-caching-hash-algo {a.prefix_caching_hash_algo}: vLLM seeds its "
                "xxhash chains at random when PYTHONHASHSEED is unset, so no other process (nor this one restarted) would find "
                "a saved block; set PYTHONHASHSEED, or use kvpool_sha256 or sha256")
    if backend == "mooncake" and not (a.mooncake_master and a.mooncake_metadata):
        p.error("--kv-offloading-backend mooncake needs --mooncake-master HOST:PORT and --mooncake-metadata URL")
    if backend == "disk" and (a.mooncake_master or a.mooncake_metadata):
        p.error("--mooncake-master and --mooncake-metadata are for --kv-offloading-backend mooncake, not disk")


def check_kv_transfer(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.kv_transfer_config is None:
        return
    try:
        parse_kv_transfer_config(a.kv_transfer_config)
    except ValueError as e:
        p.error(str(e))
    if a.kv_offloading_backend != "native":
        p.error(f"--kv-transfer-config with --kv-offloading-backend {a.kv_offloading_backend} is not supported together yet")


def check_security(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """CURVE's two files go together; without them only a loopback --host is bound."""
    if (a.curve_secret_key is None) != (a.curve_authorized_keys is None):
        p.error("--curve-secret-key and --curve-authorized-keys go together")
    if a.curve_secret_key is not None:
        try:
            load_keypair(a.curve_secret_key)
        except CurveKeyError as e:
            p.error(str(e))
        if not os.path.isdir(a.curve_authorized_keys):
            p.error(f"--curve-authorized-keys {a.curve_authorized_keys} is not a folder")
    elif not is_loopback(a.host):
        p.error(f"--host {a.host} is not a loopback address: binding it without CURVE authentication is refused "
                "(give --curve-secret-key and --curve-authorized-keys)")


def check_kv_events(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The KV events' endpoints and bounds; the block-hash form from the environment when not given."""
    if a.kv_events_replay_endpoint is not None and a.kv_events_endpoint is None:
        p.error("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if a.kv_events_buffer_steps < 1 or a.kv_events_hwm < 1 or a.kv_events_max_queue_size < 1:
        p.error("--kv-events-buffer-steps, --kv-events-hwm and --kv-events-max-queue-size must be positive")
    if a.kv_events_int_block_hashes is None:
        try:
            a.kv_events_int_block_hashes = int_block_hashes_from_env(os.environ)
        except ValueError as e:
            p.error(str(e))
    for flag, ep in (("--kv-events-endpoint", a.kv_events_endpoint), ("--kv-events-replay-endpoint", a.kv_events_replay_endpoint)):
        if ep is not None:
            try:
                if flag == "--kv-events-endpoint" and not is_bind_endpoint(ep, a.kv_events_endpoint_mode):
                    check_connect_endpoint(ep, flag)
                else:
                    check_local_endpoint(ep, flag, allow_remote=a.curve_secret_key is not None)
            except ValueError as e:
                p.error(str(e))
