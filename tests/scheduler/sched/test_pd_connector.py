"""P/D disaggregation in the schedulers (scheduler/sched/pd_connector.py, external_wait.py),
with two real Schedulers and KVCacheManagers, a prefill engine and a decode engine.

Each has a FakeWorker (tests/kvtest/fake_worker.py: every slot a row reads must hold that
row's own prefix). The transfer is modelled on the workers' contract: a lend lets its
blocks be read; a pull copies the prefill worker's slots of the lent blocks into the
decode worker's blocks (refused, 0 blocks, when not lent); a read ends the lend. So a
pull into the wrong blocks, of the wrong blocks, or a decode engine that computes what it
was given again, is caught by the reads. Block size 4; the prompt is 14 tokens.

NOTE: the fake pull leaves out the prompt's last token: the decode engine computes it
again (vLLM's rule, to sample the next token), and the fake worker refuses a slot written
twice; the real worker writes the same K/V over it."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import FakeWorker, fake_sample

from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.kv_transfer_params import KVTransferParams, parse_kv_transfer_params
from protocol.worker_messages import StepPlan
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.pd_connector import PDConnector
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS, MAX_LEN, VOCAB = 4, 24, 64, 512
HASHER = BlockHasher(BS)
PROMPT = list(range(2, 16))  # 14 tokens: 3 full blocks and 2 tokens
STEP_BOUND = 100
ADDRESS = "127.0.0.1:7001"


def config(role: str, **extra) -> str:
    import json

    return json.dumps({"kv_connector": "KVPoolConnector", "kv_role": role, "engine_id": f"e-{role}",
                       "kv_load_failure_policy": extra.pop("policy", "recompute"), "kv_connector_extra_config": extra})


class Engine:
    def __init__(self, role: str, num_blocks: int = NUM_BLOCKS, **extra):
        self.kv = KVCacheManager(num_blocks, BS, MAX_LEN)
        self.pd = PDConnector(parse_kv_transfer_config(config(role, **extra)), BS)
        self.pd.attach(ADDRESS if self.pd.config.is_producer else "")
        self.s = Scheduler(self.kv, 4, 64, MAX_LEN, kv_transfer=self.pd)
        self.w = FakeWorker(num_blocks, BS, VOCAB)
        self.lent: dict[str, list[list[int]]] = {}  # the worker's lends, one list per KV-cache group
        self.pulled: dict[int, int] = {}
        self.sent: list[str] = []
        self.plans: list[StepPlan] = []
        self.answers: dict[str, dict] = {}
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, seq_id: int, prompt=PROMPT, max_tokens: int = 3, params: KVTransferParams | None = None) -> Request:
        r = Request(rid, prompt, max_tokens, seq_id=seq_id, ignore_eos=True, block_hasher=HASHER)
        r.kv_transfer_params = params
        self.s.add_request(r)
        return r

    def step(self, peer: Engine | None = None):
        out = self.s.schedule()
        self.kv.check_invariants()
        if out is None:
            return None
        self.plans.append(out.plan)
        ops = out.plan.kv_transfer
        if ops is not None:
            # The worker: take-backs and lends before the forward; pulls beside it.
            for rid in ops.unlend_ids:
                self.lent.pop(rid, None)
            self.lent.update(zip(ops.lend_ids, ops.lend_block_ids, strict=True))
            for pull in zip(ops.pull_ids, ops.pull_request_ids, ops.pull_remote_block_ids, ops.pull_block_ids, strict=True):
                self._pull(peer, *pull)
        self.s.update_from_output(self.w.execute(out.plan))
        for r in out.scheduled:
            if r.status.is_finished:
                self.outputs[r.request_id] = r.all_token_ids[r.num_prompt_tokens :]
                if r.kv_transfer_answer is not None:
                    self.answers[r.request_id] = r.kv_transfer_answer
        self.kv.check_invariants()
        return out

    def _pull(self, peer: Engine | None, pull_id: int, rid: str, remote_groups: list[list[int]], local: list[int]) -> None:
        request = self.s.loading[pull_id]
        (remote,) = remote_groups  # one KV-cache group
        if peer is None or rid not in peer.lent or not set(remote) <= set(peer.lent[rid][0]):
            self.pulled[pull_id] = 0
            return
        last = request.num_prompt_tokens - 1  # computed again here (module docstring)
        for i, (src, dst) in enumerate(zip(remote, local, strict=True)):
            for off in range(BS):
                pos = (request.external_load[0] // BS + i) * BS + off
                key = peer.w.slots.get((src, off))
                if key is not None and pos < last:
                    self.w.slots[(dst, off)] = key
        del peer.lent[rid]
        peer.sent.append(rid)
        self.pulled[pull_id] = len(local)

    def deliver(self, peer: Engine | None = None) -> tuple[int, list[str]]:
        """The worker's KVTransferDone, as WorkerSide applies it."""
        pulled, self.pulled = self.pulled, {}
        sent, self.sent = self.sent, []
        back, failed = self.s.kv_pulls_done(pulled)
        self.s.lends_read(sent)
        self.kv.check_invariants()
        return back, failed

    def drain(self, peer: Engine | None = None) -> None:
        for _ in range(STEP_BOUND):
            if not self.s.has_unfinished_requests():
                return
            self.step(peer)
            self.deliver()
        raise AssertionError(f"not done in {STEP_BOUND} steps")


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_sample(tokens, VOCAB))
    return tokens[len(prompt) :]


def free(e: Engine) -> int:
    return e.kv.block_pool.get_num_free_blocks()


def prefill(p: Engine, rid: str = "r", prompt=PROMPT) -> dict:
    """The router's prefill leg: max_tokens 1, do_remote_decode; the answer's params."""
    p.add(rid, len(p.plans) + 100, prompt, max_tokens=1, params=parse_kv_transfer_params({"do_remote_decode": True}))
    p.drain()
    return p.answers[rid]


def test_prefill_engine_lends_its_blocks_and_answers_where_they_are():
    p = Engine("kv_producer")
    before = free(p)
    answer = prefill(p)
    # Its blocks stay held, one more owner (not freed with the request) ...
    assert free(p) == before - 4
    assert p.pd.lent.keys() == {"r"}
    # ... and the answer names them, the worker's side channel and the tokens they hold.
    table = p.kv.get_block_ids("r")[0]
    assert answer["remote_block_ids"] == [table] and len(table) == 4  # one list per KV-cache group
    assert (answer["remote_host"], answer["remote_port"]) == ("127.0.0.1", 7001)
    assert answer["do_remote_prefill"] is True and answer["remote_num_tokens"] == len(PROMPT)
    assert answer["remote_engine_id"] == "e-kv_producer" and answer["remote_request_id"] == "r"
    # The lend goes to the worker in a plan of its own (nothing else to run).
    p.step()
    assert p.lent == {"r": [table]}
    # A read frees them; the full blocks stay cached.
    assert p.s.lends_read(["r"]) == 1 and free(p) == before
    assert p.kv.block_pool.get_cached_block(HASHER.block_hashes(PROMPT)[2]) is not None


def test_decode_engine_pulls_the_prompt_and_computes_only_its_last_token():
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    params = parse_kv_transfer_params(prefill(p))
    p.step()  # the lend reaches the prefill worker
    r = d.add("r", 1, max_tokens=4, params=params)
    out = d.step(p)
    # Parked: nothing scheduled, its blocks allocated and pulled by this plan.
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.scheduled == []
    ops = out.plan.kv_transfer
    assert ops.pull_addresses == [ADDRESS] and ops.pull_request_ids == ["r"]
    assert ops.pull_remote_block_ids == [params.remote_block_ids] and ops.pull_block_ids == [d.kv.get_block_ids("r")[0]]
    assert d.deliver() == (1, [])
    assert r.num_computed_tokens == len(PROMPT) - 1
    written = d.w.num_tokens_written
    d.drain(p)
    # One prompt token computed (the last), then the decode: the reads check every slot's prefix.
    assert d.outputs["r"] == expected_output(PROMPT, 4)
    assert d.w.num_tokens_written - written == 1 + 3
    # The prefill engine's blocks were read: freed there.
    p.deliver()
    assert p.pd.lent == {} and free(p) == NUM_BLOCKS - 1
    # vLLM's counts: a query of 14 tokens, 14 from outside (the connector's), none on the device.
    assert d.kv.prefix_cache_stats.hits == 0 and d.kv.external_prefix_cache_stats.hits == len(PROMPT)
    assert d.pd.num_pull_tokens == len(PROMPT)
    # vLLM's prompt tokens by source: all loaded (the last, computed again, counts as loaded), none computed.
    stats = d.s.prompt_token_stats
    assert (stats.external_kv_transfer, stats.local_cache_hit, stats.computed) == (len(PROMPT), 0, 0)


def test_pulled_blocks_are_cached_hits_for_later_requests():
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    params = parse_kv_transfer_params(prefill(p))
    p.step()
    d.add("r", 1, params=params)
    d.drain(p)
    d.add("again", 2, max_tokens=2)
    out = d.step()
    # The 3 full blocks pulled are hits now (the last token is computed, as for any hit).
    assert out.plan.new_rows[0].num_computed_tokens == 12
    d.drain()
    assert d.outputs["again"] == expected_output(PROMPT, 2)


def test_local_hits_shrink_the_pull():
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.add("warm", 1, PROMPT[:8] + [99, 98, 97, 96], max_tokens=1)  # caches PROMPT's first 2 blocks
    d.drain()
    params = parse_kv_transfer_params(prefill(p))
    p.step()
    d.add("r", 2, params=params)
    out = d.step(p)
    # Blocks 0 and 1 are the decode engine's own hits: only the prefill engine's blocks 2 and 3 are read.
    assert out.plan.kv_transfer.pull_remote_block_ids == [[params.remote_block_ids[0][2:]]]
    d.deliver()
    d.drain(p)
    assert d.outputs["r"] == expected_output(PROMPT, 3)
    # Its prompt by source: 8 tokens the device's own, 6 read (the warm-up request computed its 12).
    stats = d.s.prompt_token_stats
    assert (stats.local_cache_hit, stats.external_kv_transfer, stats.computed) == (8, 6, 12)


def test_a_refused_pull_is_computed_again_under_recompute():
    d = Engine("kv_consumer")
    params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "gone",
                                       "remote_host": "127.0.0.1", "remote_port": 7001, "remote_block_ids": [5, 6, 7, 8]})
    r = d.add("r", 1, params=params)
    d.step(None)  # no prefill engine answers: 0 blocks
    assert d.deliver() == (1, [])
    assert r.num_computed_tokens == 0 and r.kv_transfer_params is None  # never pulled again
    d.drain()
    assert d.outputs["r"] == expected_output(PROMPT, 3)
    assert d.pd.num_pull_failed_blocks == 4


def test_a_refused_pull_fails_the_request_under_fail():
    d = Engine("kv_consumer", policy="fail")
    params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "gone",
                                       "remote_host": "127.0.0.1", "remote_port": 7001, "remote_block_ids": [5, 6, 7, 8]})
    d.add("r", 1, params=params)
    d.step(None)
    assert d.deliver() == (0, ["r"])
    (ended,) = d.s.finish_requests(["r"], RequestStatus.FINISHED_ERROR)
    assert ended.status == RequestStatus.FINISHED_ERROR and free(d) == NUM_BLOCKS - 1


def test_a_lend_nobody_reads_is_taken_back_after_its_lease():
    p = Engine("kv_producer", kv_lease_duration=5)
    prefill(p)
    p.step()
    (request, deadline) = p.pd.lent["r"]
    assert p.s.expire_lends(deadline - 0.1) == 0 and "r" in p.pd.lent
    assert p.s.expire_lends(deadline) == 1 and free(p) == NUM_BLOCKS - 1
    # The worker hears of it before any plan may reuse the blocks.
    out = p.step()
    assert out.plan.kv_transfer.unlend_ids == ["r"] and p.lent == {}
    # A read after that finds nothing lent, and frees nothing twice.
    assert p.s.lends_read(["r"]) == 0


def test_an_aborted_prefill_lends_nothing():
    p = Engine("kv_producer")
    p.add("q", 2, max_tokens=5, params=parse_kv_transfer_params({"do_remote_decode": True}))
    p.step()
    p.s.finish_requests(["q"], RequestStatus.FINISHED_ABORTED)
    # As vLLM's connector: only a request that ended normally is lent; an aborted one frees its blocks.
    assert "q" not in p.pd.lent and free(p) == NUM_BLOCKS - 1


def test_a_request_aborted_while_it_pulls_keeps_its_blocks_until_the_pull_ends():
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    params = parse_kv_transfer_params(prefill(p))
    p.step()
    d.add("r", 1, params=params)
    d.step(p)
    held = free(d)
    d.s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert free(d) == held  # the worker may still be writing them
    d.deliver()
    assert free(d) == NUM_BLOCKS - 1


def test_a_lost_worker_voids_what_was_lent():
    p = Engine("kv_producer")
    prefill(p)
    p.s.abandon_loads()
    assert p.pd.lent == {} and free(p) == NUM_BLOCKS - 1


def test_a_lent_request_id_cannot_be_reused_until_freed():
    p = Engine("kv_producer")
    prefill(p)
    with pytest.raises(ValueError, match="lent"):
        p.add("r", 999, max_tokens=1)


def test_kv_both_lends_and_pulls_by_each_request_s_params():
    # vLLM's kv_both: one engine is a prefill engine for one request and a decode engine for another.
    p, both = Engine("kv_producer"), Engine("kv_both")
    params = parse_kv_transfer_params(prefill(p))
    p.step()
    both.add("pulled", 1, params=params)
    both.add("lent", 2, PROMPT[:6], max_tokens=1, params=parse_kv_transfer_params({"do_remote_decode": True}))
    both.drain(p)
    assert both.outputs["pulled"] == expected_output(PROMPT, 3) and both.pd.num_pulls == 1
    assert both.pd.lent.keys() == {"lent"} and both.answers["lent"]["remote_block_ids"] == [both.kv.get_block_ids("lent")[0]]


def test_a_decode_only_engine_ignores_a_prefill_request_s_params():
    # A kv_consumer lends nothing: a do_remote_decode request is served and freed as any other.
    d = Engine("kv_consumer")
    d.add("r", 1, max_tokens=1, params=parse_kv_transfer_params({"do_remote_decode": True}))
    d.drain()
    assert d.pd.lent == {} and d.answers == {} and free(d) == NUM_BLOCKS - 1
