"""The server's edge, outermost first: where it listens (TCP, a Unix socket, TLS), the
middlewares vLLM stacks (X-Request-Id, the API key, CORS, errors and HTTP metrics), the
access log, and a request's body read and decoded."""
