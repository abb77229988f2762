"""What the engine's parts share: the pool built for the first worker, and the loop's signals.

`EngineCore` (scheduler/engine/engine_core.py) owns one `EngineState` and hands it
to its client side (scheduler/engine/client_side.py), its worker side
(scheduler/engine/worker_side.py) and its HTTP side (scheduler/engine/http_server.py):
everything they read or change beyond their own port is declared here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.scheduler import Scheduler
from scheduler.sched.validation import RequestLimits


@dataclass(slots=True)
class EngineState:
    # Made when the first worker acknowledges WorkerReady (the pool's size is known); kept after.
    kv: KVCacheManager | None = None
    scheduler: Scheduler | None = None
    limits: RequestLimits | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_identity: tuple[str, str] = ("", "")  # (architecture, model_hash) of the first worker
    # When the last worker was lost; None while one is ready (or none came yet).
    worker_lost_at: float | None = None
    # Set on SIGTERM/SIGINT or an internal error: no new requests, steps stop.
    stopping: bool = False
    # Set whenever the step loop may have something new to schedule.
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
