"""kvpool's load generator: datasets, a streaming zmq client, a vLLM-bench-style report.

Run it as `python -m loadgen` (or `kvpool-loadgen`); `loadgen.datasets.expand_hash_ids`
is the Mooncake prompt expansion the offline simulator shares.
"""
