"""A group that cannot go on raises within --distributed-timeout instead of hanging
(gloo, the CPU path; NCCL's watchdog is set up the same way but needs a GPU): a rank
whose peer never joins fails ``start`` with GroupError, and a collective whose peer
joined but never takes part fails with GroupLost. Each rank is a process of its own
(``init_process_group`` is per process); every one is stopped when the test ends."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1.5
# NOTE: a bound on the wait, far above the timeout under test, not a speed check.
WAIT_S = 60

RANK = textwrap.dedent(
    """
    import sys, time, torch
    from datetime import timedelta
    from worker.parallel.distributed import GroupError, GroupLost, TPGroup
    rank, init, timeout_s, collective, wait_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1", float(sys.argv[5])
    # The store's own wait is long (the peer may take a while to start); the group's is short.
    group = TPGroup(rank, 2, init, torch.device("cpu"), timeout_s, wait_s)
    try:
        if rank == 1:
            group.store.set("peer", "up")
        elif sys.argv[6] == "1":
            group.store.wait(["peer"], timedelta(seconds=wait_s))  # so that the timeout under test starts with both up
        group.start()
        print("started", flush=True)
        if collective:
            group.all_reduce(torch.ones(4))
            print("reduced", flush=True)
        else:
            time.sleep(3600)  # joined, never takes part: stopped by the test
    except (GroupError, GroupLost) as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        sys.exit(2)
    finally:
        group.close()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, init: str, collective: bool, with_peer: bool) -> subprocess.Popen:
    argv = [sys.executable, "-c", RANK, str(rank), init, str(TIMEOUT_S), "1" if collective else "0", str(WAIT_S), "1" if with_peer else "0"]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=WAIT_S)
        p.stdout.close()


def test_a_rank_whose_peer_never_joins_raises_group_error(procs):
    procs.append(start_rank(0, f"tcp://127.0.0.1:{free_port()}", collective=True, with_peer=False))
    out, _ = procs[0].communicate(timeout=WAIT_S)
    assert procs[0].returncode == 2, out
    assert "GroupError: rank 0: init_process_group (gloo) failed" in out and "started" not in out


def test_a_collective_whose_peer_never_takes_part_raises_group_lost(procs):
    init = f"tcp://127.0.0.1:{free_port()}"
    procs.append(start_rank(0, init, collective=True, with_peer=True))
    procs.append(start_rank(1, init, collective=False, with_peer=True))
    out, _ = procs[0].communicate(timeout=WAIT_S)
    assert procs[0].returncode == 2, out
    assert out.splitlines()[0] == "started"
    assert "GroupLost: all_reduce on rank 0 failed" in out and "reduced" not in out
