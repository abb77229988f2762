"""The frontend's Prometheus metrics, named as a vLLM API server names them, and the
merged ``/metrics`` page: the scheduler's metrics (fetched) followed by these.

* ``vllm:request_success_total{finished_reason}``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_params_max_tokens`` (labels
  ``model_name``, ``engine``), counted per engine request as it finishes, and
  ``vllm:request_params_n``, ``vllm:request_max_num_generation_tokens`` per prompt
  once its n engine requests all finished (vLLM's ParentRequest), as vLLM's output
  processor counts them (`ChoiceGroups`); an engine request that never finishes
  (client gone, engine error) is not counted, as in vLLM.
* ``http_requests_total{handler,method,status}`` and
  ``http_request_duration_seconds{handler,method}``, as vLLM's
  prometheus-fastapi-instrumentator exports them (status grouped: ``2xx``; /metrics, /health,
  /load, /ping, /version, /server_info left out as vLLM leaves them out).
* ``kvpool_frontend_engine_requests_in_flight``: engine requests this frontend has
  open on the scheduler (0 when idle: nothing leaked).
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's request_params_n bucket family (vllm/v1/metrics/buckets.py).
N_BUCKETS = (1, 2, 5, 10, 20)
HTTP_BUCKETS = (0.1, 0.5, 1.0)
# NOTE: vLLM's Instrumentator(excluded_handlers=...), matched as it matches them: a regex
# searched in the route's path, so "/health" leaves out /health_generate too.
EXCLUDED_HANDLERS = tuple(re.compile(p) for p in ("/metrics", "/health", "/load", "/ping", "/version", "/server_info"))
# vLLM's FinishReason strings, every one exported from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``request_tokens`` family: build_1_2_5_buckets(max_model_len)."""
    return tuple(m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5) if m * 10**e <= max_model_len)


class FrontendMetrics:
    def __init__(self, model_name: str, engine: str = "0", in_flight=lambda: 0, max_model_len: int = 4096):
        self.registry = r = CollectorRegistry()
        labels, values = ["model_name", "engine"], (model_name, engine)
        tokens = request_tokens_buckets(max_model_len)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        self._values = values
        for reason in FINISH_REASONS:
            self._success.labels(*values, reason)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", tokens
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=r)
        Gauge("kvpool_frontend_engine_requests_in_flight", "Engine requests open on the scheduler.",
              registry=r).set_function(in_flight)
        self.http_duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                                       ["method", "handler"], buckets=HTTP_BUCKETS, registry=r)

    def request_finished(self, finish_reason: str | None, num_prompt_tokens: int, num_generation_tokens: int, max_tokens: int) -> None:
        """One engine request finished (vLLM's FinishedRequestStats)."""
        if finish_reason in FINISH_REASONS:
            self._success.labels(*self._values, finish_reason).inc()
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generation_tokens)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)

    def parent_finished(self, n: int, max_num_generation_tokens: int) -> None:
        """The n engine requests of one prompt all finished (vLLM's ParentRequest)."""
        self.params_n.observe(n)
        self.max_num_generation_tokens.observe(max_num_generation_tokens)

    def http_request(self, method: str, handler: str, status: int, seconds: float) -> None:
        if any(pattern.search(handler) for pattern in EXCLUDED_HANDLERS):
            return
        self.http_requests.labels(method, f"{status // 100}xx", handler).inc()
        self.http_duration.labels(method, handler).observe(seconds)

    def render(self, skip: set[str] = frozenset()) -> bytes:
        """The exposition text, less the families named in ``skip`` (already on the
        scheduler's page: a name must appear once)."""
        return generate_latest(_Without(self.registry, skip))


class _Without:
    def __init__(self, registry: CollectorRegistry, skip: set[str]):
        self.registry, self.skip = registry, skip

    def collect(self):
        for family in self.registry.collect():
            if family.name not in self.skip and family.name + "_total" not in self.skip:
                yield family


class ChoiceGroups:
    """The engine requests of one API request, ``n`` per prompt (choice ``i`` is prompt
    ``i // n``'s): each is recorded as it finishes, and each prompt once all its n are."""

    def __init__(self, metrics: FrontendMetrics, n: int, num_prompts: int, max_tokens: int):
        self.metrics, self.n, self.max_tokens = metrics, n, max_tokens
        self._remaining = [n] * num_prompts
        self._longest = [0] * num_prompts

    def finished(self, index: int, finish_reason: str | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Choice ``index`` finished (called once per choice)."""
        self.metrics.request_finished(finish_reason, num_prompt_tokens, num_generation_tokens, self.max_tokens)
        p = index // self.n
        self._longest[p] = max(self._longest[p], num_generation_tokens)
        self._remaining[p] -= 1
        if self._remaining[p] == 0:
            self.metrics.parent_finished(self.n, self._longest[p])


def family_names(text: bytes) -> set[str]:
    """The metric names of an exposition page's ``# TYPE`` lines."""
    return {line.split()[2] for line in text.decode("utf-8", "replace").splitlines() if line.startswith("# TYPE ")}
