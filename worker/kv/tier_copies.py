"""The offload tier's copies: device blocks to host slots (stores) and back (loads).

A step's ``TierCopies`` (protocol/worker_messages.py) are applied after its row deltas
and before any of its tokens is written or attended (DESIGN.md rule 3): every store
first, then every load, so a device block stored and reused in the same step is saved
before it is overwritten, and a host slot stored and loaded in the same step gives
the load the new content. The ids are checked before (worker/step/plan_check.py).

Both tiers have the same layout per KV tensor, ``(2, blocks, block_size, kvh, hd)``, so a
block is two contiguous chunks (K and V) of ``block_size * kvh * hd`` elements. The
copies run over the distinct KV tensors (``distinct_kv_tensors``): a hybrid model's
layers of different KV-cache groups share one, and a block id belongs to one group at a
time, so copying block b across them moves b's whole KV whichever group holds it.

* CPU (device and host tiers in the same memory): per KV tensor, one slice copy per run of
  consecutive (source, target) ids, usually one per block.
  NOTE: not one fancy-indexed copy per KV tensor: numpy's ``host[:, h] = dev[:, d]`` and
  torch's ``index_copy_(index_select(...))`` go through a temporary (gather, then
  scatter), so they reach well under ``copy_``'s bandwidth, and the slice loop comes
  closer (``python -m bench offload`` measures it against copy_ every run).
* CUDA (host tier pinned): per KV tensor one ``index_select`` on the device and one
  asynchronous device-to-host copy of the gathered blocks (stores), one host
  ``index_select`` into a pinned buffer, one asynchronous host-to-device copy and one
  ``index_copy_`` on the device (loads), all on a side stream. The compute stream
  waits on an event after the stores' gathers (their device blocks may then be
  rewritten) and on an event after the loads (attention then reads them); the stores'
  host side (pinned buffer -> host slots) is written in ``finish``, at the end of the
  step, or before the loads when a load reads a slot stored in the same step.
  NOTE: written without a GPU to run it on (the development machine has none); the
  CPU path is what the tests exercise.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from protocol.worker_messages import TierCopies
from worker.kv.kv_cache import SAME_SIZE_INT, block_bytes, distinct_kv_tensors

Run = tuple[int, int, int]  # (first source id, first target id, number of blocks)


def runs(sources: list[int], targets: list[int]) -> list[Run]:
    """Consecutive (source, target) pairs merged: each run is one slice copy."""
    out: list[list[int]] = []
    for s, t in zip(sources, targets, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == t:
            out[-1][2] += 1
        else:
            out.append([s, t, 1])
    return [(s, t, n) for s, t, n in out]


def _as_numpy(kv: torch.Tensor) -> np.ndarray:
    """A CPU cache (2, blocks, bs, kvh, hd) as a numpy (2, blocks, bs * kvh * hd) view."""
    two, num_blocks = kv.shape[:2]
    return kv.view(two, num_blocks, -1).view(SAME_SIZE_INT[kv.element_size()]).numpy()


def _copy_runs(dst: np.ndarray, src: np.ndarray, pairs: list[Run]) -> None:
    """dst[:, t:t+n] = src[:, s:s+n] for each run (both (2, blocks, elems) views)."""
    for s, t, n in pairs:
        if n == 1:
            dst[:, t] = src[:, s]
        else:
            dst[:, t : t + n] = src[:, s : s + n]


class TierCopier:
    """Copies between one worker's device caches and its host tier, KV tensor by KV tensor.

    ``device_caches``: one entry per layer (or the distinct tensors already); the copies
    run over ``distinct_kv_tensors(device_caches)``, one host tensor each (``host_caches``,
    as ``allocate_host_kv_caches`` makes them).

    Counters (running totals, for the process loop to export): blocks, bytes and
    seconds of each direction, and the steps that copied in each direction."""

    def __init__(self, device_caches: list[torch.Tensor], host_caches: list[torch.Tensor]):
        device_caches = distinct_kv_tensors(device_caches)
        if len(device_caches) != len(host_caches):
            raise ValueError(f"{len(device_caches)} device caches but {len(host_caches)} host caches")
        for i, (d, h) in enumerate(zip(device_caches, host_caches, strict=True)):
            if d.shape[0] != h.shape[0] or d.shape[2:] != h.shape[2:] or d.dtype != h.dtype:
                raise ValueError(f"KV tensor {i}: host tier {tuple(h.shape)} {h.dtype} does not match the device cache {tuple(d.shape)} {d.dtype}")
            if h.device.type != "cpu":
                raise ValueError(f"KV tensor {i}: the host tier must be in host memory, not on {h.device}")
        self.device_caches = device_caches
        self.host_caches = host_caches
        self.num_host_blocks = host_caches[0].shape[1]
        self.block_bytes = block_bytes(device_caches)
        self.device = device_caches[0].device
        self.on_cuda = self.device.type == "cuda"
        self.host_np = [_as_numpy(h) for h in host_caches]
        if self.on_cuda:
            # NOTE: as same-size integers, so the copies move bytes whatever the KV dtype
            # (index_copy_ has no fp8 kernels).
            self.device_caches = [d.view(SAME_SIZE_INT[d.element_size()]) for d in device_caches]
            self.host_caches = [h.view(SAME_SIZE_INT[h.element_size()]) for h in host_caches]
            self.stream = torch.cuda.Stream(self.device)
            self._pending_store: tuple[list[torch.Tensor], list[int], torch.cuda.Event, torch.cuda.Event] | None = None
            self._pending_load: tuple[list[torch.Tensor], torch.cuda.Event, torch.cuda.Event] | None = None
        else:
            self.device_np = [_as_numpy(d) for d in device_caches]
        self.stored_blocks = self.loaded_blocks = 0
        self.store_bytes = self.load_bytes = 0
        self.store_seconds = self.load_seconds = 0.0
        self.store_steps = self.load_steps = 0

    def copy(self, tc: TierCopies) -> None:
        """Every store, then every load. On return the loads are visible to the work the
        caller queues next (CUDA: the current stream waits on them)."""
        stores, loads = len(tc.store_device_ids), len(tc.load_device_ids)
        if stores:
            self.stored_blocks += stores
            self.store_bytes += stores * self.block_bytes
            self.store_steps += 1
        if loads:
            self.loaded_blocks += loads
            self.load_bytes += loads * self.block_bytes
            self.load_steps += 1
        if self.on_cuda:
            self._copy_cuda(tc)
            return
        if stores:
            t0 = time.perf_counter()
            pairs = runs(tc.store_device_ids, tc.store_host_ids)
            for dst, src in zip(self.host_np, self.device_np, strict=True):
                _copy_runs(dst, src, pairs)
            self.store_seconds += time.perf_counter() - t0
        if loads:
            t0 = time.perf_counter()
            pairs = runs(tc.load_host_ids, tc.load_device_ids)
            for dst, src in zip(self.device_np, self.host_np, strict=True):
                _copy_runs(dst, src, pairs)
            self.load_seconds += time.perf_counter() - t0

    def finish(self) -> None:
        """End of the step: on CUDA, write the stores' host side and add up the copies'
        times (both wait for the side stream). On CPU everything is done already."""
        if self.on_cuda:
            self._finish_store()
            self._finish_load()

    # --- CUDA ------------------------------------------------------------------------

    def _copy_cuda(self, tc: TierCopies) -> None:
        compute = torch.cuda.current_stream(self.device)
        side = self.stream
        # NOTE: the side stream first waits for everything queued before (the last
        # step's writes into the blocks being stored).
        side.wait_stream(compute)
        if tc.store_device_ids:
            start, gathered, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            staged: list[torch.Tensor] = []
            with torch.cuda.stream(side):
                start.record(side)
                idx = torch.tensor(tc.store_device_ids, dtype=torch.long).to(self.device, non_blocking=True)
                on_device = [kv.index_select(1, idx) for kv in self.device_caches]  # each (2, n, bs, kvh, hd)
                gathered.record(side)
                for g in on_device:
                    pinned = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    pinned.copy_(g, non_blocking=True)
                    staged.append(pinned)
                done.record(side)
            # The blocks may be rewritten (by loads or this step's tokens) once gathered.
            compute.wait_event(gathered)
            self._pending_store = (staged, list(tc.store_host_ids), start, done)
        if tc.load_device_ids:
            if self._pending_store is not None and not set(tc.load_host_ids).isdisjoint(self._pending_store[1]):
                self._finish_store()  # a load reads a slot stored in this step
            t0 = time.perf_counter()
            hidx = torch.tensor(tc.load_host_ids, dtype=torch.long)
            staged = []
            for h in self.host_caches:
                pinned = torch.empty((h.shape[0], len(tc.load_host_ids), *h.shape[2:]), dtype=h.dtype, pin_memory=True)  # (2, n, bs, kvh, hd)
                torch.index_select(h, 1, hidx, out=pinned)
                staged.append(pinned)
            self.load_seconds += time.perf_counter() - t0
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record(side)
                didx = torch.tensor(tc.load_device_ids, dtype=torch.long).to(self.device, non_blocking=True)
                for kv, pinned in zip(self.device_caches, staged, strict=True):
                    kv.index_copy_(1, didx, pinned.to(self.device, non_blocking=True))
                done.record(side)
            compute.wait_event(done)  # attention reads the loaded blocks
            self._pending_load = (staged, start, done)

    def _finish_store(self) -> None:
        if self._pending_store is None:
            return
        staged, host_ids, start, done = self._pending_store
        self._pending_store = None
        done.synchronize()
        self.store_seconds += start.elapsed_time(done) / 1e3
        t0 = time.perf_counter()
        pairs = runs(list(range(len(host_ids))), host_ids)
        for dst, pinned in zip(self.host_np, staged, strict=True):
            _copy_runs(dst, _as_numpy(pinned), pairs)
        self.store_seconds += time.perf_counter() - t0

    def _finish_load(self) -> None:
        if self._pending_load is None:
            return
        _staged, start, done = self._pending_load  # staged kept alive until the copies ran
        self._pending_load = None
        done.synchronize()
        self.load_seconds += start.elapsed_time(done) / 1e3
