"""The engine's side of its worker: the worker port's receive loop, the handshake,
and what a lost worker means for the requests.

``EngineCore`` (scheduler/engine/engine_core.py) holds one ``WorkerSide``; the
link's state machine itself is ``worker_link.WorkerLink``, which the worker side
owns. What it shares with the rest of the engine is the ``EngineState``.

* hello: a refusal (``Shutdown``, the worker exits 4), or WorkerReady and the
  handshake; the worker's acknowledging Heartbeat makes it ready, and only then is
  the BlockPool built (for the first worker).
* a hello from the attached worker is a loss then a handshake; from another, the
  attached one is probed and the newcomer refused only if it still answers.
* a loss (``_on_worker_lost``, called once per loss by the link): running requests
  go back to waiting as if preempted, and the prefix cache must reset: both tiers,
  since the host tier's contents are as unknown as the device's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.codec import Codec, ProtocolError
from protocol.kv_cache_spec import is_hybrid
from protocol.speculative_config import parse_speculative_config
from protocol.worker_messages import (
    ExternalKVDone,
    GrammarsReady,
    Heartbeat,
    KVTransferDone,
    Shutdown,
    StepResult,
    WorkerError,
    WorkerExit,
    WorkerHello,
    WorkerReady,
    WorkerToScheduler,
)
from scheduler.core.block_pool import BlockPool
from scheduler.core.block_residency import residency_pool_factory
from scheduler.core.kv_events import KVEventRecorder
from scheduler.core.offload.offload_tier import HostTier
from scheduler.core.retention.eviction_policies import eviction_pool_factory, kv_cache_manager_class
from scheduler.engine.cache_config_info import cache_config_info
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_state import EngineState
from scheduler.engine.external_setup import check_external_tier, make_external_tier
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.pd_setup import check_kv_transfer, make_pd_connector
from scheduler.engine.sockets import LoopYield, RouterPort, peer_name
from scheduler.engine.worker_checks import (
    PoolShape,
    WorkerRefused,
    check_group_windows,
    host_tier_size_for,
    pool_size_for,
)
from scheduler.engine.worker_link import LinkState, WorkerLink, WorkerLost
from scheduler.sched.policy_options import policy_kwargs
from scheduler.sched.priority_scheduler import scheduler_class
from scheduler.sched.request import RequestStatus
from scheduler.sched.validation import RequestLimits

log = logging.getLogger("scheduler")


class WorkerSide:
    def __init__(
        self, state: EngineState, config: SchedulerConfig, port: RouterPort, metrics: SchedulerMetrics,
        kv_event_sink: KVEventRecorder | None, publish_kv_events: Callable[[], None],
    ):
        """``kv_event_sink``: the pool's, built here for the first worker;
        ``publish_kv_events``: the engine's, called after a loss resets the cache."""
        self.state = state
        self.config = config
        self.port = port
        self.metrics = metrics
        self.kv_event_sink = kv_event_sink
        self.publish_kv_events = publish_kv_events
        self.link = WorkerLink(port, Codec(WorkerToScheduler), config.worker_timeout_s, self._on_worker_lost)
        # The client side's ``end`` (set by the engine once it exists): ends requests
        # whose grammar failed to compile, telling their clients.
        self.end_requests = None
        # The KV-cache groups' windows of the pool built (None before the first worker).
        self.pool_group_windows: list[int] | None = None

    async def receive_loop(self) -> None:
        link, pause = self.link, LoopYield()
        while True:
            await pause()
            frames, _ = await self.port.recv()
            ident = frames[0].bytes
            try:
                msg = link.codec.decode(frames[-1].buffer)
            except ProtocolError as e:
                log.error("bad frame from worker %s: %s", peer_name(ident), e)
                if link.is_ours(ident):
                    # The result of the step in flight may be this frame: never wait for it.
                    link.lose(f"unreadable frame from the worker: {e}")
                continue
            link.heard_from(ident)
            match msg:
                case WorkerHello():
                    await self._on_hello(ident, msg)
                case StepResult():
                    link.deliver(ident, msg)
                case GrammarsReady() if link.is_ours(ident) and self.state.scheduler is not None:
                    await self._on_grammars_ready(msg)
                case ExternalKVDone() if link.is_ours(ident) and self.state.scheduler is not None:
                    self._on_external_done(msg)
                case KVTransferDone() if link.is_ours(ident) and self.state.scheduler is not None:
                    await self._on_transfer_done(msg)
                case Heartbeat():
                    if link.acknowledge(ident):
                        self._on_worker_ready()
                case WorkerError(message=message, step_id=step_id) if link.is_ours(ident):
                    handshaking = link.state is LinkState.HANDSHAKING
                    what = "WorkerReady" if handshaking else f"step {step_id}"
                    link.lose(f"the worker refused {what}: {message}")
                    if not handshaking:
                        # NOTE: it would otherwise wait for this scheduler's silence (its
                        # --scheduler-timeout) before starting over: told to stop, it exits
                        # now and its supervisor restarts it with empty rows.
                        await self._refuse_worker(ident, f"it refused {what}: {message}")
                case WorkerExit(reason=reason) if link.is_ours(ident):
                    link.lose(f"the worker is stopping ({reason or 'no reason given'})", clean=True)
                case WorkerError() | WorkerExit():
                    log.warning("%s from worker %s, which is not this scheduler's worker", msg, peer_name(ident))

    async def _on_grammars_ready(self, msg: GrammarsReady) -> None:
        """Compiled grammars: their requests may be scheduled; a failed one ends with
        its error (the frontend validated it, so this is rare)."""
        scheduler = self.state.scheduler
        if scheduler.grammars_ready(msg.seq_ids):
            self.state.wakeup.set()
        for request_id, error in scheduler.grammar_failures(msg.failed_seq_ids, msg.errors):
            await self.end_requests([request_id], RequestStatus.FINISHED_ERROR, f"grammar compilation failed: {error}")

    def _on_external_done(self, msg: ExternalKVDone) -> None:
        """External loads ended: their requests may be scheduled; keys gone leave the index."""
        kv = self.state.kv
        if kv.external is None:
            return
        kv.external.removed(msg.removed_keys)
        if self.state.scheduler.external_loads_done(msg.loaded):
            self.state.wakeup.set()

    async def _on_transfer_done(self, msg: KVTransferDone) -> None:
        """P/D news: pulls ended (their requests may be scheduled, or fail by the policy);
        lent blocks a decode engine read are freed."""
        scheduler = self.state.scheduler
        if scheduler.kv_transfer is None:
            return
        num_back, failed = scheduler.kv_pulls_done(msg.pulled)
        if num_back + scheduler.lends_read(msg.sent):
            self.state.wakeup.set()
        if failed:
            await self.end_requests(failed, RequestStatus.FINISHED_ERROR,
                                    "the KV of the prompt could not be read from the prefill engine (kv_load_failure_policy fail)")

    async def _refuse_worker(self, ident: bytes, reason: str) -> None:
        log.error("refusing worker %s: %s", peer_name(ident), reason)
        await self.port.send(ident, self.link.codec.encode(Shutdown(reason)))

    async def _on_hello(self, ident: bytes, hello: WorkerHello) -> None:
        c, link, state = self.config, self.link, self.state
        if link.is_ours(ident):
            # The same worker again: it restarted its handshake, its rows are gone.
            link.lose("the worker said hello again (it restarted its handshake)")
        elif link.state is not LinkState.DETACHED:
            await self.probe()  # a worker that is gone is lost here
            if link.state is not LinkState.DETACHED:
                return await self._refuse_worker(ident, f"worker {link.name} is already connected (one worker per scheduler)")
        current = None if state.kv is None else PoolShape(
            state.kv.block_pool.num_gpu_blocks, state.limits.vocab_size, state.eos_token_ids[0], *state.model_identity
        )
        try:
            num_blocks = pool_size_for(hello, c.block_size, c.num_gpu_blocks_override, current, c.max_model_len)
            num_host_blocks = host_tier_size_for(hello, c.kv_offloading_size, self._host_tier_size())
            check_group_windows(hello, self.pool_group_windows)
            check_external_tier(hello, c.kv_offloading_backend)
            check_kv_transfer(hello, c.kv_transfer_config)
        except WorkerRefused as e:
            return await self._refuse_worker(ident, str(e))
        link.begin_handshake(ident, hello, num_blocks)
        next_step_id = 0 if state.scheduler is None else state.scheduler.next_step_id
        try:
            await link.send(WorkerReady(num_blocks, c.block_size, c.max_num_seqs, c.max_model_len, next_step_id, num_host_blocks))
        except WorkerLost:
            return
        log.info("worker %s: WorkerReady sent (%d blocks, %d host blocks), awaiting its acknowledgement", link.name, num_blocks, num_host_blocks)

    def _host_tier_size(self) -> int | None:
        """The host tier's slots, once built (None before the first worker)."""
        kv = self.state.kv
        if kv is None:
            return None
        return 0 if kv.host_tier is None else kv.host_tier.num_host_blocks

    def _on_worker_ready(self) -> None:
        """The worker acknowledged WorkerReady: only now is a pool built for it."""
        state = self.state
        if state.kv is None:
            self._build_pool(self.link.hello, self.link.num_blocks)
        self.metrics.kv_block_bytes.set(self.link.hello.kv_block_bytes)
        if state.kv.external is not None:
            hello = self.link.hello
            state.kv.external.attach(hello.external_identity, hello.external_keys)
            log.info("%s tier: %d blocks held (as the worker listed them)", hello.external_tier, len(hello.external_keys))
        if state.scheduler.kv_transfer is not None:
            state.scheduler.kv_transfer.attach(self.link.hello.kv_transfer_address)
        state.worker_lost_at = None
        # NOTE: a new worker holds no grammar: those still compiling are asked again.
        state.scheduler.recompile_grammars()
        state.wakeup.set()
        log.info("worker %s ready (%d requests waiting)", self.link.name, state.scheduler.num_waiting)

    def _build_pool(self, hello: WorkerHello, num_blocks: int) -> None:
        """The pool, the policy and the request limits, for the first worker; kept after."""
        c, state = self.config, self.state
        # NOTE: without --kv-cache-metrics the pool is the plain one: no hook at all.
        pool_factory = residency_pool_factory(c.kv_cache_metrics_sample) if c.kv_cache_metrics else BlockPool
        # NOTE: lru (the default) keeps that pool as it is; another policy orders its free cached blocks.
        pool_factory = eviction_pool_factory(c.kv_eviction_policy, c.scheduling_policy, base=pool_factory)
        num_host_blocks = host_tier_size_for(hello, c.kv_offloading_size, None)
        host_tier = HostTier(num_host_blocks, c.block_size, event_sink=self.kv_event_sink) if num_host_blocks else None
        self.pool_group_windows = list(hello.group_windows)
        # NOTE: both tiers serve hybrid groups too: they hold each group's block under its keyed hash.
        external_tier = make_external_tier(c.kv_offloading_backend, c.block_size, c.mooncake_master, c.mooncake_metadata)
        state.kv = kv_cache_manager_class(c.scheduling_policy)(
            num_blocks, c.block_size, c.max_model_len, c.enable_prefix_caching, event_sink=self.kv_event_sink, pool_factory=pool_factory,
            host_tier=host_tier, offload_store=c.kv_offloading_store, max_pinned_fraction=c.max_pinned_fraction, external_tier=external_tier,
            group_windows=hello.group_windows, max_num_batched_tokens=c.max_num_batched_tokens,
        )
        state.scheduler = scheduler_class(c.scheduling_policy)(
            state.kv, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.scheduler_reserve_full_isl, **policy_kwargs(c),
            speculative=parse_speculative_config(c.speculative_config), kv_transfer=make_pd_connector(c.kv_transfer_config, c.block_size,
                                                                                             state.kv.group_windows),
        )
        self.metrics.set_cache_config_info(cache_config_info(c, num_blocks))
        state.limits = RequestLimits(hello.vocab_size, c.max_model_len, c.block_size, num_blocks - 1,
                                     state.kv.num_blocks_needed)
        state.eos_token_ids = tuple(hello.eos_token_ids) or (hello.eos_token_id,)
        state.model_identity = (hello.architecture, hello.model_hash)
        log.info("BlockPool of %d blocks x %d tokens (worker %s reported %d), --kv-eviction-policy %s%s", num_blocks, c.block_size,
                 hello.device, hello.num_blocks, c.kv_eviction_policy,
                 f", KV-cache groups of windows {hello.group_windows}" if is_hybrid(hello.group_windows) else "")
        if host_tier is not None:
            log.info("host tier of %d blocks (--kv-offloading-store %s)", num_host_blocks, c.kv_offloading_store)

    async def probe(self) -> None:
        """A worker-port peer disconnected: is it ours? (A failed send loses it.)"""
        if self.link.state is LinkState.DETACHED:
            return
        try:
            await self.link.send(Heartbeat(time.time()))
        except WorkerLost:
            pass

    def _on_worker_lost(self, why: str, was: LinkState, clean: bool) -> None:
        """The link lost its worker (called once per loss, by WorkerLink.lose).
        Requests in flight go back to waiting, as if preempted; the cache is void."""
        state, name = self.state, self.link.name
        scheduler, kv = state.scheduler, state.kv
        if was is LinkState.HANDSHAKING or scheduler is None:
            log.warning("worker %s lost during its handshake: %s", name, why)
            return
        log.log(logging.INFO if clean else logging.ERROR, "worker %s %s: %s; %d running requests go back to waiting",
                name, "left" if clean else "lost", why, scheduler.num_running)
        state.worker_lost_at = time.monotonic()
        scheduler.abandon_in_flight()
        scheduler.abandon_loads()
        scheduler.preempt_all()
        # NOTE: the next worker's KV memory is empty: every hash is void. A block
        # still held here would be served to it as a cache hit of memory it never wrote.
        num_pinned = kv.pinned.num_pinned_blocks
        if not kv.reset_prefix_cache():
            held = kv.block_pool.num_gpu_blocks - 1 - kv.block_pool.get_num_free_blocks()
            raise RuntimeError(f"worker lost but {held} blocks are still held after preempting every request")
        if num_pinned:
            log.warning("worker %s lost: its %d pinned blocks are void, the pins are cleared (pin them again)", name, num_pinned)
        self.publish_kv_events()
        self.metrics.update_waiting_gauges(scheduler)
        self.metrics.update_step_gauges(scheduler, kv)
        self.metrics.update(scheduler, kv)
