"""Text in and out: the tokenizer, the chat template and the messages it renders, prompt
truncation, and incremental detokenization with stop strings."""
