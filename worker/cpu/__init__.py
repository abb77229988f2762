"""The CPU host: the small C libraries, the thread count and priority of torch's ops, and who else keeps the host's cores busy."""
