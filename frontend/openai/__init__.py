"""The OpenAI endpoints' handlers (vLLM's ``OpenAIServing*``): what they share
(``ServingContext``), completions, chat, render, and the logprobs and output log they answer with."""
