"""Copy tasks, the per-rank cache-transfer process, and the engine-side client."""
