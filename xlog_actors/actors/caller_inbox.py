"""An actor inbox that lets the asker's own thread serve some asks while the actor is idle.

A pykka ask costs two thread wake-ups: the actor's, to serve it, and the asker's, to read the
reply. On virtual machines a sleeping thread takes tens of microseconds to wake, and with many
askers every wake-up also fights for the GIL, so aggregate throughput falls as askers are added.
Some messages need nothing of the actor's thread: a ``DeviceActor``'s ``Allocate`` runs through a
context that any thread may use (``DeviceClient`` does exactly that). For those, this inbox calls
a ``serve`` function in the asker's thread, and the reply is set before ``ask`` returns; no
thread sleeps or wakes. An isolated device's proxy and its parent-side library actors use it the
same way to forward an ask to the device's process from the asker's thread (``serve`` answers
nothing itself then: it sends the ask on, and the reply is set later by another thread).

Invariants (what keeps the actor's message order for each sender):

* ``serve`` runs only when nothing is queued and the actor is not serving a message it took.
  ``busy`` is set in ``_get``, under the queue's lock in the same step that takes a message, and
  cleared when the actor asks for its next message (``get``), so it has served everything it
  took. ``put`` reads the queue first and ``busy`` second: an asker that sees an empty queue and
  then an idle actor knows that every message it put before was served. Messages that other
  threads put meanwhile are concurrent with this one, and pykka orders nothing between senders.
* ``serve`` returns None when it answered the ask (or sent it on, to be answered elsewhere),
  else the envelope to queue: the one it was given, untouched (the actor must serve it: a
  refusal changes nothing), or another one for the actor to finish the answer (a
  ``DeviceActor`` queues the error an allocation met, so that its supervisor acts on it before
  the asker hears of it, as when its own handler raised).
* Only asks (an envelope with a reply) of ``types`` are offered to ``serve``; tells and every
  other message go through the queue.
* A queue that holds only *wake-ups* (tells of ``wake_types``: a ``DeviceActor``'s ``Reclaim``,
  which asks it to free the blocks of dropped handles) counts as empty: a wake-up orders nothing
  for any sender, and ``serve`` does what it asks before it serves (it frees the dropped handles
  itself), so the actor, waking later, finds nothing left to do. For the same reason an actor
  that serves a wake-up counts as idle (``busy_wake``): everything put before the wake-up was
  served before the actor took it, and the wake-up's work (freeing dropped handles) is safe
  beside ``serve``'s. Without this, an asker that drops handles between its asks (every
  ``AllocateMany`` loop) found the woken actor busy with their wake-up now and then, and its ask
  took the actor's two thread hops instead.

Thread rule: any thread puts; ``get`` and ``_get`` run on the actor's thread; ``serve`` runs on
the putting thread and must be safe there. No lock is held while ``serve`` runs. A garbage
collector's finalizer tells its wake-ups through :meth:`CallerServedInbox.put_wake`, which never
waits for long on the queue's lock: a collection may start inside a section of that very lock on
the very thread (a ``get`` allocates its waiter there), where ``put`` would wait forever.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any, Final

import pykka
from pykka._envelope import Envelope

__all__ = ["WAKE_LOCK_WAIT_S", "CallerServedInbox", "send_wake"]

#: How long a wake-up waits at most for an inbox's lock, in seconds (see :func:`send_wake`).
WAKE_LOCK_WAIT_S: Final = 0.1


class CallerServedInbox(queue.Queue):  # type: ignore[type-arg]
    """A ``queue.Queue`` of pykka envelopes whose asks of ``types`` the asker's thread may serve
    (see the module docstring).

    Thread rule: any thread puts; the actor's thread gets.
    """

    def __init__(self) -> None:
        super().__init__()
        self.busy = False
        self.busy_wake = False  # what the actor took last is a wake-up (see the module docstring)
        self.types: tuple[type, ...] = ()
        self.wake_types: tuple[type, ...] = ()
        self.serve: Callable[[Any], Any] | None = None  # set once the actor can be served this way

    def serve_in_caller(
        self, types: tuple[type, ...], serve: Callable[[Any], Any] | None, wake_types: tuple[type, ...] = ()
    ) -> None:
        """Offer asks of ``types`` to ``serve(envelope)``, which answers ``envelope.reply_to`` and
        returns None, or returns the envelope to queue instead (see the module docstring);
        ``serve=None`` stops offering.

        Args:
            types: the message types (exact types, not subclasses).
            serve: the function, or None.
            wake_types: the told messages a queue may hold and still count as empty (wake-ups
                whose work ``serve`` does first; see the module docstring).
        Thread rule: any thread.
        """
        self.types = types
        self.wake_types = wake_types
        self.serve = serve

    def _get(self) -> Any:
        # Under the queue's lock, and before the take: a ``put`` that sees the message gone sees
        # the marks of its taking.
        head = self.queue[0]
        self.busy_wake = head.reply_to is None and type(head.message) in self.wake_types
        self.busy = True
        return super()._get()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next message (``queue.Queue.get``); the actor asking for it has served every one it
        took before. Thread rule: the actor's thread."""
        self.busy = False
        return super().get(block, timeout)

    def quiet(self) -> bool:
        """Nothing waits in the queue and the actor serves nothing: every message put before this
        call was served (read in that order: see the module docstring). Thread rule: any thread."""
        return not self.queue and not self.busy

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Serve ``item`` in this thread when the module docstring's conditions hold, else queue
        it. Thread rule: any thread."""
        serve = self.serve
        if (serve is not None and item.reply_to is not None and type(item.message) in self.types
                and (not self.queue or self._only_wakes()) and (not self.busy or self.busy_wake)):
            item = serve(item)
            if item is None:
                return
        super().put(item, block, timeout)

    def put_wake(self, message: Any, timeout_s: float) -> bool:
        """Queue the told wake-up ``message`` (as ``tell`` does, after the caller's ``is_alive``
        check), waiting at most ``timeout_s`` for the queue's lock.

        Returns:
            True when queued; False when the lock stayed taken (by this very thread: a garbage
            collection started inside a section of the queue and runs the finalizer that wakes),
            and nothing was queued.
        Thread rule: any thread, a garbage collector's finalizer included.
        """
        if not self.mutex.acquire(timeout=timeout_s):
            return False
        try:
            # What ``queue.Queue.put`` does under the lock for an unbounded queue.
            self._put(Envelope(message))
            self.unfinished_tasks += 1
            self.not_empty.notify()
        finally:
            self.mutex.release()
        return True

    def _only_wakes(self) -> bool:
        # Under the queue's lock: the deque must not change while it is read.
        wakes = self.wake_types
        if not wakes:
            return False
        with self.mutex:
            return all(e.reply_to is None and type(e.message) in wakes for e in self.queue)


def send_wake(actor_ref: pykka.ActorRef[Any], message: Any) -> bool:
    """Tell ``actor_ref`` the wake-up ``message`` from any thread, a garbage collector's finalizer
    included: through :meth:`CallerServedInbox.put_wake` (waiting at most
    :data:`WAKE_LOCK_WAIT_S` for the inbox's lock), or ``tell`` for another inbox.

    Returns:
        True when sent; False when the inbox's lock stayed taken (by this very thread: a
        collection started inside a section of it) and nothing was sent.
    Raises:
        pykka.ActorDeadError: the actor was stopped (as ``tell`` raises).
    Thread rule: any thread.
    """
    inbox = actor_ref.actor_inbox
    if not isinstance(inbox, CallerServedInbox):
        actor_ref.tell(message)
        return True
    if not actor_ref.is_alive():
        raise pykka.ActorDeadError(f"{actor_ref} not found")
    return inbox.put_wake(message, WAKE_LOCK_WAIT_S)
