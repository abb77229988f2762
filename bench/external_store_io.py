"""The external KV tier's stores on one host (``python -m bench.external_store_io``): bytes
per second of put and get through DiskStore (a temporary directory, so its reads come
from the page cache) and through MooncakeStore, one object at a time, as the worker's
single I/O thread moves them. Mooncake runs on loopback, started here: a master, and the
memory either in a store server (another process: bytes cross loopback TCP) or in this
process's own segment.

An object is one block of SmolLM2-135M (30 layers, 3 KV heads of 64, K and V, bf16, 16
tokens: 368,640 bytes) behind its header (protocol/external_kv.py), 500 of them. The
Mooncake master here is also the tests' (tests/external/conftest.py): ``MooncakeMaster``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.table import Row, print_table
from protocol.external_kv import encode_header, kv_identity, object_key

OBJECT_BYTES = 368_640
NUM_OBJECTS = 500
DEFAULT_STORE_BYTES = 1 << 30
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (another process may take one before use)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mooncake_binary(name: str) -> str:
    """Mooncake's ``name`` (mooncake_master, mooncake_client) beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name} beside this Python or on PATH (pip install 'kvpool[mooncake]')")
    return found


class Daemon:
    """One server process in its own process group, its output in ``log_path``."""

    def __init__(self, name: str, cmd: list[str], log_path: Path):
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, ports: list[int], deadline: float) -> None:
        """Start it and wait until each of ``ports`` accepts a connection; RuntimeError,
        with its log's tail, when it exits or ``deadline`` (monotonic) passes first."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        waiting = list(ports)
        while waiting:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}'s ports {waiting} accepted no connection in time:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", waiting[0]), timeout=0.5).close()
                waiting.pop(0)
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop its process group: SIGTERM, then SIGKILL past a few seconds."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class MooncakeMaster:
    """A Mooncake Store on loopback: a ``mooncake_master`` with its HTTP metadata server
    and, with ``store_bytes``, a store server (``mooncake_client``) lending it that much
    memory, which outlives the engines that write to it (an engine's MooncakeStore lends
    none by default). Every port on 127.0.0.1 except the transfer engine's, which
    Mooncake binds on all interfaces; each process in its own group, its log in
    ``log_dir``. A context manager: started on entry, stopped on exit."""

    def __init__(self, log_dir: str | os.PathLike, ports: tuple[int, int, int, int] | None = None, store_bytes: int = DEFAULT_STORE_BYTES):
        """``ports``: the master's RPC, metadata and metrics ports and the store server's
        (default: four the kernel has free now)."""
        log_dir = Path(log_dir)
        self.rpc_port, self.metadata_port, self.metrics_port, self.store_port = ports or free_ports(4)
        self.master_address = f"127.0.0.1:{self.rpc_port}"
        self.metadata_server = f"http://127.0.0.1:{self.metadata_port}/metadata"
        self.master = Daemon("mooncake_master", [
            mooncake_binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.metadata_port}",
            "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1", "--logtostderr"], log_dir / "mooncake_master.log")
        self.store_server = None if store_bytes == 0 else Daemon("mooncake_client", [
            mooncake_binary("mooncake_client"), f"--global_segment_size={store_bytes}", "--host=127.0.0.1",
            f"--port={self.store_port}", f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}", "--protocol=tcp", "--logtostderr"], log_dir / "mooncake_client.log")

    def start(self) -> None:
        """Start the master, then the store server; RuntimeError when either fails to."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self.master.start([self.rpc_port, self.metadata_port], deadline)
        if self.store_server is not None:
            self.store_server.start([self.store_port], deadline)

    def stop(self) -> None:
        """Stop the store server, then the master (each by its process group)."""
        if self.store_server is not None:
            self.store_server.stop()
        self.master.stop()

    def __enter__(self) -> MooncakeMaster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def make_objects(n: int, size: int) -> tuple[list[str], list[bytes], bytes]:
    """``n`` keys, their headers, and one payload of ``size`` random bytes (for all)."""
    identity = kv_identity("LlamaForCausalLM", "bench", "bfloat16", 16, 30, 3, 64)
    payload = os.urandom(size)
    keys = [object_key(identity, i.to_bytes(32, "little")) for i in range(n)]
    return keys, [encode_header(identity, k, payload) for k in keys], payload


def measure(store, keys: list[str], headers: list[bytes], payload: bytes) -> tuple[float, float]:
    """(put, get) bytes per second over every object, one at a time."""
    total = sum(len(h) for h in headers) + len(payload) * len(keys)
    t0 = time.perf_counter()
    for key, header in zip(keys, headers, strict=True):
        store.put(key, header, payload)
    t1 = time.perf_counter()
    for key in keys:
        if store.get(key) is None:
            raise RuntimeError(f"{store.name}: {key} was put and is not there")
    t2 = time.perf_counter()
    return total / (t1 - t0), total / (t2 - t1)


def rows(num_objects: int = NUM_OBJECTS, object_bytes: int = OBJECT_BYTES) -> list[Row]:
    from worker.external.disk_store import DiskStore
    from worker.external.mooncake_store import MooncakeStore

    keys, headers, payload = make_objects(num_objects, object_bytes)
    need = (object_bytes + 4096) * num_objects
    figures: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-store-io-") as tmp:
        disk = DiskStore(Path(tmp) / "disk", 2 * need, identity="bench")
        figures.append(("disk", *measure(disk, keys, headers, payload)))
        # The objects in a store server (another process), as an engine lends no memory by
        # default; then in the engine's own segment.
        for name, store_bytes, segment_bytes in (("mooncake", 2 * need, 0), ("mooncake own segment", 0, 2 * need)):
            with MooncakeMaster(tmp, store_bytes=store_bytes) as master:
                store = MooncakeStore(master.master_address, master.metadata_server, global_segment_bytes=segment_bytes)
                try:
                    figures.append((name, *measure(store, keys, headers, payload)))
                finally:
                    store.close()
    label = f"{num_objects} x {object_bytes} B"
    return [Row(f"{name} {op} ({label})", bps / 1e6, "MB/s")
            for name, put_bps, get_bps in figures for op, bps in (("put", put_bps), ("get", get_bps))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.external_store_io", description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=NUM_OBJECTS, help=f"objects put then got (default {NUM_OBJECTS})")
    p.add_argument("--object-bytes", type=int, default=OBJECT_BYTES, help=f"payload bytes of each (default {OBJECT_BYTES})")
    a = p.parse_args(argv)
    print_table(rows(a.objects, a.object_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
