"""The frontend's Prometheus metrics, named as a vLLM API server names them, and the
merged ``/metrics`` page: the scheduler's metrics (fetched) followed by these.

* ``vllm:request_success_total{finished_reason}``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_params_n``,
  ``vllm:request_params_max_tokens`` (labels ``model_name``, ``engine``), counted
  per engine request as it finishes, as vLLM's engine counts them.
* ``http_requests_total{handler,method,status}`` and
  ``http_request_duration_seconds{handler,method}``, as vLLM's
  prometheus-fastapi-instrumentator exports them (status grouped: ``2xx``).
* ``kvpool_frontend_engine_requests_in_flight``: engine requests this frontend has
  open on the scheduler (0 when idle: nothing leaked).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's build_1_2_5_buckets up to 10^6 tokens, and its request-size buckets.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
N_BUCKETS = (1, 2, 5, 10, 20)
HTTP_BUCKETS = (0.1, 0.5, 1.0)


class FrontendMetrics:
    def __init__(self, model_name: str, engine: str = "0", in_flight=lambda: 0):
        self.registry = r = CollectorRegistry()
        labels, values = ["model_name", "engine"], (model_name, engine)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)  # fmt: skip
        self._values = values
        for reason in ("stop", "length", "abort"):
            self._success.labels(*values, reason)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                                       buckets=TOKEN_BUCKETS, registry=r).labels(*values)  # fmt: skip
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           labels, buckets=TOKEN_BUCKETS, registry=r).labels(*values)  # fmt: skip
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                  buckets=N_BUCKETS, registry=r).labels(*values)  # fmt: skip
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                           labels, buckets=TOKEN_BUCKETS, registry=r).labels(*values)  # fmt: skip
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=r)  # fmt: skip
        Gauge("kvpool_frontend_engine_requests_in_flight", "Engine requests open on the scheduler.",
              registry=r).set_function(in_flight)  # fmt: skip
        self.http_duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                                       ["method", "handler"], buckets=HTTP_BUCKETS, registry=r)  # fmt: skip

    def request_started(self, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def request_finished(self, finish_reason: str | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if finish_reason in ("stop", "length", "abort"):
            self._success.labels(*self._values, finish_reason).inc()
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generation_tokens)

    def http_request(self, method: str, handler: str, status: int, seconds: float) -> None:
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


def family_names(text: bytes) -> set[str]:
    """The metric names of an exposition page's ``# TYPE`` lines."""
    return {line.split()[2] for line in text.decode("utf-8", "replace").splitlines() if line.startswith("# TYPE ")}
