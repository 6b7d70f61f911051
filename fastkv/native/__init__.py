"""fastkv's C extensions (setup.py's ``ext_modules``: shared-memory atomics, the message codec,
block keys, the block pool's loops, the synthetic runner's rows) and their loader
(``compiled``). The lowest layer: it imports nothing else of fastkv."""
