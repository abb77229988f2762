"""Requests whose grammar is still compiling (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR): structured
outputs as the scheduler sees them.

A request with a grammar arrives here, not in the waiting queue: the worker (rank 0,
where tokens are sampled) compiles grammars on a thread of its own, and says which are
ready (``GrammarsReady``); only then does the request join the waiting queue, at the
back, like a request arriving that moment. The scheduler never compiles a grammar and
never sees a bitmask: it only learns "ready" or "failed".

A mixin of `Scheduler` (scheduler/sched/scheduler.py), over its waiting queue and its
request maps. The engine takes the compiles to send with ``take_grammar_compiles``.
"""

from __future__ import annotations

from protocol.structured_output import GrammarSpec
from scheduler.sched.request import Request, RequestStatus


class GrammarWait:
    def _init_grammar_wait(self) -> None:
        # seq_id -> request, in arrival order.
        self.waiting_for_grammar: dict[int, Request] = {}
        self._grammars_to_compile: list[Request] = []

    def _wait_for_grammar(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.waiting_for_grammar[request.seq_id] = request
        self._grammars_to_compile.append(request)

    def take_grammar_compiles(self) -> tuple[list[int], list[GrammarSpec]]:
        """The grammars to send the worker (``CompileGrammars``): of the requests that
        arrived since the last call and still wait."""
        todo, self._grammars_to_compile = self._grammars_to_compile, []
        todo = [r for r in todo if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR]
        return [r.seq_id for r in todo], [r.grammar for r in todo]

    def recompile_grammars(self) -> None:
        """A new worker holds no grammar: every request still waiting for one asks again."""
        self._grammars_to_compile = list(self.waiting_for_grammar.values())

    def grammars_ready(self, seq_ids: list[int]) -> int:
        """These requests' grammars compiled: they join the waiting queue. Unknown ids
        (ended meanwhile, or told twice) are skipped. Returns how many joined."""
        joined = 0
        for seq_id in seq_ids:
            request = self.waiting_for_grammar.pop(seq_id, None)
            if request is not None:
                request.status = RequestStatus.WAITING
                self.waiting.append(request)
                joined += 1
        return joined

    def grammar_failures(self, seq_ids: list[int], errors: list[str]) -> list[tuple[str, str]]:
        """(client id, error) of each request still waiting whose grammar failed to compile."""
        return [(r.request_id, e) for s, e in zip(seq_ids, errors, strict=False) if (r := self.waiting_for_grammar.get(s)) is not None]
