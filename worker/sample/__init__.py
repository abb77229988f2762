"""Sampling: the batched sampler, each row's parameters and logits processors, structured-output grammars, prompt logprobs."""
