"""The settings table's rows of kvpool's own flags (not ``vllm serve``'s) that
``kvpool serve`` gives a child: the KV events' sockets, the external tier's places,
the pins' share, how the worker shares a CPU host, the development endpoints."""

from __future__ import annotations

from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, flag
from protocol.serve_flags.values import gib

DEVICE = flag("--device", WORKER, choices=("cpu", "cuda"), default=None,
              help="where the model and KV cache live (default: cuda if available, else cpu)")
DEV_MODE = flag("--dev-mode", SCHEDULER, FRONTEND, action="store_true",
                help="development endpoints: POST /reset_prefix_cache (default off; also VLLM_SERVER_DEV_MODE=1)")
# NOTE: the scheduler's policies (scheduler/core/retention/eviction_policies.py KV_EVICTION_POLICIES, checked
# equal by tests/scheduler/engine/test_settings_rows.py).
KV_EVICTION_POLICY = flag("--kv-eviction-policy", SCHEDULER, default="lru", choices=("lru", "arc", "lfu", "s3fifo", "cost"),
                          help="which free cached block is evicted first: lru (vLLM's), arc, lfu, s3fifo or cost; with "
                               "--scheduling-policy priority, lower-priority requests' blocks go first (default %(default)s)")
MAX_PINNED_FRACTION = flag("--max-pinned-fraction", SCHEDULER, type=float, default=0.5, metavar="FRACTION",
                           help="share of the pool's blocks that pins (POST /v1/cache/pin) may hold, in [0, 1) "
                                "(default %(default)s)")
KV_EVENTS_ENDPOINT = flag("--kv-events-endpoint", SCHEDULER, default=None, metavar="ENDPOINT",
                          help="bind a ZMQ PUB socket here and publish KV cache events, e.g. tcp://127.0.0.1:5557 "
                               "(default: none, no events)")
KV_EVENTS_REPLAY_ENDPOINT = flag("--kv-events-replay-endpoint", SCHEDULER, default=None, metavar="ENDPOINT",
                                 help="ROUTER socket serving missed batches, e.g. tcp://127.0.0.1:5558 (default: none)")
KV_EVENTS_TOPIC = flag("--kv-events-topic", SCHEDULER, default="", metavar="TOPIC",
                       help="topic frame of every KV event batch (default: empty)")
KV_OFFLOADING_PATH = flag("--kv-offloading-path", WORKER, default=None, metavar="DIR",
                          help="--kv-offloading-backend disk: the directory of the saved KV blocks, kept across restarts "
                               "(default: none)")
KV_OFFLOADING_DISK_SIZE = flag("--kv-offloading-disk-size", WORKER, type=gib, default=None, metavar="GIB",
                               help="--kv-offloading-backend disk: at most this many GiB in the directory, the least "
                                    "recently used blocks removed past it (default: none)")
MOONCAKE_MASTER = flag("--mooncake-master", SCHEDULER, WORKER, default=None, metavar="HOST:PORT",
                       help="--kv-offloading-backend mooncake: the store's master, asked which blocks it holds (default: none)")
MOONCAKE_METADATA = flag("--mooncake-metadata", SCHEDULER, WORKER, default=None, metavar="URL",
                         help="--kv-offloading-backend mooncake: the store's metadata server (http://HOST:PORT/metadata) "
                              "(default: none)")
# NOTE: aiohttp refuses a larger body with 413 before reading it; 4 MiB is far more text
# than --max-model-len tokens of any tokenizer.
MAX_REQUEST_BODY_BYTES = flag("--max-request-body-bytes", FRONTEND, type=int, default=4 << 20, metavar="BYTES",
                              help="the API refuses a larger request body with 413, before reading it (default %(default)s)")
CPU_NICE = flag("--cpu-nice", WORKER, type=int, default=None, metavar="N",
                help="on CPU, the worker runs at nice N at least, 0..19, so that the scheduler and frontend sharing its "
                     "cores are not kept waiting by its compute threads (default: the worker's; 0: the priority it was "
                     "started with)")
CPU_WIDE_STEP_TOKENS = flag("--cpu-wide-step-tokens", WORKER, type=int, default=None, metavar="N",
                            help="on CPU, the worker runs a step of at least N tokens on every core, the one left to the "
                                 "scheduler and frontend included, while no other process keeps one busy "
                                 "(worker/cpu/host_load.py); not with OMP_NUM_THREADS or tensor parallelism (default: the "
                                 "worker's, from the model's size; 0: never)")

ROWS = (DEVICE, DEV_MODE, KV_EVICTION_POLICY, MAX_PINNED_FRACTION, KV_EVENTS_ENDPOINT, KV_EVENTS_REPLAY_ENDPOINT, KV_EVENTS_TOPIC, KV_OFFLOADING_PATH,
        KV_OFFLOADING_DISK_SIZE, MOONCAKE_MASTER, MOONCAKE_METADATA, MAX_REQUEST_BODY_BYTES, CPU_NICE, CPU_WIDE_STEP_TOKENS)
