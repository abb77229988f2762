"""The fleet simulator's routing policies (simulator/routers.py) on hand-made cases,
each expected decision reasoned from vllm-router's source (src/policies/*.rs,
src/tree.rs) and its defaults (`vllm-router --help`); kv_aware's from the decisions
the 0.1.17 binary made (tests/e2e/test_router_kv_aware_cost.py runs it)."""

from __future__ import annotations

import pytest

from scheduler.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from simulator.routers import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CACHE_THRESHOLD,
    ApproxTree,
    CacheAware,
    KvAware,
    make_router,
)


def tokens(text: str) -> tuple[list[str], None]:
    return list(text), None


def test_the_defaults_are_vllm_routers():
    assert (CACHE_THRESHOLD, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD) == (0.3, 64, 1.5)


def test_round_robin_goes_through_the_replicas_in_order_whatever_the_loads():
    rr = make_router("round_robin", 3)
    picks = [rr.route([9, 0, 5], tokens("x"), [], 0) for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_first_of_the_smallest_loads():
    ll = make_router("least_loaded", 4)
    assert ll.route([3, 1, 1, 2], tokens("x"), [], 0) == 1
    assert ll.route([0, 0, 0, 0], tokens("x"), [], 0) == 0


def test_power_of_two_never_takes_the_busier_of_its_two():
    p2 = make_router("power_of_two", 2, seed=3)
    # NOTE: with two replicas both are always drawn, so the less loaded one wins.
    assert {p2.route([5, 2], tokens("x"), [], 0) for _ in range(20)} == {1}
    p4 = make_router("power_of_two", 4, seed=3)
    picks = [p4.route([9, 1, 1, 1], tokens("x"), [], 0) for _ in range(200)]
    assert 0 not in picks  # the busiest loses every pair it is drawn into


def test_tree_match_goes_down_any_tenant_and_names_the_node_creator():
    tree = ApproxTree()
    tree.insert(list("hello world"), None, 0)
    tree.insert(list("hello there"), None, 1)  # splits "hello " off: it keeps replica 0
    assert tree.match(list("hello world!"), None) == (11, 0)
    assert tree.match(list("hello th"), None) == (8, 1)  # ended inside 1's node
    assert tree.match(list("hello"), None) == (5, 0)  # the split node kept 0
    assert tree.match(list("xyz"), None) == (0, None)
    assert tree.tenant_size == {0: 11, 1: 11}  # every character a tenant holds, shared or not


def test_tree_weights_count_what_a_unit_stands_for():
    tree = ApproxTree()
    tree.insert(["a", "b"], [512, 512], 2)
    assert tree.match(["a", "b", "c"], [512, 512, 100]) == (1024, 2)


def test_cache_aware_follows_a_match_above_the_threshold_else_the_least_loaded():
    ca = CacheAware(2)
    assert ca.route([0, 0], tokens("abcdefghij"), [], 0) == 0  # no match: min load, first
    # 4 of 10 characters match replica 0's prompt: 0.4 > 0.3
    assert ca.route([0, 0], tokens("abcdxxxxxx"), [], 0) == 0
    # 3 of 10: 0.3 is not above the threshold, so the least loaded (replica 1)
    assert ca.route([1, 0], tokens("abcyyyyyyy"), [], 0) == 1
    assert ca.decisions == {"load_balance": 0, "cache_affinity": 1, "low_match_min_load": 2}
    # the request was inserted for replica 1: its own prefix now leads there
    assert ca.route([5, 0], tokens("abcyyyyyyy"), [], 0) == 1


@pytest.mark.parametrize(
    "loads, imbalanced",
    [
        ([0, 64], False),  # difference 64 is not above 64
        ([0, 65], True),  # 65 > 64 and 65 > 0 x 1.5
        ([100, 165], True),  # 65 > 64 and 165 > 150
        ([130, 195], False),  # 65 > 64 but 195 is not above 130 x 1.5
        ([130, 196], True),
    ],
)
def test_cache_aware_balance_needs_both_thresholds(loads: list[int], imbalanced: bool):
    ca = CacheAware(2)
    ca.route([0, 0], tokens("the shared prompt"), [], 0)  # replica 0 holds it
    busy = loads[::-1]  # replica 0 the busier one
    pick = ca.route(busy, tokens("the shared prompt"), [], 0)
    assert ca.is_imbalanced(busy) is imbalanced
    assert pick == (1 if imbalanced else 0)


def stored(*hashes: bytes) -> list:
    return [BlockStored(list(hashes), None, None, 16)]


def test_kv_aware_credits_the_contiguous_prefix_each_replica_holds():
    kv = KvAware(3, block_size=16)
    kv.index.apply(0, stored(b"A", b"B", b"D"))  # a gap at C: 2 blocks
    kv.index.apply(1, stored(b"A", b"B", b"C"))
    kv.index.apply(2, stored(b"B", b"C", b"D"))  # no first block: nothing
    assert kv.index.prefix_scores([b"A", b"B", b"C", b"D"]) == {0: 2, 1: 3}
    idle = [0, 0, 0]
    # 64 tokens: replica 1 would prefill 16, replica 0 32, replica 2 all 64
    assert kv.costs(64, [b"A", b"B", b"C", b"D"], idle, idle) == [(32, 32), (16, 16), (64, 64)]
    assert kv.choose(64, [b"A", b"B", b"C", b"D"], idle, idle) == (1, 16)
    kv.index.apply(1, [BlockRemoved([b"C"])])
    assert kv.choose(64, [b"A", b"B", b"C", b"D"], idle, idle) == (0, 32)  # 0 and 1 tie at 32: the first
    kv.index.apply(0, [AllBlocksCleared()])
    assert kv.choose(64, [b"A", b"B", b"C", b"D"], idle, idle) == (1, 32)
    kv.index.apply(2, [BlockStored([b"P"], None, None, 16, "CPU")])  # host-tier events are not device blocks
    assert b"P" not in kv.index.held


def test_kv_aware_weighs_the_tokens_to_prefill_by_the_requests_in_flight():
    """The thresholds measured against vllm-router 0.1.17 (docs/architecture.md, "KV-aware
    routing"): one request in flight on replica 0, still prefilling 64 tokens; the request
    has 16 tokens past the blocks replica 0 holds. Replica 0 costs (16 + 64) x 2 = 160,
    replica 1 (idle, holding nothing) 16 x (k + 1) for k held blocks: the router went to
    replica 1 up to k = 8 (144) and to replica 0 from k = 10 (176)."""
    for k, expected in ((8, (1, 144)), (10, (0, 16))):
        kv = KvAware(2, block_size=16)
        prefix = [bytes([i]) for i in range(k)]
        kv.index.apply(0, stored(*prefix))
        assert kv.choose(16 * (k + 1), [*prefix, b"tail"], [1, 0], [64, 0]) == expected
    # the in-flight count multiplies: two requests in flight on 0 prefilling 16 each,
    # 8 blocks held and 2 more to prefill: (32 + 32) x 3 = 192 > 160 on the idle one
    kv = KvAware(2, block_size=16)
    prefix = [bytes([i]) for i in range(8)]
    kv.index.apply(0, stored(*prefix))
    assert kv.choose(160, [*prefix, b"x", b"y"], [2, 0], [32, 0]) == (1, 160)
    assert kv.choose(160, [*prefix, b"x", b"y"], [1, 0], [16, 0]) == (0, 32)  # (32 + 16) x 2 = 96


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random", 2)
