"""Storage tier: backend interface, embedded LMDB store, distributed Redis store."""
