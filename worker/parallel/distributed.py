"""The tensor-parallel group: N worker ranks in one ``torch.distributed`` process group
(gloo on CPU, NCCL on CUDA), rendezvoused over a TCP store that rank 0 hosts.

Start-up goes through the store alone, with its own bounded timeout, before the process
group exists:

1. every rank claims its rank (a second claimant is refused) and publishes what it
   serves (world size, model identity, dtype, block size, ...);
2. rank 0 compares each rank's against its own as it arrives and publishes a verdict:
   the first disagreement, naming the rank, the field and both values, stops the group;
3. after loading its shard each rank publishes how many KV blocks it holds, and every
   rank takes the smallest (the pool the scheduler gets is the smallest over ranks).

Only then ``init_process_group`` with a bounded timeout (``--distributed-timeout``, not
torch's 30 minutes): a rank that never joins fails ``start`` with ``GroupError``; a rank
that dies closes its sockets, so the others' collectives fail at once with ``GroupLost``;
one that hangs is given up after the timeout (gloo: ``GroupLost``; NCCL, whose
collectives are asynchronous: the watchdog ends the process, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


class GroupError(RuntimeError):
    """The group cannot be formed: a rank disagrees, is missing, or is taken twice."""


class GroupLost(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


def parse_init_method(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ValueError naming the problem otherwise."""
    u = urlparse(url)
    if u.scheme != "tcp" or not u.hostname or u.port is None:
        raise ValueError(f"--distributed-init-method {url!r}: expected tcp://HOST:PORT (rank 0's address)")
    return u.hostname, u.port


class TPGroup:
    """One rank's view of its group; rank 0 hosts the store."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float, startup_timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = BACKENDS[device.type]
        self.timeout = timedelta(seconds=timeout_s)
        self.startup_timeout = timedelta(seconds=startup_timeout_s)
        host, port = parse_init_method(init_method)
        if host in ("127.0.0.1", "localhost") and self.backend == "gloo":
            # NOTE: gloo binds the address of the interface it picks; on one host keep it loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._listener: socket.socket | None = None
        try:
            listen_fd = None
            if rank == 0:
                # NOTE: the store listens on the init method's address only (TCPStore
                # alone would listen on every interface); port 0 picks a free one.
                self._listener = socket.create_server((host, port), backlog=128)
                port = self._listener.getsockname()[1]
                listen_fd = self._listener.fileno()
            self.store = dist.TCPStore(host, port, world_size=None, is_master=rank == 0, timeout=self.startup_timeout,
                                       wait_for_workers=False, master_listen_fd=listen_fd)
        except (RuntimeError, OSError) as e:
            who = "host the group's store on" if rank == 0 else "reach rank 0's store at"
            raise GroupError(f"rank {rank} cannot {who} {init_method}: {e}") from None
        self.init_method = f"tcp://{host}:{port}"  # the port chosen, when 0 was asked
        self.started = False
        self._round = 0  # each agree() has keys of its own (a test loads several models)

    def _wait(self, key: str, why: str) -> bytes:
        try:
            self.store.wait([key], self.startup_timeout)
            return self.store.get(key)
        except (RuntimeError, OSError) as e:
            raise GroupError(f"rank {self.rank}: {why} within {self.startup_timeout.total_seconds():g} s ({e})") from None

    def agree(self, identity: dict) -> None:
        """Check that every rank serves what rank 0 serves; GroupError naming the first
        disagreement. ``identity`` holds world_size and whatever else must match."""
        r, k = self.rank, self._round
        self._round += 1
        if self.store.add(f"claim/{k}/{r}", 1) > 1:
            raise GroupError(f"rank {r} of this group is already taken by another process")
        self.store.set(f"hello/{k}/{r}", json.dumps(identity, sort_keys=True))
        if r == 0:
            verdict = ""
            try:
                for other in range(1, self.world_size):
                    theirs = json.loads(self._wait(f"hello/{k}/{other}", f"no word from rank {other}"))
                    verdict = _disagreement(identity, theirs, other)
                    if verdict:
                        break
            except GroupError as e:
                verdict = str(e)
            self.store.set(f"verdict/{k}", verdict)
            if verdict:
                self._linger_for_readers(k)
        else:
            verdict = self._wait(f"verdict/{k}", "no verdict from rank 0").decode()
            self.store.add(f"read/{k}", 1)
            if not verdict and not r < identity["world_size"]:
                verdict = f"rank {r} is outside a group of {identity['world_size']}"
        if verdict:
            raise GroupError(f"tensor-parallel group refused: {verdict}")

    def _linger_for_readers(self, k: int, bound_s: float = 5.0) -> None:
        """Keep the store up until every rank that said hello has read a refusal (so it
        learns why, rather than that rank 0 vanished), for at most ``bound_s``."""
        present = [r for r in range(1, self.world_size) if self.store.check([f"hello/{k}/{r}"])]
        deadline = time.monotonic() + bound_s
        while self.store.add(f"read/{k}", 0) < len(present) and time.monotonic() < deadline:
            time.sleep(0.05)

    def min_over_ranks(self, key: str, value: int) -> int:
        """The smallest ``value`` any rank passes under ``key`` (every rank calls it)."""
        k = f"{key}/{self._round}"
        self.store.set(f"{k}/{self.rank}", str(value))
        return min(int(self._wait(f"{k}/{r}", f"no {key} from rank {r}")) for r in range(self.world_size))

    def start(self) -> None:
        """The process group itself, over the same store."""
        extra = {}
        if self.backend == "nccl":
            # NOTE: NCCL collectives return before they run, so a failed or timed-out one
            # cannot raise here; with async error handling the watchdog aborts the
            # communicator and ends the process (vLLM relies on the same), which the
            # scheduler sees as a lost worker, instead of a rank hanging in the kernel.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            # NOTE: eager init, so a rank that never joins fails here within the timeout,
            # not at the first collective of the first step.
            extra["device_id"] = self.device
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore("pg", self.store), rank=self.rank,
                                    world_size=self.world_size, timeout=self.timeout, **extra)
        except (RuntimeError, ValueError) as e:
            raise GroupError(f"rank {self.rank}: init_process_group ({self.backend}) failed: {e}") from None
        self.started = True

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group, in place."""
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise GroupLost(f"all_reduce on rank {self.rank} failed: {e}") from None

    def broadcast(self, t: torch.Tensor) -> None:
        """``t`` from rank 0 into every rank's ``t``, in place."""
        try:
            dist.broadcast(t, 0)
        except RuntimeError as e:
            raise GroupLost(f"broadcast on rank {self.rank} failed: {e}") from None

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.started:
            self.started = False
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass


def _disagreement(ours: dict, theirs: dict, rank: int) -> str:
    for field in sorted(set(ours) | set(theirs)):
        if ours.get(field) != theirs.get(field):
            return f"rank {rank} has {field} {theirs.get(field)!r}, rank 0 has {ours.get(field)!r}"
    return ""
