"""vllm-router's routing policies, as the fleet simulator (simulator/fleet.py) runs them.

Each policy sees what the router sees when a request comes: the replicas' loads
(requests the router sent them that have not finished: vllm-router's ``worker.load()``),
the request's routing key and, for ``kv_aware``, an index the replicas' own KV events
fill. Decisions follow vllm-router's source (src/policies/*.rs, src/tree.rs), with
its defaults (``vllm-router --help``, 0.1.17):

* ``round_robin``: a counter over the replicas, in order.
* ``least_loaded``: the replica with the fewest requests in flight, the first on a tie
  (vllm-router's min-load fallback; with two replicas its ``power_of_two`` picks the
  same, except that it breaks a tie at random).
* ``power_of_two``: two distinct replicas drawn at random (seeded), the less loaded
  one, the first drawn on a tie.
* ``cache_aware``: when the loads are imbalanced (max - min > ``balance_abs_threshold``
  and max > min x ``balance_rel_threshold``), the least loaded; else the approximate
  tree (`ApproxTree`): a prefix match longer than ``cache_threshold`` of the request
  goes to the tenant of the node the match ended in, else the least loaded. Either
  way the request is inserted for the chosen replica.
* ``kv_aware``: 0.1.17's cost, measured against the binary (its source is not
  published): the tokens a replica would prefill (the request's, less the leading
  blocks the replica's KV events say it holds, plus those of its requests still
  prefilling), times one more than its requests in flight; the cheapest wins
  (`KvAware`).

Routing keys: the router matches characters of the prompt; the simulator matches
units of the prompt that stand for its characters (tokens, or whole trace blocks)
with their weight (simulator/fleet_requests.py `routing_units`).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE
from protocol.kv_events import MEDIUM_GPU
from scheduler.core import kv_events

ROUTERS = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "kv_aware")

# vllm-router 0.1.17's defaults (`vllm-router --help`).
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def least_loaded(loads: Sequence[int]) -> int:
    """The first replica of the smallest load (Rust's ``min_by_key``)."""
    return min(range(len(loads)), key=loads.__getitem__)


class RoundRobin:
    name = "round_robin"

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.counter = 0

    def route(self, loads: Sequence[int], units, block_hashes, now_ns: int) -> int:
        choice = self.counter % self.num_replicas
        self.counter += 1
        return choice


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas

    def route(self, loads: Sequence[int], units, block_hashes, now_ns: int) -> int:
        return least_loaded(loads)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, num_replicas: int, seed: int = 0):
        self.num_replicas = num_replicas
        self.rng = random.Random(seed)

    def route(self, loads: Sequence[int], units, block_hashes, now_ns: int) -> int:
        if self.num_replicas == 1:
            return 0
        a, b = self.rng.sample(range(self.num_replicas), 2)
        return a if loads[a] <= loads[b] else b


class _Node:
    __slots__ = ("children", "tenants", "last_tenant")

    def __init__(self, last_tenant: int | None):
        self.children: dict[Hashable, _Node] = {}
        self.tenants: set[int] = set()
        self.last_tenant = last_tenant


class ApproxTree:
    """vllm-router's multi-tenant radix tree (src/tree.rs) with one node per unit.

    NOTE: equivalent for matching: the router's node text is split only where two
    insertions diverge, a split copies the node's cached tenant (``last_tenant``, set
    once, by the insertion that created the node), and a match that ends inside a node
    takes that node's tenant -- so every unit's node here has the tenant the router's
    node holding that character has. The router's periodic size-bound eviction
    (``--max-tree-size`` 33,554,432 characters a replica, every 120 s) is not
    modelled: `tenant_size` says how far a run came to it."""

    def __init__(self):
        self.root = _Node(None)
        self.tenant_size: dict[int, int] = {}

    def match(self, units: Sequence[Hashable], weights: Sequence[int] | None) -> tuple[int, int | None]:
        """(matched weight, the tenant of the node the match ended in; None: no match)."""
        node, matched = self.root, 0
        for i, u in enumerate(units):
            child = node.children.get(u)
            if child is None:
                break
            node = child
            matched += 1 if weights is None else weights[i]
        if node is self.root:
            return 0, None
        tenant = node.last_tenant if node.last_tenant in node.tenants else min(node.tenants)
        return matched, tenant

    def insert(self, units: Sequence[Hashable], weights: Sequence[int] | None, tenant: int) -> None:
        node = self.root
        size = self.tenant_size.get(tenant, 0)
        for i, u in enumerate(units):
            child = node.children.get(u)
            if child is None:
                child = node.children[u] = _Node(tenant)
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                size += 1 if weights is None else weights[i]
            node = child
        self.tenant_size[tenant] = size


class CacheAware:
    name = "cache_aware"

    def __init__(self, num_replicas: int, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD, balance_rel_threshold: float = BALANCE_REL_THRESHOLD):
        self.num_replicas = num_replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproxTree()
        self.decisions = {"load_balance": 0, "cache_affinity": 0, "low_match_min_load": 0}

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def route(self, loads: Sequence[int], units, block_hashes, now_ns: int) -> int:
        keys, weights = units
        if self.is_imbalanced(loads):
            choice, decision = least_loaded(loads), "load_balance"
        else:
            total = len(keys) if weights is None else sum(weights)
            matched, tenant = self.tree.match(keys, weights)
            rate = matched / total if total else 0.0
            if rate > self.cache_threshold and tenant is not None:
                choice, decision = tenant, "cache_affinity"
            else:
                choice, decision = least_loaded(loads), "low_match_min_load"
        self.decisions[decision] += 1
        if keys:
            self.tree.insert(keys, weights, choice)
        return choice


class KVBlockIndex:
    """Which replica holds which block hash, from the replicas' device-pool events
    (BlockStored / BlockRemoved / AllBlocksCleared; host-tier events are not held)."""

    def __init__(self):
        self.held: dict[bytes, set[int]] = {}

    def apply(self, replica: int, events: Sequence[kv_events.KVCacheEvent]) -> None:
        held = self.held
        for ev in events:
            if isinstance(ev, kv_events.BlockStored):
                if ev.medium == MEDIUM_GPU:
                    for h in ev.block_hashes:
                        held.setdefault(h, set()).add(replica)
            elif isinstance(ev, kv_events.BlockRemoved):
                if ev.medium == MEDIUM_GPU:
                    for h in ev.block_hashes:
                        owners = held.get(h)
                        if owners is not None:
                            owners.discard(replica)
                            if not owners:
                                del held[h]
            else:  # AllBlocksCleared
                for h in [h for h, owners in held.items() if replica in owners]:
                    self.apply(replica, [kv_events.BlockRemoved([h])])

    def prefix_scores(self, block_hashes: Sequence[bytes]) -> dict[int, int]:
        """Each replica's count of contiguously held leading blocks."""
        scores: dict[int, int] = {}
        active: set[int] | None = None
        for i, h in enumerate(block_hashes):
            owners = self.held.get(h, set())
            active = set(owners) if active is None else active & owners
            if not active:
                break
            for r in active:
                scores[r] = i + 1
        return scores


class KvAware:
    """vllm-router 0.1.17's ``kv_aware`` at its defaults (temperature 0, no session
    affinity), as measured against the binary (docs/architecture.md, "KV-aware routing"):

    * a replica is credited the leading blocks of the request it holds (its events;
      the router guesses nothing for the replica it picks);
    * its cost is ``(tokens it would prefill + the prefill tokens of its requests still
      prefilling) x (1 + its requests in flight)``; the cheapest wins, a tie the first
      (the router's own worker order, a hash map's: here, replica order);
    * a request counts as prefilling from its routing until its first streamed token,
      or until it finishes when it is not streamed; the tokens it counts are the ones
      it would prefill on the replica it went to.

    `choose` returns the replica and those tokens; the fleet (simulator/fleet.py)
    keeps each replica's prefilling tokens."""

    name = "kv_aware"

    def __init__(self, num_replicas: int, block_size: int):
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.index = KVBlockIndex()

    def costs(self, prompt_len: int, block_hashes: Sequence[bytes], loads: Sequence[int],
              prefilling: Sequence[int]) -> list[tuple[int, int]]:
        """Each replica's (cost, tokens it would prefill)."""
        scores = self.index.prefix_scores(block_hashes)
        out = []
        for r in range(self.num_replicas):
            new_tokens = prompt_len - min(prompt_len, scores.get(r, 0) * self.block_size)
            out.append(((new_tokens + prefilling[r]) * (1 + loads[r]), new_tokens))
        return out

    def choose(self, prompt_len: int, block_hashes: Sequence[bytes], loads: Sequence[int],
               prefilling: Sequence[int]) -> tuple[int, int]:
        costs = self.costs(prompt_len, block_hashes, loads, prefilling)
        best = min(range(self.num_replicas), key=lambda r: costs[r][0])  # the first of the cheapest
        return best, costs[best][1]


def make_router(name: str, num_replicas: int, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE):
    """A fresh policy by name (one of ROUTERS); ``block_size`` is kv_aware's
    (``--kv-event-block-size``: the replicas' block size)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    if name == "power_of_two":
        return PowerOfTwo(num_replicas, seed)
    if name == "kv_aware":
        return KvAware(num_replicas, block_size)
    return {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}[name](num_replicas)
