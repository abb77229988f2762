"""When `kvpool serve` restarts a child that exited (the worker, the scheduler, the
frontend: one policy each), and when it gives up.

As a supervisor does (systemd's ``StartLimitIntervalSec``/``StartLimitBurst``): the
child is restarted after a doubling back-off (1, 2, 4, ... s, at most 30), and after
``max_restarts`` exits *in a row* kvpool serve gives up, saying why. A child that served
for ``healthy_s`` since its start wipes the slate: its exit is the first of a new run,
so a server that has run for a week is not ended by an ordinary crash.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF_S = 30.0
# NOTE: long enough that a worker dying at start-up (bad flags, out of memory) never
# counts as healthy: its start-up takes seconds, and the back-off reaches 16 s by the 5th try.
HEALTHY_S = 60.0


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int
    healthy_s: float = HEALTHY_S
    # The child, as the give-up message names it.
    name: str = "worker"
    # Exits in a row, each within healthy_s of its start.
    restarts: int = 0

    def after_exit(self, ran_s: float) -> float | None:
        """The back-off before restarting a child that ran ``ran_s`` seconds, or None
        to give up (`why_give_up` says why)."""
        if ran_s >= self.healthy_s:
            self.restarts = 0
        if self.restarts >= self.max_restarts:
            return None
        delay = min(2.0**self.restarts, MAX_BACKOFF_S)
        self.restarts += 1
        return delay

    def why_give_up(self) -> str:
        return (
            f"the {self.name} exited {self.restarts + 1} times in a row, each within {self.healthy_s:g} s of its start "
            f"(--{self.name}-restarts {self.max_restarts}); giving up"
        )
