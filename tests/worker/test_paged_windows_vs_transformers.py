"""Sliding-window models through the paged path against transformers in float32:
Gemma 3 (sliding and full layers, its norms, scaled embeddings, query_pre_attn_scalar,
local and global RoPE), Qwen2 with its first layer full and Mistral with every layer
sliding, on prompts several windows long.

The model is driven as the runner drives it with KV-cache groups (``kvtest.grouped_paged``):
one block table per group, a sliding group's blocks before the window replaced by the
null block as the requests advance, one metadata per (group, window). A first request is
prefilled in three chunks, then decodes; a second one starts with a prefix-cache hit on
the first's blocks (its sliding groups hit only the blocks their window still needs, which
the first request had already freed) and is prefilled in two chunks beside the first's
decodes. Every logit row must be within 1e-4 (relative) of transformers' forward over the
same tokens, and the greedy tokens must equal ``model.generate(do_sample=False)``.
Gemma 3 with every layer full also runs through today's runner (one group).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from kvtest.grouped_paged import GroupedPagedModel
from kvtest.hf_models import (
    VOCAB,
    WINDOW,
    WINDOW_KINDS,
    load_reference,
    make_checkpoint,
    reference_generate,
    reference_logits,
)

from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model

# (kind, its layers' windows, its KV-cache groups' windows)
EXPECTED = {
    "gemma3": ([WINDOW, WINDOW, 0, WINDOW, WINDOW, 0], [WINDOW, WINDOW, 0]),
    "qwen2-sliding": ([0, WINDOW], [0, WINDOW]),
    "mistral-sliding": ([WINDOW, WINDOW], [WINDOW]),
}


@pytest.fixture(scope="module", params=WINDOW_KINDS)
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_reference(path)


def run(
    path, block_size: int, disable_hybrid: bool = False, dtype: torch.dtype = torch.float32
) -> GroupedPagedModel:
    rng = random.Random(block_size)
    paged = GroupedPagedModel(
        load_model(Checkpoint(path), dtype, "cpu"),
        256,
        block_size,
        disable_hybrid=disable_hybrid,
    )
    a = [rng.randrange(2, VOCAB) for _ in range(60)]
    paged.add(0, a)
    for n in (23, 20, 17):  # chunked prefill, the later chunks past the window
        paged.step({0: n})
    shared = 40 // block_size  # blocks of A's prompt that B's starts with
    paged.add(
        1,
        a[: shared * block_size] + [rng.randrange(2, VOCAB) for _ in range(25)],
        share_from=0,
        num_shared_blocks=shared,
    )
    for n in (9, 16):
        paged.step({0: 1, 1: n})
    for _ in range(6):
        paged.step({0: 1, 1: 1})
    return paged


def assert_logits_close(logits_at: list[tuple[int, torch.Tensor]], ref: torch.Tensor, sid: int) -> None:
    """Each (position, logits) of a paged run equals transformers' row: 1e-4 relative, and
    1e-4 of the row's largest logit absolute."""
    for pos, logits in logits_at:
        torch.testing.assert_close(
            logits.double(), ref[pos], rtol=1e-4, atol=1e-4 * float(ref[pos].abs().max()), msg=f"seq {sid} pos {pos}"
        )


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_windows_match_transformers_float32(checkpoint, block_size):
    kind, path, hf = checkpoint
    paged = run(path, block_size)
    layer_windows, group_windows = EXPECTED[kind]
    assert list(paged.model.config.layer_windows) == layer_windows
    assert [g.sliding_window for g in paged.groups] == group_windows
    assert paged.num_nulled > 0  # sliding groups freed blocks before their windows
    for sid, seq in paged.seqs.items():
        assert len(seq.tokens) > 3 * WINDOW
        ref = reference_logits(hf, seq.tokens[:-1])  # (T, V)
        assert_logits_close(seq.logits, ref, sid)
        assert seq.out == reference_generate(hf, seq.tokens[: seq.num_prompt], len(seq.out)), (
            f"seq {sid}"
        )


def test_disable_hybrid_keeps_every_block_and_the_windows(checkpoint):
    # --disable-hybrid-kv-cache-manager: one full group, nothing freed, the same outputs.
    kind, path, hf = checkpoint
    paged = run(path, 4, disable_hybrid=True)
    assert [g.sliding_window for g in paged.groups] == [
        max(EXPECTED[kind][0]) if kind == "mistral-sliding" else 0
    ]
    for sid, seq in paged.seqs.items():
        ref = reference_logits(hf, seq.tokens[:-1])
        assert_logits_close(seq.logits, ref, sid)


def test_bfloat16_top_token_is_the_reference_or_a_near_tie(checkpoint):
    # Gemma's checkpoints are bfloat16: its (1 + w) norms and sqrt(hidden) scale are
    # rounded as transformers rounds them, so the top token is float32's or a near tie.
    _, path, hf = checkpoint
    paged = run(path, 16, dtype=torch.bfloat16)
    for seq in paged.seqs.values():
        ref = reference_logits(hf, seq.tokens[:-1])  # float32 transformers, (T, V)
        for pos, logits in seq.logits:
            top = int(logits.argmax())
            assert ref[pos][top] >= ref[pos].max() - 0.05 * (ref[pos].max() - ref[pos].min()), (
                pos,
                top,
            )


def test_the_runner_serves_gemma3_with_its_attention_scale(tmp_path):
    # Gemma 3 with every layer full: one group, today's runner; query_pre_attn_scalar,
    # the norms and the embeddings' scale must all reach it (chunked prefill, shared
    # prefix blocks, preemption from the mini scheduler's random plans).
    from kvtest.mini_scheduler import MiniScheduler

    from worker.kv.kv_cache import allocate_kv_caches
    from worker.step.runner import ModelRunner

    path = make_checkpoint("gemma3-tied", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**cfg, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]})
    )
    hf = load_reference(path)
    model = load_model(Checkpoint(path), torch.float32, "cpu")
    assert model.config.layer_windows == (0,) * 6 and model.config.attention_scale == 24**-0.5
    c = model.config
    caches = allocate_kv_caches(
        c.num_layers, 128, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu"
    )
    rng = random.Random(3)
    sched = MiniScheduler(ModelRunner(model, caches, 8, 128), rng, 128, 4)
    for sid in range(4):
        sched.add(
            sid, [rng.randrange(2, VOCAB) for _ in range(rng.randint(5, 40))], rng.randint(1, 8)
        )
    sched.step()
    sched.add(
        4,
        [rng.randrange(2, VOCAB) for _ in range(30)],
        4,
        share_from=next(s for s, r in sched.live.items() if r.computed >= 8),
    )
    sched.run()
    for sid, req in sched.done.items():
        ref = reference_logits(hf, req.prompt + req.out)
        assert_logits_close(req.logits, ref, sid)
