"""What a request and an error are: the OpenAI request bodies as msgspec Structs, the
table of every vLLM request field and what kvpool does with it, and OpenAI's error object."""
