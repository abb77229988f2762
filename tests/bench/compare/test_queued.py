"""`make compare`'s queued comparison (bench/compare/offline.py): the small pool's shape
with every request queued at once. Always: the prompts, the shared-block check, kvpool's
side against counts derived by hand, the table's rows, a failing vLLM run; marked
``compare`` (needs ``.venv-vllm``, selected with ``-m compare``): both engines for real,
whose counters must be equal."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bench.compare.offline import (
    QUEUED,
    queued_prompts,
    run_kvpool,
    run_vllm,
    shared_generated_blocks,
)
from bench.compare.report import rows
from bench.compare.servers import ServerConfig

ROOT = Path(__file__).resolve().parents[3]
SMALL = ServerConfig(block_size=32, num_blocks=64, max_model_len=63 * 32)


def test_prompts_share_four_prefixes_of_eight_blocks():
    p = queued_prompts(64, vocab=512)
    assert len(p) == 64 and {len(x) for x in p} == {288}
    assert p[0][:256] == p[4][:256] == p[60][:256] != p[1][:256]
    assert p[0][256:] != p[4][256:]
    assert min(map(min, p)) >= 5 and max(map(max, p)) < 512


def test_shared_generated_blocks_counts_only_blocks_with_generated_tokens():
    bs = 4
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]
    # Requests 0 and 1: the same prompt, then the same 3 tokens (block 2: 5,7,8,9) and
    # different ones after; request 2 differs in its prompt's partial block.
    outputs = [[7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 20, 21, 22, 23], [7, 8, 9, 10, 11, 12, 13]]
    assert shared_generated_blocks(prompts, outputs, bs) == 1
    assert shared_generated_blocks(prompts[:1] + prompts[2:], outputs[:1] + outputs[2:], bs) == 0
    # A shared prompt alone (its full blocks hold no generated token) counts nothing.
    assert shared_generated_blocks([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [[1], [2]], bs) == 0


def test_kvpool_side_counts_first_admissions_and_preempts_on_the_small_pool():
    prompts = queued_prompts(64, vocab=512)
    got = run_kvpool(SMALL, prompts, 256, 512)
    # Every prompt token is queried once (re-admissions after preemption are not
    # counted); the first request of each prefix misses, the other 60 hit its 8 blocks.
    assert got["vllm:prefix_cache_queries"] == 64 * 288
    assert got["vllm:prefix_cache_hits"] == 60 * 256
    # 64 requests of up to 544 tokens (17 blocks) on 63 blocks: preemption is certain.
    assert got["vllm:num_preemptions"] > 0
    roomy = run_kvpool(ServerConfig(block_size=32, num_blocks=1200, max_model_len=2048), prompts, 256, 512)
    assert roomy["vllm:num_preemptions"] == 0
    assert roomy["vllm:prefix_cache_hits"] == 60 * 256


def test_kvpool_side_refuses_a_run_without_prefix_caching():
    off = ServerConfig(block_size=32, num_blocks=64, max_model_len=2016, prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        run_kvpool(off, queued_prompts(4, 512), 8, 512)


def test_queued_rows_show_the_counters_only_and_want_them_equal():
    counters = {"vllm:num_preemptions": 183, "vllm:prefix_cache_queries": 18432, "vllm:prefix_cache_hits": 15360}
    t = rows({QUEUED: {"vllm": counters, "kvpool": counters | {"vllm:num_preemptions": 182}}}, {QUEUED: True})
    assert [r["figure"] for r in t] == ["prefix-cache queries", "prefix-cache hits", "preemptions"]
    by = {r["figure"]: r for r in t}
    assert by["preemptions"]["goal"] == "= vLLM" and by["preemptions"]["met"] is False  # 1 off is off
    assert by["prefix-cache hits"]["met"] is True


def test_a_failing_vllm_run_names_its_log(tmp_path):
    fake = tmp_path / ".venv-vllm/bin/python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'no engine here' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match=r"failed with 3; see .*queued\.log"):
        run_vllm(tmp_path, tmp_path / "m", SMALL, [[5, 6]], 4, {}, tmp_path / "out", 30)
    assert "no engine here" in (tmp_path / "out/queued.log").read_text()


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_both_engines_queued_count_the_same(real_vllm, tmp_path):
    from bench.compare.checkpoints import checkpoint_dir
    from bench.compare.servers import vllm_env

    model = checkpoint_dir("tiny")
    prompts = queued_prompts(64, 512)
    env = vllm_env(tmp_path / "cache", SMALL, model, 1) | {"OMP_NUM_THREADS": "1"}
    v = run_vllm(ROOT, model, SMALL, prompts, 256, env, tmp_path / "vllm", 800)
    assert shared_generated_blocks(prompts, v.pop("outputs"), SMALL.block_size) == 0
    assert v["vllm:num_preemptions"] > 0
    assert run_kvpool(SMALL, prompts, 256, 512) == v
