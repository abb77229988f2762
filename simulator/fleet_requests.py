"""A fleet's requests outside its engines (simulator/fleet.py, simulator/pd_fleet.py): the
times of their paths (`RequestPaths`, ``--request-path-ms``), each prompt built once for
the router and the replica that admits it (`PreparedWorkload`), and what cache_aware's
tree matches (`routing_units`)."""

from __future__ import annotations

import dataclasses
import random

from loadgen.datasets import MOONCAKE_BLOCK_TOKENS
from simulator.workload import TraceWorkload, Workload


@dataclasses.dataclass(frozen=True)
class RequestPaths:
    """A request's times outside the engines, in ns: from its send to the router's
    decision (``decide``: the router's own work first, kv_aware's render call), from
    the decision to the engine (``there``), and from the engine's last token (or first,
    streamed) back to the router and the client (``back``). With ``jitter`` j each
    request's three are drawn apart, each uniform within (1 - j, 1 + j) x its mean,
    from ``seed``: live, no two requests take the same time."""

    decide_ns: int = 0
    there_ns: int = 0
    back_ns: int = 0
    jitter: float = 0.0
    seed: int = 0

    @classmethod
    def from_ms(cls, decide: float, there: float, back: float, jitter: float = 0.0, seed: int = 0) -> RequestPaths:
        return cls(*(round(ms * 1e6) for ms in (decide, there, back)), jitter, seed)

    def draw(self, n: int) -> list[tuple[int, int, int]]:
        """Request i's (decide, there, back) ns, for i < n."""
        means = (self.decide_ns, self.there_ns, self.back_ns)
        if not self.jitter:
            return [means] * n
        rng, j = random.Random(self.seed), self.jitter
        return [tuple(round(m * rng.uniform(1 - j, 1 + j)) for m in means) for _ in range(n)]  # type: ignore[misc]


def routing_units(workload: Workload, index: int, prompt: list[int]) -> tuple[list, list[int] | None]:
    """What cache_aware's tree matches for request ``index``: the prompt's tokens
    (weight 1 each, for the router's characters); for a trace, its 512-token blocks
    (chain nodes: equal node, equal prefix), weighted by the tokens each covers."""
    if isinstance(workload, TraceWorkload):
        chain = workload.nodes[index]
        n = workload.specs[index].prompt_len
        weights = [MOONCAKE_BLOCK_TOKENS] * len(chain)
        if chain and n % MOONCAKE_BLOCK_TOKENS:
            weights[-1] = n % MOONCAKE_BLOCK_TOKENS
        return chain, weights
    return prompt, None


class PreparedWorkload(Workload):
    """The workload as the replicas read it: each prompt built once, when the router
    first needs it, and handed to the replica that admits it."""

    def __init__(self, inner: Workload):
        self.inner = inner
        self.specs = list(inner.specs)  # arrival times rewritten when sent (closed loop)
        self.output_token_base = inner.output_token_base
        self.ready: dict[int, tuple[list[int], list]] = {}

    def build(self, index: int, hasher) -> tuple[list[int], list]:
        prompt, hashes = self.inner.prompt(index, hasher)
        if hashes is None:
            hashes = hasher.block_hashes(prompt)
        self.ready[index] = (prompt, hashes)
        return prompt, hashes

    def prompt(self, index: int, hasher):
        return self.ready.pop(index)
