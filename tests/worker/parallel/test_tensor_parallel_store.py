"""The group's start-up through rank 0's TCP store, in one process (each rank a thread
with its own store client): the store listens on loopback only, on the port it chose;
a rank claimed twice is refused; the first disagreement is named with both values on
every rank; the pool is the smallest count any rank offers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from worker.parallel.distributed import GroupError, TPGroup

CPU = torch.device("cpu")


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} gives them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                out.append(local.rsplit(":", 1)[0])
    return out


def ranks(identities: list[dict], init_method: str) -> tuple[list[BaseException | None], list[threading.Thread]]:
    """Every rank but 0 agreeing in a thread of its own; their errors fill in as they end."""
    errors: list[BaseException | None] = [None] * len(identities)

    def run(r: int) -> None:
        try:
            TPGroup(r, identities[r]["world_size"], init_method, CPU, 10, 10).agree(identities[r])
        except GroupError as e:
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(1, len(identities))]
    for t in threads:
        t.start()
    return errors, threads


def test_rank_0_listens_on_loopback_only_and_the_group_agrees():
    g0 = TPGroup(0, 3, "tcp://127.0.0.1:0", CPU, 10, 10)
    try:
        port = int(g0.init_method.rsplit(":", 1)[1])
        assert port > 0 and listening(port) == ["0100007F"]  # 127.0.0.1, nothing else
        same = {"world_size": 3, "model": "abc"}
        errors, threads = ranks([same, same, same], g0.init_method)
        g0.agree(same)
        for t in threads:
            t.join(20)
        assert errors == [None, None, None]
    finally:
        g0.close()


def test_the_first_disagreement_is_named_on_every_rank():
    g0 = TPGroup(0, 2, "tcp://127.0.0.1:0", CPU, 10, 10)
    try:
        errors, threads = ranks([{"world_size": 2, "model": "abc"}, {"world_size": 2, "model": "xyz"}], g0.init_method)
        with pytest.raises(GroupError, match="tensor-parallel group refused: rank 1 has model 'xyz', rank 0 has 'abc'"):
            g0.agree({"world_size": 2, "model": "abc"})
        for t in threads:
            t.join(20)
        assert "rank 1 has model 'xyz', rank 0 has 'abc'" in str(errors[1])
    finally:
        g0.close()


def test_a_rank_claimed_twice_is_refused_and_the_pool_is_the_smallest_offer():
    g0 = TPGroup(0, 2, "tcp://127.0.0.1:0", CPU, 10, 10)
    try:
        g1 = TPGroup(1, 2, g0.init_method, CPU, 10, 10)
        t = threading.Thread(target=g1.agree, args=({"world_size": 2},))
        t.start()
        g0.agree({"world_size": 2})
        t.join(20)
        with pytest.raises(GroupError, match="rank 1 of this group is already taken by another process"):
            TPGroup(1, 2, g0.init_method, CPU, 10, 10).agree({"world_size": 2})
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(g1.min_over_ranks("num_blocks", 256)))
        t.start()
        assert g0.min_over_ranks("num_blocks", 512) == 256
        t.join(20)
        assert got == [256]
    finally:
        g0.close()
