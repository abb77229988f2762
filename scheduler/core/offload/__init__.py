"""KV beyond the device pool: the host tier (``--kv-offloading-size``) and the connector
that decides what goes there, and the external tier (disk, Mooncake Store) with its index."""
