"""Engine process loop, worker protocol and reference runners.

``Engine`` (core.py) is the embedding API; ``engine.main`` and ``worker.main`` are the
engine and worker process entry points; ``protocol`` converts steps to and from messages.

``Engine`` is exported lazily: the scheduler imports ``fastkv.engine.step`` and the engine
core imports the scheduler, so an eager import here would make ``import fastkv.sched``
circular.
"""

__all__ = ["Engine", "EngineError", "RequestRejected", "RequestResult"]


def __getattr__(name: str):
    if name in __all__:
        from fastkv.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'fastkv.engine' has no attribute {name!r}")
