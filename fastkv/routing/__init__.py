"""KV-aware routing: the block keys a router computes from a prompt, and a reference indexer
that learns from the engines' KV events which engine holds which keys in which tier.

Needs no engine and no Paddle: ``block_hashes`` runs fastkv's own key derivation
(fastkv.cache.keys), so a router's keys are the engine's by construction.
"""
from fastkv.routing.keys import block_hashes, namespace_for

__all__ = ["block_hashes", "namespace_for"]
