"""The model side of a replica: checkpoint loading and the runner that owns the KV cache."""
