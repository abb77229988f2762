"""The engine-step benchmark measures what it says: every step sends one frame to
each of the 8 clients (fewer when fewer requests run), none to anyone else."""

from __future__ import annotations

from bench.engine_bench import NUM_CLIENTS, engine_step_us


def test_one_frame_per_client_per_step_batched_and_one_per_request_unbatched():
    us, frames = engine_step_us(16, cycles=2)
    assert us > 0 and frames == NUM_CLIENTS
    _, frames = engine_step_us(3, cycles=1)
    assert frames == 3
    _, frames = engine_step_us(16, batched=False, cycles=1)
    assert frames == 16
