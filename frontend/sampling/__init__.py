"""A request's engine parameters: sampling, logits fields and structured outputs, checked
with vLLM's words and turned into the scheduler's ``Generate`` fields."""
