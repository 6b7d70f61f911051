"""Engine process loop, worker protocol and reference runners.

``Engine`` (core.py) is the embedding API; ``engine.main`` and ``worker.main`` are the
engine and worker process entry points; ``protocol`` converts steps to and from messages.
"""
from fastkv.engine.core import Engine, EngineError, RequestRejected, RequestResult

__all__ = ["Engine", "EngineError", "RequestRejected", "RequestResult"]
