"""The engine's side of its clients: the client port's receive loop, request intake
(Generate / Abort), the replies, and what a gone client means for its requests.

A refusal is a RequestError to that client alone; a client that is gone, or that
stopped reading, has its requests aborted and their blocks freed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.client_messages import (
    Abort,
    ClientRequest,
    EngineCoreOutputs,
    Generate,
    RequestError,
    peek_request_id,
)
from protocol.codec import Codec, ProtocolError
from protocol.sampling_params import sampling_params_of
from scheduler.core.hashing import BlockHasher
from scheduler.engine.client_outputs import final_outputs_by_client, send_outputs
from scheduler.engine.engine_state import EngineState
from scheduler.engine.sockets import LoopYield, RouterPort, peer_name
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.validation import RequestRejected, validate_generate

log = logging.getLogger("scheduler")


class ClientSide:
    def __init__(
        self, state: EngineState, port: RouterPort, hasher: BlockHasher, max_frame_bytes: int, max_num_waiting: int,
        on_admission_rejection: Callable[[str], None] = lambda reason: None,
        on_stopped: Callable[[Request, float], None] = lambda request, now: None,
    ):
        """``on_admission_rejection(reason)``: a request refused by a queue limit
        (vllm:admission_rejections' reason). ``on_stopped(request, now)``: a request its
        client ended on a stop string, before it is finished (its finished-request stats)."""
        self.state = state
        self.on_admission_rejection = on_admission_rejection
        self.on_stopped = on_stopped
        self.port = port
        self.hasher = hasher
        self.codec: Codec = Codec(ClientRequest, max_frame_bytes)
        self.max_num_waiting = max_num_waiting
        self._next_seq_id = 0

    async def receive_loop(self) -> None:
        pause = LoopYield()
        while True:
            await pause()
            frames, num_frames = await self.port.recv()
            ident = frames[0].bytes
            if num_frames != 2:
                rid = peek_request_id(frames[1].buffer) if len(frames) > 1 else None
                await self.send_error(ident, rid, f"expected one frame per message, got {num_frames - 1}")
                continue
            try:
                msg = self.codec.decode(frames[1].buffer)
            except ProtocolError as e:
                # NOTE: named, the refusal reaches the request's waiter (a frame over the
                # size limit is read too: MAXMSGSIZE bounds what arrives at all).
                await self.send_error(ident, peek_request_id(frames[1].buffer), str(e))
                continue
            match msg:
                case Generate():
                    await self._on_generate(ident, msg)
                case Abort():
                    await self._on_abort(ident, msg)

    async def _on_generate(self, ident: bytes, msg: Generate) -> None:
        state, scheduler = self.state, self.state.scheduler
        if state.stopping:
            return await self.send_error(ident, msg.request_id, "the scheduler is shutting down")
        # NOTE: with no pool yet (no worker ever came) nothing can be checked or queued.
        # After that a missing worker is one restarting: the request waits in the queue
        # like any other, for at most --worker-reconnect-timeout (the step loop's bound).
        if scheduler is None:
            return await self.send_error(ident, msg.request_id, "no worker is ready: try again once /health returns 200")
        try:
            validate_generate(msg, state.limits, scheduler.requests)
        except RequestRejected as e:
            return await self.send_error(ident, msg.request_id, str(e), e.param)
        if scheduler.kv_transfer is not None and msg.request_id in scheduler.kv_transfer.lent:
            return await self.send_error(ident, msg.request_id, f"request id {msg.request_id!r} is in use (its blocks are lent to a decode engine)")
        if scheduler.num_waiting >= self.max_num_waiting:
            # NOTE: vLLM's max_num_queued_reqs refuses on waiting + running; --max-num-waiting on waiting alone.
            self.on_admission_rejection("max_num_queued_reqs")
            return await self.send_error(
                ident, msg.request_id,
                f"the waiting queue is full ({scheduler.num_waiting} requests, --max-num-waiting): try again later",
            )
        eos = state.eos_token_ids
        request = Request(
            msg.request_id, msg.prompt_token_ids, msg.max_tokens, seq_id=self._next_seq_id, client_id=ident,
            ignore_eos=msg.ignore_eos, eos_token_id=eos, cache_salt=msg.cache_salt, block_hasher=self.hasher,
            stop_token_ids=msg.stop_token_ids, min_tokens=msg.min_tokens, sampling=sampling_params_of(msg, eos),
            priority=msg.priority, grammar=msg.structured_outputs,
        )
        request.kv_transfer_params = msg.kv_transfer_params
        if msg.resumed_token_ids:
            request.append_output_token_ids(msg.resumed_token_ids)  # NOTE: recomputed at admission, as after a preemption
        self._next_seq_id += 1
        scheduler.add_request(request)
        state.wakeup.set()

    async def _on_abort(self, ident: bytes, msg: Abort) -> None:
        scheduler, request_id = self.state.scheduler, msg.request_id
        request = scheduler.requests.get(request_id) if scheduler else None
        if request is None or request.client_id != ident:
            return await self.send_error(ident, request_id, f"unknown request id {request_id!r}: nothing to abort")
        if msg.stopped and request.first_token_time is not None:
            self.on_stopped(request, time.monotonic())
        scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        await self.send_outputs(final_outputs_by_client([request], "abort"))
        self.state.wakeup.set()

    async def send_error(self, ident: bytes, request_id: str | None, message: str, param: str | None = None) -> None:
        if request_id is not None:
            log.info("request %s refused: %s", request_id, message)
        else:
            log.debug("message from %s refused: %s", peer_name(ident), message)
        # NOTE: an error reply that cannot be delivered is dropped: the peer is gone or
        # is flooding without reading, and nothing else is owed to it.
        await self.port.send(ident, self.codec.encode(RequestError(message, request_id, param)))

    async def send_outputs(self, batches: dict[bytes, EngineCoreOutputs]) -> None:
        """One frame per client; a client that cannot take it is dropped."""
        for ident in send_outputs(self.port, self.codec, batches):
            self._drop_client(ident)

    async def end_all(self, status: RequestStatus, message: str = "") -> None:
        """End every live request; each client hears of it (abort, or a RequestError)."""
        if self.state.scheduler is not None:
            await self.end(list(self.state.scheduler.requests), status, message)

    async def end(self, request_ids: list[str], status: RequestStatus, message: str = "") -> None:
        """End these live requests; each client hears of it (abort, or a RequestError)."""
        scheduler = self.state.scheduler
        ended = scheduler.finish_requests(request_ids, status)
        if status == RequestStatus.FINISHED_ERROR:
            for request in ended:
                await self.send_error(request.client_id, request.request_id, message)
        else:
            await self.send_outputs(final_outputs_by_client(ended, status.value))

    def _drop_client(self, ident: bytes) -> None:
        """The client is gone (or stopped reading): abort its requests, free their blocks."""
        scheduler = self.state.scheduler
        if scheduler is None:
            return
        ids = [rid for rid, r in scheduler.requests.items() if r.client_id == ident]
        if ids:
            log.warning("client %s is gone: aborting its %d requests", peer_name(ident), len(ids))
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.state.wakeup.set()

    async def sweep(self) -> None:
        """A client disconnected: probe every client with live requests (an empty
        EngineCoreOutputs is a no-op for a client) and drop those that are gone."""
        scheduler = self.state.scheduler
        if scheduler is None:
            return
        probe = EngineCoreOutputs()
        await self.send_outputs({r.client_id: probe for r in scheduler.requests.values()})
