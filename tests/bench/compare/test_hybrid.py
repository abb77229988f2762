"""`make compare-hybrid` without vLLM: the checkpoint's layer windows and groups, the pool
set equal in blocks (a block holds one layer of the Gemma-3-style checkpoint, not six),
the workloads and agreement prompts longer than the window, the peak-usage goal."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from bench.compare.checkpoints import describe, kv_groups, kv_layers_per_block
from bench.compare.cli import (
    HYBRID_NUM_BLOCKS,
    NUM_BLOCKS,
    build_parser,
    served_model,
    settle_model,
)
from bench.compare.report import FIGURES, agreement_row, rows
from bench.compare.servers import ServerConfig, server_command, vllm_env
from bench.compare.workloads import agreement_prompts, combine_runs, default_workloads
from worker.tiny.gemma3 import CONFIG as GEMMA3

ROOT = Path(__file__).resolve().parents[3]


def config_dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


LLAMA = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "head_dim": 32,
}


def test_the_layout_is_read_as_kvpools_worker_reads_it(tmp_path):
    # The harness's groups come from protocol.layer_windows (tested in tests/protocol):
    # layer_types, else the one window on every layer (Mistral), off in Qwen2 unless used.
    assert [g.sliding_window for g in kv_groups(config_dir(tmp_path, GEMMA3))] == [128] * 5 + [0]
    assert [(g.layer_ids, g.sliding_window) for g in kv_groups(config_dir(tmp_path, LLAMA))] == [([0, 1, 2, 3], 0)]
    assert [g.sliding_window for g in kv_groups(config_dir(tmp_path, LLAMA | {"sliding_window": 4096}))] == [4096]
    qwen2 = LLAMA | {"sliding_window": 4096, "use_sliding_window": False}
    assert [g.sliding_window for g in kv_groups(config_dir(tmp_path, qwen2))] == [0]
    with pytest.raises(ValueError, match=r"config.json: layer_types must list one type per layer \(4\)"):
        kv_groups(config_dir(tmp_path, LLAMA | {"layer_types": ["full_attention"] * 2}))
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] not supported"):
        kv_groups(config_dir(tmp_path, LLAMA | {"layer_types": ["chunked_attention"] + ["full_attention"] * 3}))


def test_gemma3_blocks_hold_one_layer_on_both_engines(tmp_path):
    model = config_dir(tmp_path, GEMMA3)
    assert (
        describe(kv_groups(model))
        == "6 KV-cache groups: [0] w128, [1] w128, [2] w128, [3] w128, [4] w128, [5] full; 1 layer a block"
    )
    assert kv_layers_per_block(model) == 1
    cfg = ServerConfig(num_blocks=4096, dtype="float32")
    # 2 (K, V) x 1 layer x 2 heads x 32 dims x 32 tokens x 4 bytes, as vLLM's page (65,536
    # blocks in its 1 GiB, measured)
    assert cfg.bytes_per_block(model) == 16384
    k = server_command("kvpool", model, 9000, cfg, ROOT, "tiny")
    v = server_command("vllm", model, 9000, cfg, ROOT, "tiny")
    assert k[k.index("--kv-cache-memory") + 1] == str(4096 * 16384)
    assert (
        k[k.index("--num-gpu-blocks-override") + 1]
        == v[v.index("--num-gpu-blocks-override") + 1]
        == "4096"
    )
    assert vllm_env(tmp_path, cfg, model, 1)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # one group: every layer in a block, as before
    (tmp_path / "llama").mkdir()
    llama = config_dir(tmp_path / "llama", LLAMA)
    assert kv_layers_per_block(llama) == 4 and cfg.bytes_per_block(llama) == 65536


def parsed(tmp_path: Path, config: dict, *argv: str) -> Namespace:
    a = build_parser().parse_args(
        ["--model", str(config_dir(tmp_path, config)), "--trace", "", *argv]
    )
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.out = tmp_path
    settle_model(a, served_model(a))
    return a


def test_the_hybrid_checkpoint_gets_a_bigger_pool_and_prefix_long_not_small_pool(tmp_path):
    a = parsed(tmp_path, GEMMA3)
    assert (a.num_kv_groups, a.window, a.num_blocks) == (6, 128, HYBRID_NUM_BLOCKS)
    assert [w.name for w in default_workloads(a)] == ["prefix-c8", "prefix-c64", "prefix-long"]
    (long,) = [w for w in default_workloads(a) if w.name == "prefix-long"]
    args = dict(zip(long.args[::2], long.args[1::2], strict=False))
    assert args["--prefix-repetition-prefix-len"] == "1024" and long.shared_prefix  # 8 windows
    a.workloads = ["small-pool"]
    with pytest.raises(ValueError, match="small-pool: not with 6 KV-cache groups"):
        default_workloads(a)
    assert parsed(tmp_path, GEMMA3, "--num-blocks", "512").num_blocks == 512


def test_a_one_group_checkpoint_keeps_todays_pool_and_workloads(tmp_path):
    a = parsed(tmp_path, LLAMA)
    assert (a.num_kv_groups, a.window, a.num_blocks) == (1, 0, NUM_BLOCKS)
    assert [w.name for w in default_workloads(a)] == ["prefix-c8", "prefix-c64", "small-pool"]
    assert all(len(p) == 80 for p in agreement_prompts(4, 512, window=a.window))


def test_model_and_checkpoint_together_are_refused(tmp_path):
    a = build_parser().parse_args(["--model", str(tmp_path), "--checkpoint", "gemma3"])
    with pytest.raises(SystemExit, match="give one"):
        served_model(a)


def test_agreement_prompts_outgrow_the_window():
    p = agreement_prompts(8, 512, window=128)
    assert all(len(x) == 272 for x in p) and p[0][:256] == p[4][:256] != p[1][:256]


def fig(**kw) -> dict:
    return {key: 0.5 for key, _, _ in FIGURES} | kw


def test_peak_usage_within_two_points_judged_on_the_hybrid_prefix_workloads():
    results = {"prefix-long": {"vllm": fig(peak_kv_cache_usage_perc=0.40), "kvpool": fig(peak_kv_cache_usage_perc=0.415)},
               "prefix-c64": {"vllm": fig(peak_kv_cache_usage_perc=0.40), "kvpool": fig(peak_kv_cache_usage_perc=0.43)},
               "mooncake": {"vllm": fig(peak_kv_cache_usage_perc=0.40), "kvpool": fig(peak_kv_cache_usage_perc=0.43)}}
    shared = {"prefix-long": True, "prefix-c64": True, "mooncake": False}
    t = {(r["workload"], r["figure"]): r for r in rows(results, shared, hybrid=True)}
    assert (
        t["prefix-long", "peak KV usage"]["met"] is True
        and t["prefix-long", "peak KV usage"]["goal"] == "within 0.02"
    )
    assert t["prefix-c64", "peak KV usage"]["met"] is False
    assert t["mooncake", "peak KV usage"]["goal"] == ""
    assert t["prefix-long", "peak KV usage since start (exact)"]["goal"] == ""
    one_group = {(r["workload"], r["figure"]): r for r in rows(results, shared)}
    assert one_group["prefix-c64", "peak KV usage"]["met"] is None  # no such goal for one group


def test_hybrid_agreement_must_be_all_identical():
    row = agreement_row(
        {"fraction_identical": 63 / 64, "window": 128, "prompt_len": 272, "goal_fraction": 1.0}
    )
    assert row["goal"] == "= 100%" and row["met"] is False
    assert row["figure"] == "greedy identical (float32, 272-token prompts > window 128)"
    assert agreement_row({"fraction_identical": 63 / 64})["met"] is True  # one group: >= 95%


def test_the_exact_peak_combines_only_where_every_run_has_it():
    base = {"peak_kv_cache_usage_perc": 0.3}
    runs = [
        base | {"peak_kv_cache_usage_since_start": 0.31},
        base | {"peak_kv_cache_usage_since_start": 0.35},
    ]
    assert combine_runs(runs, ())["peak_kv_cache_usage_since_start"] == 0.35
    assert (
        combine_runs([base | {"peak_kv_cache_usage_since_start": None}, base], ())[
            "peak_kv_cache_usage_since_start"
        ]
        is None
    )


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_vllm_serves_the_gemma3_checkpoint_with_six_groups_as_transformers_does(
    real_vllm, tmp_path
):
    """vLLM 0.32 itself on the generated checkpoint: the pool in blocks as asked, greedy
    ids in float32 equal to transformers' for prompts past the window, and its KV events
    per group (what kvpool's events must say for this model)."""
    import msgspec
    import torch
    import zmq
    from transformers import AutoModelForCausalLM

    from bench.compare.servers import Server, free_port, num_gpu_blocks, scrape_page
    from bench.compare.workloads import greedy_token_ids
    from worker.tiny.gemma3 import gemma3_checkpoint

    model = gemma3_checkpoint()
    cfg = ServerConfig(num_blocks=512, max_model_len=1024)
    port, events_port = free_port(), free_port()
    # NOTE: vLLM 0.32 connects its PUB socket to an endpoint without a wildcard: the
    # subscriber binds.
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{events_port}")
    events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events_port}",
        }
    )
    cmd = server_command("vllm", model, port, cfg, real_vllm, "tiny") + [
        "--kv-events-config",
        events,
    ]
    env = vllm_env(tmp_path / "cache", cfg, model, 1) | {"OMP_NUM_THREADS": "1"}
    prompts = agreement_prompts(4, 512, window=128)
    try:
        with Server("vllm", cmd, env, tmp_path / "vllm.log", port) as s:
            s.wait_ready(600)
            assert num_gpu_blocks(scrape_page(s.url)) == 512
            # NOTE: the first batches may go before the subscription reaches vLLM's PUB:
            # warm-up prompts of their own until one arrives (bounded), then drained.
            for seed in range(100, 110):
                greedy_token_ids(s.url, "tiny", agreement_prompts(1, 512, seed=seed), 1, 120)
                if sub.poll(3000):
                    break
            else:
                pytest.fail("no KV event batch from vLLM after 10 requests")
            while sub.poll(1000):
                sub.recv_multipart()
            got = greedy_token_ids(s.url, "tiny", prompts[:1], 12, 120) + greedy_token_ids(
                s.url, "tiny", prompts[1:], 12, 120
            )
            stored = []
            while sub.poll(2000):
                batch = msgspec.msgpack.decode(sub.recv_multipart()[-1])
                stored += [e for e in batch[1] if e["type"] == "BlockStored"]
    finally:
        sub.close(0)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    for prompt, ids in zip(prompts, got, strict=True):
        want: list[int] = []
        with torch.no_grad():
            for _ in range(12):
                want.append(int(m(torch.tensor([prompt + want])).logits[0, -1].argmax()))
        assert ids == want
    # The first prompt (272 tokens, one chunk): the full group (5) caches its 8 full
    # blocks; each sliding group (0..4) only the 4 within the window of its last token.
    first = [e for e in stored if e["parent_block_hash"] is None][:6]
    assert [e["group_idx"] for e in first] == [0, 1, 2, 3, 4, 5]
    assert [e["kv_cache_spec_kind"] for e in first] == ["sliding_window"] * 5 + ["full_attention"]
    assert all(e["kv_cache_spec_sliding_window"] == 128 for e in first[:5])
    assert [len(e["block_hashes"]) for e in first] == [4, 4, 4, 4, 4, 8]
    assert all(e["block_hashes"] == first[5]["block_hashes"][4:] for e in first[:5])
