"""The settings table's rows of vLLM's SchedulerConfig (and the CacheConfig flag that
only checks the scheduler's one KV-cache group) that ``kvpool serve`` passes as given:
the scheduling policy and its budgets (to the scheduler), the queue limits (to the API
server, as vLLM's) and the KV-cache groups (to the worker).

The policies' meaning: scheduler/sched/policy_options.py (and the one-group flags':
scheduler/engine/one_group_flags.py)."""

from __future__ import annotations

import argparse

from protocol.human_readable import human_readable_int
from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, flag

# NOTE: the scheduler's policies (scheduler/sched/policy_options.py SCHEDULING_POLICIES, checked
# equal by tests/scheduler/engine/test_settings_rows.py).
SCHEDULING_POLICIES = ("fcfs", "priority")

ON_OFF = argparse.BooleanOptionalAction

SCHEDULING_POLICY = flag("--scheduling-policy", SCHEDULER, choices=SCHEDULING_POLICIES, default="fcfs",
                         help="fcfs: first come, first served; priority: by each request's priority (lower first), then arrival; "
                              "out of blocks, the lowest-priority, latest-arriving running request is preempted (default %(default)s)")
LONG_PREFILL_TOKEN_THRESHOLD = flag("--long-prefill-token-threshold", SCHEDULER, type=int, default=0, metavar="N",
                                    help="schedule at most N tokens of one request in a step, unless it is the only request "
                                         "(default 0: off)")
LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE = flag("--long-prefill-token-threshold-adaptive", SCHEDULER, action=ON_OFF, default=False,
                                             help="floor that cap at --max-num-batched-tokens / (running + waiting requests) "
                                                  "(default: off)")
ENABLE_CHUNKED_PREFILL = flag("--enable-chunked-prefill", SCHEDULER, action=ON_OFF, default=True,
                              help="split a prompt that does not fit the step's token budget across steps (default: on); "
                                   "off, --max-num-batched-tokens must be at least --max-model-len")
WATERMARK = flag("--watermark", SCHEDULER, type=float, default=0.0, metavar="F",
                 help="admit a waiting or preempted request while others run only if int(F * blocks) blocks stay free; "
                      "F in [0.0, 1.0) (default 0.0: off)")
MAX_NUM_SCHEDULED_TOKENS = flag("--max-num-scheduled-tokens", SCHEDULER, type=human_readable_int, default=None, metavar="N",
                                help="most tokens one step schedules, as 2048, 2k or 2K (default: --max-num-batched-tokens)")
MAX_NUM_ACTIVE_SEQS = flag("--max-num-active-seqs", SCHEDULER, type=int, default=None, metavar="N",
                           help="admit waiting requests only while fewer than N run; at most --max-num-seqs "
                                "(default: --max-num-seqs)")
PREFIX_MATCH_UNIT = flag("--prefix-match-unit", SCHEDULER, type=int, default=None, metavar="N",
                         help="vLLM's prefix-cache hit boundary: with one KV cache group, the block size (default: unset)")
PREFILL_SCHEDULE_INTERVAL = flag("--prefill-schedule-interval", SCHEDULER, type=int, default=1, metavar="N",
                                 help="vLLM's data-parallel prefill cadence: one engine never throttles (default %(default)s)")
# NOTE: vLLM enforces its queue limits in its API server process, as kvpool (frontend/engine/admission.py).
MAX_NUM_QUEUED_REQS = flag("--max-num-queued-reqs", FRONTEND, type=human_readable_int, default=None, metavar="N",
                           help="at most N engine requests in flight (n > 1 counts n); more are refused with 503, as vLLM "
                                "(default: no limit)")
MAX_NUM_QUEUED_TOKENS = flag("--max-num-queued-tokens", FRONTEND, type=human_readable_int, default=None, metavar="N",
                             help="at most N prompt tokens of requests still in prefill; more are refused with 503, as vLLM "
                                  "(default: no limit)")
DISABLE_HYBRID_KV_CACHE_MANAGER = flag("--disable-hybrid-kv-cache-manager", WORKER, action=ON_OFF, default=False,
                                       help="one full-attention KV-cache group for a model mixing sliding-window and full layers, "
                                            "as vLLM: no block is freed outside a window, but the layers still attend within "
                                            "theirs (default: off)")

# The scheduling policy's rows, which the simulator declares too (simulator/cli.py).
POLICY_ROWS = (SCHEDULING_POLICY, LONG_PREFILL_TOKEN_THRESHOLD, LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE, ENABLE_CHUNKED_PREFILL,
               WATERMARK, MAX_NUM_SCHEDULED_TOKENS, MAX_NUM_ACTIVE_SEQS)
ROWS = (*POLICY_ROWS, PREFIX_MATCH_UNIT, PREFILL_SCHEDULE_INTERVAL, MAX_NUM_QUEUED_REQS, MAX_NUM_QUEUED_TOKENS,
        DISABLE_HYBRID_KV_CACHE_MANAGER)
