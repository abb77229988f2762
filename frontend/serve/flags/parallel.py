"""``vllm serve``'s ParallelConfig group: how the model is split over devices and hosts.
kvpool splits one model by tensor parallelism on one host; the rest is refused."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import BOOL, MANY, ONE, SWITCH, Group, declared, handled, refused
from protocol.serve_flags.engine import TENSOR_PARALLEL_SIZE

_RULES = [
    refused("--all2all-backend", ONE, why.EXPERTS),
    refused("--cp-kv-cache-interleave-size", ONE, why.CONTEXT_PARALLEL),
    refused("--cpu-distributed-timeout-seconds", ONE, "kvpool's ranks use one timeout, --distributed-timeout-seconds"),
    refused("--data-parallel-address -dpa", ONE, why.ONE_ENGINE),
    refused("--data-parallel-backend -dpb", ONE, why.ONE_ENGINE, accepts=("mp",)),
    refused("--data-parallel-external-lb -dpe", BOOL, why.ONE_ENGINE, accepts=(False,)),
    refused("--data-parallel-hybrid-lb -dph", BOOL, why.ONE_ENGINE, accepts=(False,)),
    refused("--data-parallel-multi-port-external-lb -dpm", SWITCH, why.ONE_ENGINE),
    refused("--data-parallel-rank -dpn", ONE, why.DP_RANK, accepts=("0",)),
    refused("--data-parallel-rpc-port -dpp", ONE, why.ONE_ENGINE),
    refused("--data-parallel-size -dp", ONE, why.ONE_ENGINE, accepts=("1",)),
    refused("--data-parallel-size-local -dpl", ONE, why.ONE_ENGINE, accepts=("1",)),
    refused("--data-parallel-start-rank -dpr", ONE, why.ONE_ENGINE, accepts=("0",)),
    refused("--dbo-decode-token-threshold", ONE, "dual-batch overlap is not supported"),
    refused("--dbo-prefill-token-threshold", ONE, "dual-batch overlap is not supported"),
    refused("--dcp-comm-backend", ONE, why.CONTEXT_PARALLEL),
    refused("--dcp-kv-cache-interleave-size", ONE, why.CONTEXT_PARALLEL, accepts=("1",)),
    refused("--dcp-q-replicate", BOOL, why.CONTEXT_PARALLEL),
    refused("--decode-context-parallel-size -dcp", ONE, why.CONTEXT_PARALLEL, accepts=("1",)),
    refused("--device-ids", ONE, "choose the devices with CUDA_VISIBLE_DEVICES"),
    refused("--disable-custom-all-reduce", BOOL, "kvpool's ranks all-reduce with torch.distributed, never vLLM's custom kernel",
            accepts=(True,)),
    refused("--disable-nccl-for-dp-synchronization", BOOL, why.ONE_ENGINE),
    refused("--distributed-executor-backend", ONE, "kvpool's ranks are local processes (vLLM's mp, or uni for one rank)",
            accepts=("mp", "uni")),
    handled("--distributed-timeout-seconds", ONE, "worker (its --distributed-timeout)", type=float, default=None, metavar="SECONDS",
            help="how long a collective or the start-up rendezvous waits for another rank (default: the worker's)"),
    refused("--dp-sync-interval", ONE, why.ONE_ENGINE),
    refused("--elastic-ep-max-dp-size", ONE, why.EXPERTS),
    refused("--enable-batch-sharded-sampling", BOOL, why.NOT_YET),
    refused("--enable-dbo", BOOL, "dual-batch overlap is not supported", accepts=(False,)),
    refused("--enable-elastic-ep", BOOL, why.EXPERTS, accepts=(False,)),
    refused("--enable-ep-weight-filter", BOOL, why.EXPERTS, accepts=(False,)),
    refused("--enable-eplb", BOOL, why.EXPERTS, accepts=(False,)),
    refused("--enable-expert-parallel -ep", BOOL, why.EXPERTS, accepts=(False,)),
    refused("--enable-fault-tolerance", BOOL, "not supported (kvpool serve restarts a crashed worker itself)", accepts=(False,)),
    refused("--enable-hc-sp", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--enable-shm-tensor-arena", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--eplb-config", ONE, why.EXPERTS),
    refused("--expert-placement-strategy", ONE, why.EXPERTS),
    refused("--fault-tolerance-config", ONE, "not supported (kvpool serve restarts a crashed worker itself)"),
    refused("--master-addr", ONE, "kvpool's ranks meet on a free loopback port of their one host"),
    refused("--master-port", ONE, "kvpool's ranks meet on a free loopback port of their one host"),
    refused("--max-parallel-loading-workers", ONE, why.LOADER),
    refused("--nnodes -n", ONE, why.ONE_ENGINE, accepts=("1",)),
    refused("--node-rank -r", ONE, why.ONE_ENGINE, accepts=("0",)),
    refused("--numa-bind", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--numa-bind-cpus", MANY, why.NOT_YET),
    refused("--numa-bind-nodes", MANY, why.NOT_YET),
    refused("--pipeline-parallel-size -pp", ONE, why.PIPELINE, accepts=("1",)),
    refused("--prefill-context-parallel-size -pcp", ONE, why.CONTEXT_PARALLEL, accepts=("1",)),
    refused("--ray-workers-use-nsight", BOOL, "Ray is not supported", accepts=(False,)),
    declared(TENSOR_PARALLEL_SIZE, ONE, "worker (rank 0 starts the other ranks)"),
    refused("--ubatch-size", ONE, "micro-batching is not supported", accepts=("0",)),
    refused("--worker-cls", ONE, "kvpool's worker is its own process, not a vLLM worker class", accepts=("auto",)),
    refused("--worker-extension-cls", ONE, "kvpool's worker is its own process, not a vLLM worker class"),
]

GROUPS = [Group("ParallelConfig", "Configuration for the distributed execution.", _RULES)]
