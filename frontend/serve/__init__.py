"""``kvpool serve``, the supervisor: reads ``vllm serve``'s flags into one frozen
``ServeConfig``, starts the scheduler, the worker and the API server with the argv the
flag table gives each, waits until all three are ready and restarts a child that exits."""
