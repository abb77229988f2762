"""The worker process: it owns the KV memory and runs the scheduler's plans in step order.

The process itself at the root (``__main__``, ``config``, ``startup``, the link to the
scheduler ``scheduler_link`` and the ``process`` loop, ``metrics``) and, for now, the step
(``runner``, its plan checks and block tables); its rooms: ``load/``
(the checkpoint and the model served), ``models/``, ``kv/`` (the KV cache's memory),
``attention/``, ``sample/``, ``cpu/`` (the host's cores and C libraries), ``parallel/``
(tensor parallelism), ``external/`` and ``transfer/`` (the external tier's and P/D's I/O),
``tiny/`` (the built-in test models).
"""
