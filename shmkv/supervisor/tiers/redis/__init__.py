"""``--remote URL``: the arena's records written behind to Redis / Valkey and fetched back
by other nodes (supervisor process, writer and fetch threads)."""
