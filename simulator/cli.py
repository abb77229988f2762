"""kvpool-simulate: what hit rate and what queueing will I get with N blocks?

Replays a workload (a Mooncake trace, or one of the load generator's synthetic
datasets) through the real Scheduler, KVCacheManager and BlockPool with no worker,
in virtual time (simulator/engine.py), once per capacity and free policy,
and prints a row for each: prefix-cache hit rate (hit tokens / looked-up tokens, at
each request's first admission, as vllm:prefix_cache_hits/_queries count them), the
same for preempted requests' re-admissions (counted apart: they hit their own freed
blocks, which would inflate the figure exactly when the pool is too small),
evictions, preemptions, rejected requests, peak KV usage, mean queueing delay
(first admission − arrival).

Cost model: a step takes ``--step-overhead-ms`` + ``--ms-per-token`` × scheduled
tokens. The defaults (5 ms + 0.02 ms/token: a full 8192-token step ~169 ms, a
64-request decode step ~6.3 ms) are the order of a 7-8B model on one data-centre
GPU; queueing depends on them, the hit rate at --max-num-seqs 1 does not.
Engine defaults differ from the server's on purpose: --max-num-batched-tokens 8192
(vLLM's for online serving on large GPUs) and --max-model-len 131072 (admits every
request of the Mooncake conversation trace, up to ~128k tokens).

Host tier: ``--kv-offloading-blocks N[,N...]`` gives the manager the scheduler's own
HostTier of N slots (vLLM's --kv-offloading-size, in blocks); the table then adds
the host tier's hit rate, both tiers' together, loads, GB stored and loaded
(``--kv-bytes-per-token``) and the seconds the loads cost, each charged
``bytes / --offload-bandwidth-gbps`` in its step.

External tier: ``--external-tier disk|store`` gives the manager the scheduler's own
ExternalTier (the server's --kv-offloading-backend disk or mooncake) and runs its
parking: a request whose next blocks the tier holds waits while they load, off the
step path, at ``--external-read-gbps``; every computed block is saved at
``--external-write-gbps``, on the worker's one I/O thread (simulator/external_io.py).
The table adds the tier's hit rate, all tiers' together, blocks loaded and saved, GB
read and written, the mean load time, the I/O backlog and the mean time to first token.
``--external-tier-warm`` measures a restart: a second replay over the tier the first filled.

Hybrid KV-cache groups (sliding-window layers, simulator/layer_windows.py):
``--layer-windows 512x5,0 --num-layers 26`` (or ``--sliding-window 512
--sliding-window-pattern 6``) runs the server's KVCacheManager over the groups
the server would make; --num-blocks counts blocks of that model (a block spans
fewer layers' KV than an all-full model's: same bytes, more blocks). The host and
external tiers and --replicas run with them as the server does: a tier hit extends
the device's in every group (a full group's blocks after it, a sliding group's within
the window at its end), and a block stored, loaded or saved is one group's, counted
at ``--kv-bytes-per-token`` x block size x the share of the layers a block spans
(--external-tier-blocks and the table's block counts are such blocks too); hit tokens
are the hits' tokens. --pd runs with them as the server's P/D does: a prefill engine lends
every group's blocks (a sliding group's in-window tail), a decode engine pulls one block per
(group, position) it fills, each one group's bytes. Not with --router kv_aware (the error
says why).

Speculative decoding: ``--num-speculative-tokens K --spec-acceptance-rate A`` runs the
scheduler's own speculative decoding with a drafter that drafts K tokens for every
decoding request each step, each accepted with probability A until the first rejection
(seeded by --seed; simulator/spec_decode.py). Drafts are scheduled tokens, so each step
pays ``--ms-per-token`` for them; the table adds drafts, draft tokens, accepted tokens,
the draft acceptance rate and the mean acceptance length. Decode steps are not
fast-forwarded then.

    python -m simulator --trace conversation_trace.jsonl --num-blocks 100000,200000 \\
        --policy vllm,tail,forward --result-json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from protocol.kv_cache_spec import is_hybrid, num_kv_tensors
from protocol.serve_flags.flag import add_flag
from protocol.serve_flags.scheduling import POLICY_ROWS
from scheduler.core.hashing import HASH_ALGOS
from scheduler.core.kv_cache_manager import OFFLOAD_STORE_MODES
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from scheduler.core.retention.pinned_blocks import PinRefused
from scheduler.sched.policy_options import check_scheduler_options
from simulator.config import SimConfig
from simulator.external_args import add_external_tier_args, check_external_tier_args
from simulator.fleet_cli import add_fleet_args, check_fleet_args, fleet_main
from simulator.free_policies import FREE_POLICIES
from simulator.layer_windows import add_layer_window_args, group_windows_from_args
from simulator.pd_args import add_pd_args, check_pd_args
from simulator.plot import plot_hit_rates
from simulator.replay import simulate
from simulator.retention import eviction_policy_list
from simulator.run_setup import build_workload, int_list, sim_config
from simulator.spec_decode import DEFAULT_ACCEPTANCE_RATE
from simulator.table import external_line, format_table
from simulator.workload_args import add_workload_args, check_workload_args


def _policy_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in FREE_POLICIES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or text!r}; choose from {', '.join(FREE_POLICIES)}")
    return values


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig(num_blocks=0)
    p = argparse.ArgumentParser(prog="kvpool-simulate", description=__doc__.splitlines()[0])
    add_workload_args(p)
    g = p.add_argument_group("engine")
    g.add_argument("--num-blocks", type=int_list, required=True, help="KV blocks (null block included); a comma list runs each")
    g.add_argument("--policy", type=_policy_list, default=[d.policy], help=f"free policy, or a comma list: {', '.join(FREE_POLICIES)} (default vllm)")
    g.add_argument("--kv-eviction-policy", type=eviction_policy_list, default=[d.eviction_policy],
                   help=f"the pool's eviction policy (the server's flag), or a comma list: {', '.join(KV_EVICTION_POLICIES)} (default lru)")
    g.add_argument("--pin-prefix-tokens", type=int, default=d.pin_prefix_tokens, metavar="N",
                   help="pin the first N tokens (whole blocks) of the first request before the replay, as POST /v1/cache/pin "
                        "(e.g. the workload's shared system prompt; default 0: none)")
    g.add_argument("--max-pinned-fraction", type=float, default=d.max_pinned_fraction, metavar="FRACTION",
                   help="the server's cap on pinned blocks, a share of the pool (default %(default)s)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, help="longer requests are rejected (default %(default)s)")
    g.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=d.reserve_full_sequence,
                   help="admit a request only if its whole sequence fits the free blocks (vLLM's default: on)")
    g.add_argument("--step-overhead-ms", type=float, default=d.step_overhead_ms, help="fixed cost of a step (default %(default)s)")
    g.add_argument("--ms-per-token", type=float, default=d.ms_per_token, help="cost of a scheduled token (default %(default)s)")
    g.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default=d.hash_algo,
                   help="block hash (default %(default)s: offline, so no adversary; results do not depend on it)")
    for row in POLICY_ROWS:  # the scheduler's own flags
        add_flag(g, row)
    g.add_argument("--no-fast-forward", dest="fast_forward", action="store_false", help="step every decode step (slow; for checks)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens, metavar="K",
                   help="draft K tokens for every decoding request each step, verified by the scheduler as with the "
                        "server's --speculative-config; the drafts are scheduled tokens, charged --ms-per-token each "
                        "(default 0: off; with K > 0 decode steps are not fast-forwarded)")
    g.add_argument("--spec-acceptance-rate", type=float, default=None, metavar="A",
                   help="with --num-speculative-tokens: the probability that a draft token is accepted, in [0, 1]; "
                        f"a step accepts its drafts in order until the first rejection (seeded by --seed; default {d.spec_acceptance_rate})")
    g = p.add_argument_group("host tier (offloading)")
    g.add_argument("--kv-offloading-blocks", type=int_list, default=[0], metavar="N",
                   help="host-tier KV blocks (the scheduler's HostTier; with hybrid groups, one group's blocks); a comma list runs each; "
                        "0: none (default 0)")
    g.add_argument("--kv-offloading-store", choices=OFFLOAD_STORE_MODES, default=d.offload_store,
                   help="when blocks go to the host tier: on eviction, or write-through when full (default %(default)s)")
    g.add_argument("--offload-bandwidth-gbps", type=float, default=d.offload_bandwidth_gbps,
                   help="host-to-device bandwidth a load is charged at, GB/s (default %(default)s)")
    g.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token,
                   help="KV bytes of one token over all layers, for bytes moved (default %(default)s: Llama-3-8B, bfloat16; "
                        "an fp8 --kv-cache-dtype stores half: 65536); with hybrid groups a block moved is one group's, "
                        "its layers' share of these bytes")
    add_external_tier_args(p)
    add_layer_window_args(p)
    add_fleet_args(p)
    add_pd_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None, help='write {"results": [...]} here')
    g.add_argument("--plot", default=None, help="PNG of hit rate against capacity, a line per policy")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    check_workload_args(p, a)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.policy != ["vllm"] and (a.kv_eviction_policy != ["lru"] or a.scheduling_policy == "priority"):
        p.error("--policy tail/forward reorder the LRU queue: combine them only with --kv-eviction-policy lru and --scheduling-policy fcfs")
    if a.pin_prefix_tokens < 0 or not 0.0 <= a.max_pinned_fraction < 1.0:
        p.error("--pin-prefix-tokens must be >= 0 and --max-pinned-fraction in [0, 1)")
    try:
        check_scheduler_options(a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, enable_chunked_prefill=a.enable_chunked_prefill,
                                long_prefill_token_threshold=a.long_prefill_token_threshold, watermark=a.watermark,
                                max_num_scheduled_tokens=a.max_num_scheduled_tokens, max_num_active_seqs=a.max_num_active_seqs)
    except ValueError as e:
        p.error(str(e))
    if any(n < 0 for n in a.kv_offloading_blocks):
        p.error(f"--kv-offloading-blocks must be >= 0, got {min(a.kv_offloading_blocks)}")
    if not 0 < a.offload_bandwidth_gbps < math.inf:
        p.error(f"--offload-bandwidth-gbps must be a positive number, got {a.offload_bandwidth_gbps}")
    if a.kv_bytes_per_token < 1:
        p.error(f"--kv-bytes-per-token must be positive, got {a.kv_bytes_per_token}")
    bad = [n for n in a.num_blocks if n < 2]
    if bad:
        p.error(f"--num-blocks must be at least 2 (block 0 is the null block), got {bad[0]}")
    if a.step_overhead_ms < 0 or a.ms_per_token < 0 or a.step_overhead_ms + a.ms_per_token <= 0:
        p.error("--step-overhead-ms and --ms-per-token must be >= 0, not both 0")
    _check_speculative(p, a)
    check_fleet_args(p, a)
    check_pd_args(p, a)
    check_external_tier_args(p, a)
    _check_groups(p, a)
    for flag, path in (("--result-json", a.result_json), ("--plot", a.plot)):
        if path is not None:
            _check_output_path(p, flag, Path(path))
    return a


def _check_speculative(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--num-speculative-tokens K >= 0; --spec-acceptance-rate only with K > 0, in [0, 1]
    (sets its default)."""
    if a.num_speculative_tokens < 0:
        p.error(f"--num-speculative-tokens must be >= 0 (0: no speculative decoding), got {a.num_speculative_tokens}")
    if a.spec_acceptance_rate is not None:
        if a.num_speculative_tokens == 0:
            p.error("--spec-acceptance-rate needs --num-speculative-tokens K > 0")
        if not 0.0 <= a.spec_acceptance_rate <= 1.0:
            p.error(f"--spec-acceptance-rate must be a probability in [0, 1], got {a.spec_acceptance_rate}")
    else:
        a.spec_acceptance_rate = DEFAULT_ACCEPTANCE_RATE


def _check_groups(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Sets ``a.groups`` (the KV-cache groups, or None) and ``a.group_windows``; refuses
    with hybrid groups what the simulator does not model with them (kv_aware)."""
    found = group_windows_from_args(p, a)
    a.groups = None if found is None else found[0]
    a.group_windows = () if found is None else tuple(g.sliding_window for g in found[0])
    if not is_hybrid(a.group_windows):
        return
    if "kv_aware" in (a.router or ()):
        p.error("hybrid KV-cache groups run without --router kv_aware: its index holds a block hash per replica, "
                "not per group, so a sliding group's block leaving its window would take the full group's prefix out")


def _check_output_path(p: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Refuse before the run (not after it) an output that cannot be written; a
    missing folder is created."""
    if path.is_dir():
        p.error(f"{flag} {path}: is a folder, expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"{flag} {path}: cannot create its folder: {e.strerror or e}")
    if not path.parent.is_dir():
        p.error(f"{flag} {path}: {path.parent} is not a folder")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        workload = build_workload(a)
    except (OSError, ValueError) as e:
        print(f"kvpool-simulate: error: {e}", file=sys.stderr)
        return 2
    source = a.trace if a.dataset == "mooncake" else a.dataset
    if len(workload) == 0:
        why = f"{source} holds no requests" if a.num_requests != 0 else "--num-requests 0 leaves no requests"
        print(f"kvpool-simulate: error: {why}: nothing to simulate", file=sys.stderr)
        return 2
    print(f"{source}: {len(workload)} requests, block size {a.block_size}, max_num_seqs {a.max_num_seqs}, "
          f"max_num_batched_tokens {a.max_num_batched_tokens}", file=sys.stderr)
    if a.groups is not None:
        print(f"KV-cache groups: windows {list(a.group_windows)} over {sum(len(g.layer_ids) for g in a.groups)} layers; "
              f"a block spans {num_kv_tensors(a.groups)} layers' KV", file=sys.stderr)
    if a.replicas or a.pd:
        return fleet_main(a, workload, str(source))
    results = []
    runs = [(n, h, x, p, e) for n in a.num_blocks for h in a.kv_offloading_blocks for x in a.external_tier_blocks
            for p in a.policy for e in a.kv_eviction_policy]
    for num_blocks, num_host_blocks, num_external_blocks, policy, eviction in runs:
        try:
            results.append(simulate(workload, sim_config(a, num_blocks, num_host_blocks, policy, eviction, num_external_blocks)))
        except PinRefused as e:
            print(f"kvpool-simulate: error: --pin-prefix-tokens {a.pin_prefix_tokens} with {num_blocks} blocks: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            print(f"kvpool-simulate: error: {num_blocks} blocks, {policy}/{eviction}: {e}", file=sys.stderr)
            return 2
        r = results[-1]
        host = f", host tier {num_host_blocks}: {r.host_hit_rate:.2%}" if num_host_blocks else ""
        spec = (f", spec acceptance {r.spec_draft_acceptance_rate:.2%}, mean length {r.spec_mean_acceptance_length:.2f}"
                if r.num_speculative_tokens else "")
        print(f"  {num_blocks} blocks, {policy}/{eviction}: hit rate {r.prefix_cache_hit_rate:.2%}{host}{external_line(r)}, preempted "
              f"{r.prefix_cache_preempted_hit_rate:.2%}{spec} ({r.wall_s:.1f} s)", file=sys.stderr)
    print(format_table(results))
    if a.result_json:
        config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(a).items()}
        doc = {"source": str(source), "config": {k: v for k, v in config.items() if k not in ("result_json", "plot")},
               "results": [r.summary() for r in results]}
        Path(a.result_json).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    if a.plot:
        plot_hit_rates(results, a.plot, f"kvpool-simulate: {Path(str(source)).name}, block size {a.block_size}")
    return 0
