"""The scheduler process: the engine core's loops, the worker link, sockets, config,
metrics, HTTP and the KV-event publisher."""
