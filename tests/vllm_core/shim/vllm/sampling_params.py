"""vLLM's SamplingParams, as far as the core's tests read it: nothing but prompt_logprobs."""

from vllm.unmapped import module_getattr

__getattr__ = module_getattr(__name__)


class SamplingParams:
    def __init__(self, max_tokens: int = 16, prompt_logprobs: int | None = None, **kwargs):
        self.max_tokens = max_tokens
        self.prompt_logprobs = prompt_logprobs

    def update_from_generation_config(self, generation_config, eos_token_id=None) -> None:
        pass
