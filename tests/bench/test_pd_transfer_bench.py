"""bench/pd_transfer_bench.py's ZMQ path over a real socket between two processes: the
reader's blocks are the server's, byte for byte, and the server's process is gone after
the reader is done with it, whether the reader finished or failed."""

from __future__ import annotations

import pytest
import torch

from bench.pd_transfer_parts import KVLayout, make_kv_cache
from bench.pd_transfer_zmq import ZmqBlockReader

pytestmark = pytest.mark.timeout(60)

SEED = 7
# A pool of 8 blocks, 2 layers; 4 blocks at scattered ids go to 4 other ids.
LAYOUT = KVLayout(num_layers=2, num_blocks=8)
SRC_IDS = [5, 0, 7, 2]
DST_IDS = [1, 6, 3, 4]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """bf16 as int16: equal exactly when the bytes are (NaN and -0.0 included)."""
    return t.contiguous().view(torch.int16)


def test_zmq_read_writes_the_servers_blocks_byte_for_byte_and_stops_the_server():
    kv_cache = make_kv_cache(LAYOUT, seed=None)  # num_layers x (2, 8, 16, 3, 64), zeros
    with ZmqBlockReader(LAYOUT, server_seed=SEED) as reader:
        server = reader.server_process
        assert server.is_alive()
        timing = reader.read(SRC_IDS, kv_cache, torch.tensor(DST_IDS))
        assert reader.read_wire(SRC_IDS) == len(SRC_IDS) * LAYOUT.bytes_per_block
    assert not server.is_alive()
    assert timing.total_s >= timing.received_s > 0

    source = make_kv_cache(LAYOUT, seed=SEED)  # the server's, rebuilt from its seed
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in DST_IDS]
    for got, want in zip(kv_cache, source, strict=True):
        assert torch.equal(as_bytes(got[:, DST_IDS]), as_bytes(want[:, SRC_IDS]))
        assert not got[:, untouched].any()


def test_the_server_stops_when_the_reader_fails():
    with pytest.raises(RuntimeError, match="the reader failed"):
        with ZmqBlockReader(LAYOUT, server_seed=SEED) as reader:
            server = reader.server_process
            raise RuntimeError("the reader failed")
    assert not server.is_alive()
