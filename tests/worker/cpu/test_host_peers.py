"""A worker takes the spare core for a big step only while no other kvpool worker runs
on its host (worker/cpu/host_peers.py): another worker's presence is its held lock, and a
worker that died leaves a file that the next look removes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from worker.cpu.host_peers import HostPeers
from worker.cpu.threads import StepThreads

ROOT = Path(__file__).resolve().parents[3]


def test_a_worker_alone_on_its_host_sees_no_peer(tmp_path):
    me = HostPeers(tmp_path, interval_s=0)
    try:
        assert me.path.exists()
        assert me.alone(0.0)
    finally:
        me.close()
    assert not me.path.exists()


def test_a_live_worker_is_seen_and_a_killed_one_is_forgotten_and_its_file_removed(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from worker.cpu.host_peers import HostPeers
        peers = HostPeers({str(tmp_path)!r})
        print(peers.path, flush=True)
        time.sleep(60)
    """)
    other = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    me = HostPeers(tmp_path, interval_s=0)
    try:
        other_file = Path(other.stdout.readline().strip())
        assert other_file.exists()
        assert not me.alone(1.0)
        other.kill()  # no close(): its lock goes with the process, its file stays
        other.wait(timeout=10)
        assert other_file.exists()
        assert me.alone(2.0)
        assert not other_file.exists()
    finally:
        other.kill()
        other.wait(timeout=10)
        other.stdout.close()
        me.close()


def test_the_directory_is_read_at_most_once_an_interval(tmp_path):
    me = HostPeers(tmp_path, interval_s=5.0)
    other = None
    try:
        assert me.alone(100.0)
        other = HostPeers(tmp_path)  # another open file: its lock excludes ours
        assert me.alone(104.0)  # not looked again yet
        assert not me.alone(105.0)
        other.close()
        other = None
        assert not me.alone(109.0)
        assert me.alone(110.0)
    finally:
        me.close()
        if other is not None:
            other.close()


def test_a_big_step_stays_narrow_while_another_worker_runs(tmp_path, one_thread):
    me = HostPeers(tmp_path, interval_s=0)
    other = HostPeers(tmp_path)
    threads = StepThreads(2, 128, me)
    try:
        with threads.step(512):
            assert torch.get_num_threads() == 1
        other.close()
        with threads.step(512):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    finally:
        other.close()
        me.close()
