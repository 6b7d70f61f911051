"""Engine process loop, worker protocol and reference runners.

``Engine`` (core.py) is the embedding API; ``engine.main`` and ``worker.main`` are the
engine and worker process entry points; ``protocol`` converts steps to and from messages;
``worker_api`` is the worker contract for a deployment's own workers (docs/WORKER_API.md).
"""
from fastkv.engine.core import Engine, EngineError, EngineStopped, RequestRejected, RequestResult, StepUpdate
from fastkv.engine.sampling import Sampling

__all__ = ["Engine", "EngineError", "EngineStopped", "RequestRejected", "RequestResult", "Sampling", "StepUpdate"]
