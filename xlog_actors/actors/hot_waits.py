"""Waits that spin before they block, for library actors and for those who ask them.

On the GPU machines a thread that blocked for a while takes 150 to 230 µs to run again once woken,
then runs slowly for a while (docs/performance.md, "Where a copy row's time goes"): an actor that
sleeps between two messages of a pipeline pays that on each one, and so does a caller that sleeps
through a short reply. CUDA's synchronize spins instead; these do the same, for a bounded time,
with the GIL released (``_core.doorbell``), then block the ordinary way.

* :class:`SpinningInbox`: a library actor's inbox. After each message the actor looks for the
  next one for up to ``INBOX_SPIN_S`` before it sleeps. It also counts the messages put and not
  yet served, which tells an asker when it may serve its own ask (:mod:`.served_ref`).
* :class:`SpinningFuture`: the future of an ask to a library actor. ``get`` spins up to
  ``FUTURE_SPIN_S`` before it waits on the condition; a ``get`` with a timeout spins no longer
  than that timeout.

Spinning costs a core while it lasts (yielded to any other runnable thread on every turn). Both
bounds are module constants; a machine with fewer than :data:`MIN_CORES` cores does not spin
(the spinner would take turns from the threads doing the work).

Thread rule: an inbox is put to by any thread and read by its actor's thread; a future is set
once by the actor's thread and read by any.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import pykka

from .._core.doorbell import Doorbell

__all__ = ["CORES", "FUTURE_SPIN_S", "INBOX_SPIN_S", "MIN_CORES", "SpinningFuture", "SpinningInbox", "spin_budget"]

#: How long an idle library actor looks for its next message before it sleeps.
INBOX_SPIN_S = 0.001
#: How long a caller waits for a library actor's reply by spinning before it sleeps.
FUTURE_SPIN_S = 0.010
#: Below this many cores, nothing spins.
MIN_CORES = 4


#: The machine's cores, read once: ``os.cpu_count()`` reads a file on Linux (a few µs), and an
#: ask to a library actor asks for its budget every time.
CORES = os.cpu_count() or 1


def spin_budget(seconds: float) -> float:
    """``seconds``, or 0 on a machine with fewer than :data:`MIN_CORES` cores (:data:`CORES`).
    Thread rule: any thread."""
    return seconds if CORES >= MIN_CORES else 0.0


class SpinningInbox(queue.SimpleQueue):  # type: ignore[type-arg]
    """A library actor's inbox (pykka's ``_create_actor_inbox``): a ``SimpleQueue`` whose blocking
    ``get`` first spins up to ``spin_s`` for a message. See the module docstring.

    Thread rule: ``put`` from any thread; ``get`` from the actor's thread.
    """

    def __init__(self, spin_s: float) -> None:
        """Args:
            spin_s: the longest spin of one ``get`` before it blocks; 0 never spins.
        """
        super().__init__()
        self._bell = Doorbell()
        self._spin_s = spin_s
        self._count_lock = threading.Lock()
        self._unserved = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Count ``item`` as unserved, queue it (never blocks: ``block`` and ``timeout`` are the
        queue's signature only) and ring the bell."""
        self.put_unrung(item).ring()

    def put_unrung(self, item: Any) -> Doorbell:
        """Count ``item`` as unserved and queue it, without ringing (:meth:`put` rings): the caller
        rings the returned bell once it lets go of the GIL (``fdwait.wait_readable``'s or
        ``CallLane.wait``'s ``bell``). Rung while the ringer keeps the GIL, the actor leaves its
        spin only to wait for the GIL (a futex sleep and wake: on a VM, tens to hundreds of µs);
        rung right after the ringer let it go, the actor takes it at once. Unrung, the actor
        still finds ``item`` when its spin ends.

        Returns:
            the inbox's bell, for the caller to ring.
        Thread rule: any thread.
        """
        with self._count_lock:
            self._unserved += 1
        super().put(item)
        return self._bell

    def served(self) -> None:
        """The actor served one message it took: the unserved count goes down.
        Thread rule: the actor's thread, after the message's handler returned."""
        with self._count_lock:
            self._unserved -= 1

    def unserved(self) -> int:
        """Messages put and not yet served (taken ones included; those a stopped actor's
        teardown answered stay counted). Zero means every message put before this call was
        served (``served_ref``). Thread rule: any thread."""
        return self._unserved

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item; a blocking ``get`` spins up to ``spin_s`` before it sleeps.

        Raises:
            queue.Empty: non-blocking, or a timeout, and nothing came.
        """
        if block and self._spin_s > 0:
            seen = self._bell.count
            try:
                return self.get_nowait()
            except queue.Empty:
                pass
            spin = self._spin_s if timeout is None else min(self._spin_s, timeout)
            if self._bell.wait(seen, spin):
                try:
                    return self.get_nowait()
                except queue.Empty:
                    pass  # another reader took it: this inbox has one, so only a race in tests
        return self._sleep_get(block, timeout)

    def _sleep_get(self, block: bool, timeout: float | None) -> Any:
        # The queue's own get: blocks (sleeps) until an item comes.
        return super().get(block, timeout)


class SpinningFuture(pykka.ThreadingFuture[Any]):
    """The future of an ask to a library actor (pykka's ``_create_future``): ``get`` spins up to
    ``spin_s`` for the reply before it waits on the condition. See the module docstring.

    Thread rule: set once by the actor's thread; ``get`` from any thread.
    """

    def __init__(self, spin_s: float | None = None) -> None:
        """Args:
            spin_s: the longest spin of a ``get`` before it blocks; 0 never spins; None (what
                pykka's own ``self.__class__()`` gives, for the futures it derives) is
                ``spin_budget(FUTURE_SPIN_S)``.
        """
        super().__init__()
        self._bell = Doorbell()
        self._spin_s = spin_budget(FUTURE_SPIN_S) if spin_s is None else spin_s

    def set(self, value: Any | None = None) -> None:
        """Set the reply and ring. Raises ``queue.Full`` when already set (pykka's rule)."""
        super().set(value)
        self._bell.ring()

    def set_exception(self, exc_info: Any | None = None) -> None:
        """Set the error (the one being handled when ``exc_info`` is None) and ring."""
        super().set_exception(exc_info)
        self._bell.ring()

    def fill(self, value: Any = None, exc_info: Any | None = None) -> Doorbell:
        """Set the reply (``value``), or the error when ``exc_info`` is given, *without* ringing,
        and return the bell the caller must ring (``ring()``, or ``_core.fdwait.wait_readable``,
        which rings it once the GIL is released, so the woken getter takes the GIL at once). A
        getter that already sleeps on the condition is woken by the set itself.
        Thread rule: the one thread that answers this future."""
        if exc_info is None:
            pykka.ThreadingFuture.set(self, value)
        else:
            pykka.ThreadingFuture.set_exception(self, exc_info)
        return self._bell

    def get(self, *, timeout: float | None = None) -> Any:
        """The reply, or its error raised; spins up to ``spin_s`` (and no longer than ``timeout``)
        before it blocks. Raises what ``ThreadingFuture.get`` raises (``pykka.Timeout`` included)."""
        if self._spin_s > 0 and self._result is None and self._get_hook is None:
            self._bell.wait(0, self._spin_s if timeout is None else min(self._spin_s, timeout))
        return super().get(timeout=timeout)
