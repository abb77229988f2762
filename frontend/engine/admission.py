"""vLLM 0.32's admission control (``AsyncLLM.check_admission``), in the frontend as
vLLM has it in its API server process.

* ``--max-num-queued-reqs N``: a request is refused when the engine requests in
  flight (waiting or running, those this frontend has open on the scheduler) plus
  its own would pass N. A request with ``n`` choices counts ``n`` (vLLM fans them out
  as n engine requests, and so does kvpool).
* ``--max-num-queued-tokens N``: a request is refused once the prompt tokens of the
  engine requests still in prefill (sent, no output yet: vLLM's ``is_prefilling``)
  reach N. As vLLM's, the count is conservative: a prompt counts whole until its
  first token, whatever was chunked or found cached.

Both are checked where vLLM checks them: once before the prompt is rendered
(``_preflight``, with the request's ``n``) and once as the engine requests start
(``add_request``: prompt by prompt, a prompt's n requests checked once, with those of
the prompts before it counted in; `check_prompts`). A refusal is HTTP 503
with vLLM's message, ``type`` "Service Unavailable" and no Retry-After, and counts
one in ``vllm:admission_rejections{reason}`` (merged into the scheduler's family on
/metrics: `merge_rejections`).
"""

from __future__ import annotations

import argparse
import re
from http import HTTPStatus

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from frontend.schema.errors import APIError
from protocol.human_readable import human_readable_int

# vLLM's ADMISSION_REASONS (vllm/v1/metrics/loggers.py), its messages (vllm/exceptions.py).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
QUEUE_FULL = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
BACKLOG_FULL = "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
REJECTIONS = "vllm:admission_rejections"


class AdmissionRejected(APIError):
    """vLLM's QueueOverflowError / MaxQueuedTokensError: a GracefulHTTPError, whose
    type is the status phrase. NOTE: no Retry-After, as vLLM (kvpool's other 503s,
    a worker restarting, give one)."""

    def __init__(self, message: str):
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE, type_=HTTPStatus.SERVICE_UNAVAILABLE.phrase)

    def response(self) -> web.Response:
        return web.Response(status=self.status.value, body=msgspec.json.encode(self.body()), content_type="application/json")


class AdmissionControl:
    def __init__(self, max_num_queued_reqs: int | None = None, max_num_queued_tokens: int | None = None):
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.rejections = dict.fromkeys(ADMISSION_REASONS, 0)
        # Engine request id -> its prompt's length, from its Generate to its first output.
        # NOTE: None without a token limit: the engine client's reader then does nothing.
        self.prefilling: dict[str, int] | None = {} if max_num_queued_tokens is not None else None
        self.num_prefill_tokens = 0

    def check(self, num_in_flight: int, n: int = 1, pending_tokens: int = 0) -> None:
        """vLLM's check_admission: raise AdmissionRejected (counted) if a request of
        ``n`` engine requests may not start now (``pending_tokens``: prompt tokens
        about to join the backlog before it)."""
        if self.max_num_queued_reqs is not None and num_in_flight + n > self.max_num_queued_reqs:
            self.rejections["max_num_queued_reqs"] += 1
            raise AdmissionRejected(QUEUE_FULL)
        if self.max_num_queued_tokens is not None and self.num_prefill_tokens + pending_tokens >= self.max_num_queued_tokens:
            self.rejections["max_num_queued_tokens"] += 1
            raise AdmissionRejected(BACKLOG_FULL)

    def check_prompts(self, num_in_flight: int, prompt_lens: list[int], n: int) -> None:
        """vLLM's add_request, prompt by prompt (its n engine requests checked once):
        each as if those before it had started. Called right before any starts, so a
        refusal starts none (vLLM starts and aborts those before it)."""
        pending = 0
        for i, num_tokens in enumerate(prompt_lens):
            self.check(num_in_flight + i * n, n, pending)
            pending += num_tokens * n

    def started(self, request_id: str, num_prompt_tokens: int) -> None:
        if self.prefilling is not None:
            self.prefilling[request_id] = num_prompt_tokens
            self.num_prefill_tokens += num_prompt_tokens

    def prefill_done(self, request_id: str) -> None:
        """Its first output came, or it ended (finished, aborted, failed) without one."""
        if self.prefilling:
            self.num_prefill_tokens -= self.prefilling.pop(request_id, 0)


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags, read as vLLM reads them (1k, 2K); unset: no limit."""
    for flag, what in (("--max-num-queued-reqs", "engine requests in flight (n > 1 counts n)"),
                       ("--max-num-queued-tokens", "prompt tokens of requests still in prefill")):
        p.add_argument(flag, type=human_readable_int, default=None, metavar="N",
                       help=f"at most N {what}; more are refused with 503, as vLLM (default: no limit)")


def check_admission_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        value = getattr(a, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (unset: no limit), got {value}")


class RejectionsCollector:
    """The frontend's own vllm:admission_rejections family, shown when the scheduler's
    page has none (else `merge_rejections` adds these counts to its lines)."""

    def __init__(self, admission: AdmissionControl, model_name: str):
        self.admission, self.model_name = admission, model_name

    def collect(self):
        family = CounterMetricFamily(REJECTIONS, "Number of admission attempts rejected by a queue limit, by reason.",
                                     labels=["model_name", "reason"])
        for reason, count in self.admission.rejections.items():
            family.add_metric([self.model_name, reason], count)
        yield family


_SAMPLE = re.compile(rb'^(vllm:admission_rejections_total\{[^}\n]*reason="([a-z_]+)"[^}\n]*\}) (\S+)$', re.MULTILINE)


def merge_rejections(scheduler_page: bytes, rejections: dict[str, int]) -> bytes:
    """The scheduler's page with the frontend's rejections added into its
    vllm:admission_rejections_total samples, reason by reason: one family on the
    merged page, the two processes' totals summed (the scheduler counts its own
    --max-num-waiting refusals as max_num_queued_reqs)."""
    if not any(rejections.values()):
        return scheduler_page

    def add(m: re.Match) -> bytes:
        extra = rejections.get(m.group(2).decode(), 0)
        return m.group(0) if not extra else m.group(1) + b" " + repr(float(m.group(3)) + extra).encode()

    return _SAMPLE.sub(add, scheduler_page)
