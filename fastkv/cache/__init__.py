"""Block pools, LRU free queues, chained keys, the prefix index across tiers, tier policies."""
