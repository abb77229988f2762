"""The OpenAI-compatible frontend process: tokenizer, chat template, incremental
detokenizer, the HTTP API server and the `kvpool serve` launcher (DESIGN.md, Layout).

Imports only `protocol/` of the project, and never torch or transformers."""
