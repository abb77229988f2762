"""The whole engine-core step in one process: schedule, encode the plan, apply a
fake result, then encode and send the outputs to 8 clients over real loopback
ZMQ sockets (a `RouterPort` and 8 DEALERs), the way `StepLoop.run` does.

N running decodes of 1,000-token context, spread round-robin over the 8 clients.
The result is built directly (every row samples a fixed token) instead of by a
worker, so the figure is the engine core's own. Each figure is the best average
over a whole 16-step cycle (one block boundary per request per cycle); the clients
are drained between cycles, outside the timing. The "1 frame per request" row
sends each TokenOutput in a frame of its own with an awaited asyncio send (how
outputs went before they were batched), for comparison.

vLLM 0.32's own ``schedule()`` + ``update_from_output()`` (no sockets) takes 898 us
at 64 and 3,470 us at 256 decodes on the 2-core development machine.

``python -m bench engine`` prints the table.
"""

from __future__ import annotations

import asyncio
import gc
import time

import zmq
import zmq.asyncio

from bench.table import Row
from protocol.client_messages import ClientResponse, EngineCoreOutputs
from protocol.codec import Codec
from protocol.worker_messages import SchedulerToWorker, StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.client_outputs import outputs_by_client, send_outputs
from scheduler.engine.sockets import RouterPort
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 16
CONTEXT = 1000
MAX_MODEL_LEN = 1 << 16
SAMPLED = 7
NUM_CLIENTS = 8
STEP_TARGET_US = 500.0  # at 256 running decodes


def _prompt(i: int, n: int) -> list[int]:
    return [2 + (i * 131 + j * 17) % 500 for j in range(n)]


class _Clients:
    """A RouterPort on a free loopback port and NUM_CLIENTS DEALERs it can route to."""

    def __init__(self, ctx: zmq.asyncio.Context):
        self.port = RouterPort(ctx, "tcp://127.0.0.1:*")
        address = self.port.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.idents = [f"client-{k}".encode() for k in range(NUM_CLIENTS)]
        self.dealers = []
        for ident in self.idents:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.IDENTITY, ident)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 0)
            d.connect(address)
            self.dealers.append(d)

    async def introduce(self) -> None:
        """Each DEALER says hello, so that the ROUTER knows its route."""
        for d in self.dealers:
            await d.send(b"hello")
        for _ in self.dealers:
            await asyncio.wait_for(self.port.recv(), 10)

    async def drain(self) -> int:
        """Read every frame sent so far (bounded wait for the last ones); frames read."""
        n = 0
        for d in self.dealers:
            while await d.poll(20):
                await d.recv(copy=False)
                n += 1
        return n

    def close(self) -> None:
        for d in self.dealers:
            d.close(linger=0)
        self.port.close()


def _setup(num_running: int, num_steps: int, idents: list[bytes]) -> Scheduler:
    blocks_per_request = -(-(CONTEXT + num_steps + 64) // BS)
    kv = KVCacheManager(num_running * blocks_per_request + 16, BS, MAX_MODEL_LEN)
    sched = Scheduler(kv, num_running, num_running * CONTEXT, MAX_MODEL_LEN)
    hasher = BlockHasher(BS)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", _prompt(i, CONTEXT), MAX_MODEL_LEN // 2, seq_id=i, ignore_eos=True,
                                  block_hasher=hasher, client_id=idents[i % len(idents)]))
    out = sched.schedule()
    ids = [r.seq_id for r in out.scheduled]
    sched.update_from_output(StepResult(out.plan.step_id, ids, [SAMPLED] * len(ids)))
    return sched


async def _engine_steps(num_running: int, batched: bool, cycles: int) -> tuple[float, float]:
    """Best microseconds per step over a 16-step cycle, and frames per step."""
    ctx = zmq.asyncio.Context()
    clients = _Clients(ctx)
    try:
        await clients.introduce()
        sched = _setup(num_running, cycles * BS, clients.idents)
        plan_codec, client_codec = Codec(SchedulerToWorker), Codec(ClientResponse)
        schedule, update, encode_plan = sched.schedule, sched.update_from_output, plan_codec.encode
        port = clients.port
        seq_ids = [r.seq_id for r in sched.running]
        sampled = [SAMPLED] * num_running
        best = float("inf")
        frames = 0
        gc.collect()
        for _ in range(cycles):
            t0 = time.perf_counter()
            for _ in range(BS):
                out = schedule()
                encode_plan(out.plan)
                result = StepResult(out.plan.step_id, seq_ids, sampled)
                outputs = update(result)
                batches = outputs_by_client(outputs, result.logprobs)
                if not batched:  # the old way: a frame per request, each an awaited asyncio send
                    encode = client_codec.encode
                    failed = [c for c, b in batches.items() for o in b.outputs
                              if not await port.send(c, encode(EngineCoreOutputs([o])))]
                else:
                    failed = send_outputs(port, client_codec, batches)
                assert not failed, failed
            best = min(best, (time.perf_counter() - t0) / BS)
            frames += await clients.drain()
        assert sched.num_running == num_running and sched.num_preemptions == 0
        return best * 1e6, frames / (cycles * BS)
    finally:
        clients.close()
        ctx.term()


def engine_step_us(num_running: int, batched: bool = True, cycles: int = 30) -> tuple[float, float]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_engine_steps(num_running, batched, cycles))
    return uvloop.run(_engine_steps(num_running, batched, cycles))


def rows() -> list[Row]:
    out: list[Row] = []
    for n in (1, 64, 256):
        us, frames = engine_step_us(n)
        label = f"engine step, {n} decodes x {CONTEXT} ctx, {NUM_CLIENTS} clients"
        if n == 256:
            out.append(Row(label, us, "us", f"≤ {STEP_TARGET_US:g} us", us <= STEP_TARGET_US))
        else:
            out.append(Row(label, us, "us"))
        out.append(Row(f"client frames per step, {n} decodes", frames, "", f"= {min(n, NUM_CLIENTS)}", frames == min(n, NUM_CLIENTS)))
    us, frames = engine_step_us(256, batched=False, cycles=10)
    out.append(Row("engine step, 256 decodes, 1 frame per request (old)", us, "us"))
    return out


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
