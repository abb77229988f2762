"""The routes the server adds beside the OpenAI handlers, each module a list of
(method, path, handler) built from what it uses: vLLM's operator routes, cache pins,
vllm-router's probes, SageMaker, the tokenizer info and the docs pages."""
