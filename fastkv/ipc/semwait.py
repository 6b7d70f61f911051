"""Semaphore waits that do not lose a stop signal.

posix_ipc answers a wait interrupted by a signal (EINTR) by running the pending Python signal
handlers and then replacing whatever they raised, unless it is KeyboardInterrupt, with its own
``SignalError``. A SIGTERM handler that raises SystemExit to unwind a run (``fastkv.launch``)
would vanish inside any wait and the run would go on. So such a handler raises through
``raise_stop``, which keeps the exception, and ``acquire`` raises it again where posix_ipc
swallowed it.
"""
from __future__ import annotations

import posix_ipc

_pending: BaseException | None = None


def raise_stop(exc: BaseException) -> None:
    """Raise ``exc`` from a signal handler; a semaphore wait it interrupts raises it too."""
    global _pending
    _pending = exc
    raise exc


def clear_stop() -> None:
    """The stop has unwound to its handler's owner: later interrupted waits are plain wake-ups."""
    global _pending
    _pending = None


def acquire(sem: posix_ipc.Semaphore, timeout: float | None) -> bool:
    """``sem.acquire(timeout)``: True when taken, False on a timeout or an interruption (look
    again); the stop exception of a handler that posix_ipc swallowed is raised."""
    global _pending
    try:
        sem.acquire(timeout)
    except posix_ipc.BusyError:
        return False
    except posix_ipc.SignalError:
        exc, _pending = _pending, None
        if exc is not None:
            raise exc from None
        return False
    return True
