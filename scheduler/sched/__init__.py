"""The scheduling policy: requests, the scheduler (running first, FCFS admission,
chunked prefill, preemption by recompute), step outputs and request validation.
Imports ``scheduler.core`` and ``protocol/``."""
