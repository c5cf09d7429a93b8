"""``LatchFuture``: the future of every ``DeviceActor`` ask, a ``pykka.Future`` on one lock.

Invariants: the latch (a ``_thread.lock``) is held from the future's making until its one result
(or get hook) is in; it is released exactly once, and a ``get`` returns only once it is open, so
a result filled but not yet released (:meth:`LatchFuture.fill`, used by the batching loop of
``pykka_internals`` to wake a batch's askers together) is never read early.

What it borrows from pykka (checked by ``tests/actors/test_latch_future.py``): ``ActorRef.ask``
(and ``stop``, and the proxies) makes each ask's future with the actor class's static
``_create_future()``; ``pykka.Future`` keeps a derived future's hook in ``._get_hook`` (None until
``set_get_hook``), and its ``map``, ``join``, ``filter`` and ``reduce`` make the derived future
with ``self.__class__()``.

Thread rule: set once, by one thread (the actor's, or the asker's for a dead actor); ``get`` from
any number of threads.
"""

from __future__ import annotations

import _thread
import queue
import sys
from typing import Any, NamedTuple

import pykka

__all__ = ["LatchFuture"]


class _Result(NamedTuple):
    value: Any
    exc_info: Any  # a (type, value, traceback) triple, or None for a value


class LatchFuture(pykka.Future[Any]):
    """A ``pykka.Future`` for asks answered from another thread, with one lock for all its
    synchronization: the lock is taken when the future is made and released, once, by ``set``,
    ``set_exception`` or ``set_get_hook`` (or by whoever called :meth:`fill`); a ``get`` takes
    it and gives it back at once (so any number of ``get``s pass once it is open).

    ``pykka.ThreadingFuture`` builds a ``threading.Condition`` (a reentrant lock, two lists) per
    future, and its ``get`` raises and catches an exception, takes the condition and allocates a
    waiter lock; every ask of a device pays that twice over on the GIL, the asker's half and the
    actor's. This one does what a ``get`` and a ``set`` need with one lock allocation, one
    release (the wake-up, as the condition's notify) and one acquire. Its behaviour is pykka's:
    ``set`` twice, or ``set`` after ``set_get_hook``, raises ``queue.Full``; ``get(timeout=...)``
    raises ``pykka.Timeout``; pykka's derived futures (``map``, ``join``, ``filter``, ``reduce``,
    an actor's ``stop``) are of this class through ``self.__class__()`` and ``set_get_hook``.

    Thread rule: set once (by one thread: the actor's, or the asker's for a dead actor);
    ``get`` from any number of threads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._latch = _thread.allocate_lock()
        self._latch.acquire()
        self._result: _Result | None = None

    def get(self, *, timeout: float | None = None) -> Any:
        """The value set, or the error set raised (with its traceback).

        Args:
            timeout: the longest wait in seconds; None waits for as long as it takes.
        Returns:
            the value.
        Raises:
            pykka.Timeout: nothing was set within ``timeout``.
            BaseException: the error the actor raised.
        Thread rule: any thread.
        """
        if self._get_hook is None:
            # The latch, not the result, says the reply is in: a batch fills its replies first
            # and opens their latches when it ends (DEFER_WAKES).
            latch = self._latch
            if not latch.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
                raise pykka.Timeout(f"{timeout} seconds")
            latch.release()
        if self._get_hook is not None:
            return super().get(timeout=timeout)
        result = self._result
        assert result is not None  # the latch opens only after a result or a hook was set
        if result.exc_info is None:
            return result.value
        exc_type, exc_value, exc_traceback = result.exc_info
        if exc_value is None:
            exc_value = exc_type()
        if exc_value.__traceback__ is not exc_traceback:
            raise exc_value.with_traceback(exc_traceback)
        raise exc_value

    def set(self, value: Any | None = None) -> None:
        """Set the value and wake every ``get``.

        Raises:
            queue.Full: a result or a get hook was already set.
        Thread rule: one setter (see the class).
        """
        self._open(_Result(value, None))

    def set_exception(self, exc_info: Any | None = None) -> None:
        """Set the error (``sys.exc_info()`` when ``exc_info`` is None) and wake every ``get``.

        Raises:
            queue.Full: a result or a get hook was already set.
        Thread rule: one setter (see the class).
        """
        self._open(_Result(None, sys.exc_info() if exc_info is None else exc_info))

    def set_get_hook(self, func: Any) -> None:
        """pykka's hook for derived futures: ``get`` returns ``func(timeout)``.

        Raises:
            queue.Full: a result was already set.
        Thread rule: one setter (see the class).
        """
        if self._result is not None or self._get_hook is not None:
            raise queue.Full
        super().set_get_hook(func)
        self._latch.release()

    def _open(self, result: _Result) -> None:
        self._fill(result).release()

    def fill(self, value: Any) -> Any:
        """Set the value without waking anybody; whoever calls this must release the lock it
        returns, once (the batching loop of ``pykka_internals``, when its batch ends).

        Args:
            value: the reply.
        Returns:
            the latch (a ``_thread.lock``) to release.
        Raises:
            queue.Full: a result or a get hook was already set.
        Thread rule: one setter (see the class).
        """
        return self._fill(_Result(value, None))

    def _fill(self, result: _Result) -> Any:
        if self._result is not None or self._get_hook is not None:
            raise queue.Full
        self._result = result
        return self._latch
