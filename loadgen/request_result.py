"""What either backend of the load generator (the native client, loadgen/client.py;
the HTTP one, loadgen/openai_client.py) gives the runner: a `RequestResult` per request,
judged by the same finish reasons, and `SchedulerUnreachable` when it cannot reach its
server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# NOTE: "length" (max_tokens reached) and "stop" (EOS) are the only normal endings;
# "abort" and "error" mean the request did not complete.
SUCCESS_FINISH_REASONS = frozenset({"length", "stop"})


class SchedulerUnreachable(ConnectionError):
    """No connection to the scheduler's client port could be made in time."""


@dataclass(slots=True)
class RequestResult:
    """What happened to one request; times in seconds (perf_counter based)."""

    index: int
    request_id: str
    prompt_len: int
    success: bool = False
    error: str | None = None
    finish_reason: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # None: the server did not report it (an OpenAI server without prompt_tokens_details).
    num_cached_tokens: int | None = 0

    @property
    def output_len(self) -> int:
        return len(self.token_ids)
