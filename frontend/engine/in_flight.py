"""The engine requests a client has open, by id: where each one's outputs go (its sink),
what is kept to give it again to a scheduler that came back (`ResumeBook`), which the
scheduler has not answered yet, and vLLM's admission counts over them.

Every output of a step is routed here in the reader's one pass (`route`): a sink is
called right there and must not block. A sink that fails ends its own request only."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from frontend.engine.admission import AdmissionControl
from frontend.engine.outputs import EngineError, OutputSink
from frontend.engine.resume import Kept, ResumeBook
from protocol.client_messages import RequestError, TokenOutput

log = logging.getLogger("frontend.engine.client")

Abort = Callable[[Iterable[str]], None]


class InFlight:
    __slots__ = ("sinks", "unheard", "book", "admission", "num_unrouted")

    def __init__(self, admission: AdmissionControl):
        self.sinks: dict[str, OutputSink] = {}
        # Requests sent that the scheduler has not answered yet (no output, no error):
        # the only ones a frame it could not read can have been (`unattributed`).
        self.unheard: dict[str, None] = {}
        self.book = ResumeBook()
        self.admission = admission
        self.num_unrouted = 0  # outputs of requests no longer here (e.g. aborted)

    def __len__(self) -> int:
        return len(self.sinks)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.sinks

    def add(self, request_id: str, prompt_token_ids: list[int], params: dict, sink: OutputSink) -> Kept:
        self.sinks[request_id] = sink
        self.admission.started(request_id, len(prompt_token_ids))
        return self.book.track(request_id, prompt_token_ids, params)

    def forget(self, request_id: str) -> OutputSink | None:
        """Drop every record of a request that ends here (its sink, returned)."""
        self.unheard.pop(request_id, None)
        self.book.forget(request_id)
        self.admission.prefill_done(request_id)
        return self.sinks.pop(request_id, None)

    def fail(self, request_ids: list[str], error: EngineError) -> None:
        for rid in request_ids:
            if (sink := self.forget(rid)) is not None:
                deliver_error(rid, sink, error)

    def route(self, outputs: Iterable[TokenOutput], abort: Abort) -> None:
        """One response frame's outputs to their sinks; ``abort`` ends a request whose sink failed."""
        sinks, unheard, kept = self.sinks, self.unheard, self.book.kept
        admission = self.admission
        prefilling = admission.prefilling  # NOTE: None without --max-num-queued-tokens
        for out in outputs:
            rid = out.request_id
            if unheard:
                unheard.pop(rid, None)
            sink = sinks.get(rid)
            if sink is None:
                self.num_unrouted += 1  # e.g. the last output of a request aborted here
                continue
            if prefilling and rid in prefilling:
                admission.prefill_done(rid)  # its first output: out of prefill, as vLLM's is_prefilling
            if out.finished:
                del sinks[rid]
                kept.pop(rid, None)
            elif out.new_token_ids:
                kept[rid].outputs += out.new_token_ids
            try:
                sink.on_output(out)
            except Exception:  # noqa: BLE001 - one request's failure must not stop the reader
                log.exception("the sink of %s failed; aborting it", rid)
                if not out.finished:
                    abort([rid])
                deliver_error(rid, sink, EngineError("internal error while streaming the request"))

    def refused(self, msg: RequestError, abort: Abort) -> None:
        """The scheduler refused a request: it ends with the scheduler's words."""
        if msg.request_id is None:
            self.unattributed(msg.message, abort)
        elif (sink := self.forget(msg.request_id)) is None:
            log.warning("scheduler error for %s: %s", msg.request_id, msg.message)
        else:
            deliver_error(msg.request_id, sink, EngineError(msg.message, msg.param))

    def unattributed(self, message: str, abort: Abort) -> None:
        """A refusal naming no request: the scheduler could not read one of this
        client's frames far enough to know its request id. It can only be a request
        not answered yet; which one cannot be told, so every such request fails now
        rather than wait for an answer that will never come.

        NOTE: not expected from this client: every Generate is checked against the
        scheduler's decoder before it goes (frontend/engine/generate_frames.py), and the
        scheduler names the request of any frame that is a map with a request id."""
        sinks = {rid: self.sinks.pop(rid) for rid in self.unheard if rid in self.sinks}
        log.error("the scheduler refused a frame it could not read (%s); failing the %d requests it had not answered",
                  message, len(sinks))
        self.unheard.clear()
        abort(sinks)  # NOTE: any of them it did read would otherwise run on, holding blocks
        error = EngineError(f"the scheduler could not read a request: {message}")
        for rid, sink in sinks.items():
            deliver_error(rid, sink, error)


def deliver_error(rid: str, sink: OutputSink, error: EngineError) -> None:
    try:
        sink.on_error(error)
    except Exception:  # noqa: BLE001
        log.exception("the sink of %s failed on an error", rid)
