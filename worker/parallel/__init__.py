"""Tensor parallelism: the rank group, the plan fan-out from rank 0, and the sharded layers."""
