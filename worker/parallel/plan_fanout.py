"""Rank 0 hands every scheduler message the other ranks must act on to them, in order,
over the group's broadcast (the scheduler talks to rank 0 alone).

A message is ``(kind, tokens, frame)``: ``frame`` is the scheduler's own msgpack frame,
forwarded unchanged (a plan is decoded on each rank, never re-encoded), ``tokens`` the
tokens rank 0 sampled in the step before (the other ranks run the model but do not
sample: they append rank 0's tokens before the next plan, so every rank's rows hold
the same tokens). On the wire: one broadcast of ``CAPACITY`` bytes, ``[u32 length]
[payload]``; a payload longer than fits follows in a second broadcast of its rest.
A decode step's plan (tens of bytes) is one broadcast.
"""

from __future__ import annotations

import enum

import msgspec
import torch

from worker.parallel.distributed import GroupLost, TPGroup

CAPACITY = 4096
_LEN = 4


class Kind(enum.IntEnum):
    KEEPALIVE = 0  # nothing to do: rank 0 is alive and waiting
    READY = 1  # frame: the WorkerReady rank 0 accepted; build the runner
    PLAN = 2  # frame: a StepPlan; tokens: the previous step's sampled tokens
    RESET = 3  # rank 0 dropped every row (it handshakes again)
    STOP = 4  # the group stops: exit 0


class PlanFanout:
    """Both ends: rank 0 calls ``send``, the others ``recv``, one call per message."""

    def __init__(self, group: TPGroup):
        self.group = group
        self.buf = torch.zeros(CAPACITY, dtype=torch.uint8, device=group.device)  # (CAPACITY,)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(tuple[int, list[int], bytes])
        self.bytes_sent = 0

    def send(self, kind: Kind, tokens: list[int] | tuple = (), frame: bytes = b"") -> None:
        payload = self._encoder.encode((int(kind), tokens, frame))
        n = len(payload)
        head = n.to_bytes(_LEN, "little") + payload[: CAPACITY - _LEN]
        buf = self.buf
        buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        self.group.broadcast(buf)
        rest = payload[CAPACITY - _LEN :]
        if rest:
            self.group.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(buf.device))
        self.bytes_sent += n

    def recv(self) -> tuple[Kind, list[int], bytes]:
        buf = self.buf
        self.group.broadcast(buf)
        head = buf.cpu().numpy().tobytes()
        n = int.from_bytes(head[:_LEN], "little")
        payload = head[_LEN : _LEN + n]
        if n > CAPACITY - _LEN:
            rest = torch.empty(n - (CAPACITY - _LEN), dtype=torch.uint8, device=buf.device)
            self.group.broadcast(rest)
            payload += rest.cpu().numpy().tobytes()
        try:
            kind, tokens, frame = self._decoder.decode(payload)
            return Kind(kind), tokens, frame
        except (msgspec.DecodeError, ValueError) as e:
            raise GroupLost(f"rank {self.group.rank}: a broadcast from rank 0 is not a fan-out message ({e})") from None
