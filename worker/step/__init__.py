"""One step of the worker: check the plan, apply its deltas to the block tables (one per
KV-cache group), prepare the step's inputs and run the model through the paged cache."""
