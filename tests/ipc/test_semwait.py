"""A stop raised by a signal handler inside a semaphore wait survives posix_ipc, which replaces
whatever a handler raises there (KeyboardInterrupt aside) with its own SignalError."""
from __future__ import annotations

import signal
import threading

import posix_ipc
import pytest

from fastkv.ipc.semwait import acquire, clear_stop, raise_stop
from tests.conftest import shm_test_name


class Stopped(SystemExit):
    pass


@pytest.fixture
def sem():
    s = posix_ipc.Semaphore("/" + shm_test_name(), posix_ipc.O_CREX, initial_value=0)
    yield s
    s.unlink()
    s.close()


def _interrupt_wait_with(handler) -> None:
    """Sends SIGUSR1 to this (main) thread while it waits on a semaphore."""
    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)
        clear_stop()


def test_posix_ipc_swallows_a_handlers_exception(sem):
    def handler(*_):
        raise Stopped("stop")

    for _ in _interrupt_wait_with(handler):
        with pytest.raises(posix_ipc.SignalError):
            sem.acquire(5)


def test_acquire_raises_the_stop_again(sem):
    def handler(*_):
        raise_stop(Stopped("stop"))

    for _ in _interrupt_wait_with(handler):
        with pytest.raises(Stopped):
            acquire(sem, 5)


def test_a_handler_that_returns_is_a_wake_up_and_a_post_is_taken(sem):
    for _ in _interrupt_wait_with(lambda *_: None):
        assert acquire(sem, 5) is False
    assert acquire(sem, 0.01) is False
    sem.release()
    assert acquire(sem, 0.01) is True
