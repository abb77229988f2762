"""P/D disaggregation of a hybrid model (sliding-window and full-attention layers, several
KV-cache groups) on separate `kvpool serve` engines behind the real vllm-router's PD mode
(bench/pd_fleet.py): the prefill engine answers one list of blocks per group (a sliding
group's in-window tail), the decode engine reads every group's blocks from the prefill
engine's worker, computes no prompt token but the last, and its greedy tokens are one
engine's (the prefill engine, serving a request without params, is that engine).

A Gemma 3 checkpoint (kvtest.hf_models: layers sliding, sliding, full, twice; window 16,
so three groups) with the tiny checkpoint's tokenizer; float32, 96 blocks of 16 each.
Prompts run past the window by several blocks, so a sliding group's nulls and tail count.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from kvtest.hf_models import make_checkpoint
from kvtest.router import require_router

from bench.pd_fleet import PDFleet
from tests.e2e.test_pd_disaggregation import completion, metric, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

COMMON = ("--served-model-name", "tiny", "--dtype", "float32", "--num-gpu-blocks-override", "96", "--max-model-len", "512",
          "--enable-prompt-tokens-details")
WINDOW, BLOCK = 16, 16


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Token ids of the checkpoint's vocabulary (256), past the window by one to several blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory):
    require_router()
    d = make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_checkpoint) / name, d / name)
    f = PDFleet(d, tmp_path_factory.mktemp("pd-hybrid"), 1, 1, *COMMON, producer_extra={"kv_lease_duration": 5.0})
    try:
        yield f
    finally:
        f.stop()


def test_a_hybrid_prefill_engine_answers_one_list_per_group(fleet):
    (prefill,) = fleet.prefills
    (prompt,) = prompts([83], seed=21)
    answer = completion(prefill.url, prompt, 1, min_tokens=1, kv_transfer_params={"do_remote_decode": True})
    groups = answer["kv_transfer_params"]["remote_block_ids"]
    num_blocks = -(-len(prompt) // BLOCK)
    # Two sliding groups (their in-window tail: cdiv(16, 16) + 1 blocks) and the full group (every block).
    assert sorted(len(g) for g in groups) == [WINDOW // BLOCK + 1] * 2 + [num_blocks]
    assert all(b > 0 for g in groups for b in g) and len({b for g in groups for b in g}) == sum(map(len, groups))
    # Nobody reads it: freed when the lease passes.
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0.0, 15, "blocks freed after the lease")


def read_through_the_router(fleet, batch: list[list[int]]) -> None:
    """Each prompt of ``batch`` through the router gives the single engine's tokens, every
    prompt read from the prefill engine (its last token, computed again, counts as read),
    the decode engine's worker never lost, the prefill engine's blocks freed by the reads."""
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    reference = [completion(prefill.url, p)["choices"][0]["token_ids"] for p in batch]
    computed = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
    external = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    lost = metric(decode.url, "kvpool_worker_loss_recomputes_total")
    through = [completion(fleet.url, p) for p in batch]
    assert [a["choices"][0]["token_ids"] for a in through] == reference, fleet.logs()
    # NOTE: a plan the worker refuses loses it, and the request is computed again: same tokens, so checked apart.
    assert metric(decode.url, "kvpool_worker_loss_recomputes_total") - lost == 0, fleet.logs()
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') - computed == 0
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') - external == sum(map(len, batch))
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0.0, 2.0, "the prefill engine's blocks freed by the reads")


def test_1p1d_of_a_hybrid_model_behind_the_router_answers_as_one_engine(fleet):
    # Lengths on and across block edges: 33 (a block past two), 48 (three whole), 61, 100.
    read_through_the_router(fleet, prompts([33, 48, 61, 100], seed=23))


# NOTE: the last prompt token, computed again on the decode engine, attends to the 16 tokens
# ending with it: for 47 tokens, token 31, the last of block 1, which the decode engine's
# allocation must not null (else its worker refuses the plan and is lost).
def test_a_prompt_whose_last_token_attends_to_the_last_token_of_a_block(fleet):
    read_through_the_router(fleet, prompts([31, 47], seed=29))
