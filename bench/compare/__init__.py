"""``make compare``: kvpool beside vLLM itself (docs/compare.md).

The harness (``python -m bench.compare``: ``__main__``, its flags in ``cli``, its runs in
``runs``), the pieces it and the other harnesses share (``checkpoints``, ``servers``,
``workloads``), the rows it adds (``metrics``, ``offline`` with ``vllm_offline``,
``lm_eval_tasks``), its table (``report``), and the speed matrix (``python -m
bench.compare.speed``, its table in ``speed_report``).
"""
