"""A stand-in for the ``vllm`` package: kvpool's classes under vLLM's module names, so
that vLLM's own tests of its KV-cache core (tests/v1/core) run against kvpool.

Put on sys.path only by tests/vllm_core/run.py, in a process of its own: never in the
suite's. A module here maps what kvpool has; every other vLLM name resolves to a stub
(``unmapped.py``) that raises NotMapped when used, and the run counts that test as not
runnable, with the name as the reason.
"""
