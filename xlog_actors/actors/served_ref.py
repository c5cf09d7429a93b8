"""The ``ActorRef`` of a library actor: a blocking ask is served in the asker's own thread while
the actor is idle.

A blocking ask holds its asker until the reply comes whichever thread does the work. Through the
actor it also costs two thread hops, the actor's wake-up and then the asker's, and on the GPU
machines a thread that slept takes tens to hundreds of microseconds to run again: a 256 MiB copy
asked and then synchronized lost 4 to 8% of its bandwidth to them (docs/performance.md, the copy
rows). Served in the asker's thread, the work runs exactly as the actor would run it, with no hop.

A *blocking* ask is served this way: its asker waits for the reply in any case. A non-blocking
ask (a pipeline's orchestrator keeping several batches in flight) must return at once, so it is
served in the asker's thread only when its handler never waits, only enqueues device work (a
launch, a fill, a copy from or into pinned memory on a tracked stack: the actor's
:meth:`~CallerServer.posts_in_caller` says which): then the handler takes about as long as
putting the message in the inbox and waking the actor would, and the answer is posted at once
(``pykka_internals.ask_posting``, which posts its answers on a queue). Any other non-blocking ask
goes through the inbox, because a handler may take long (a ``CopyToHost`` into pageable memory
synchronizes the actor's stream). So does an ask with a timeout: a handler running in the asker's
thread cannot be abandoned when the timeout passes.

Invariants (kept by :class:`ServedRef` and the library actor's loop together):

* **One handler at a time.** The actor holds its ``exclusive`` lock for every message it serves
  (its stop and its ``on_start`` included), and an asker serves only while holding it. A library
  actor's state therefore has one user at a time, whichever thread that is.
* **A sender's order.** The inbox counts messages put and not yet served
  (:meth:`.hot_waits.SpinningInbox.unserved`): the count goes up before the message is queued and
  down only after its handler returned. An asker serves only when, holding ``exclusive``, it reads
  zero: every message put before its ask, its own earlier ones included, has then been served.
* **Never a wait.** The asker tries ``exclusive`` without blocking. When the actor or another
  asker is serving, or a message is queued, or the actor has not started or has stopped, the ask
  goes through the inbox as any pykka ask does, with the same result.

Thread rule: any thread asks; see :class:`ServedRef`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pykka

__all__ = ["NOT_SERVED", "CallerServer", "ServedRef"]


class _NotServed:
    """The type of :data:`NOT_SERVED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_SERVED"


#: What :meth:`CallerServer.serve_in_caller` returns when the ask must go through the inbox.
NOT_SERVED: Any = _NotServed()


class CallerServer(Protocol):
    """What a :class:`ServedRef`'s actor offers (``LibraryActor`` implements it)."""

    #: The message types a blocking ask may be served for in the asker's thread (exact types).
    caller_served: tuple[type, ...]

    def serve_in_caller(self, message: Any) -> Any:
        """Serve ``message`` in this thread when the module docstring's conditions hold: its
        reply (or its error, raised), else :data:`NOT_SERVED`. Thread rule: any thread."""

    def posts_in_caller(self, message: Any) -> bool:
        """Whether ``message``'s handler only enqueues work (never waits), so a non-blocking ask
        of it may be served in the asker's thread. Thread rule: any thread."""


class ServedRef(pykka.ActorRef[Any]):
    """A pykka ``ActorRef`` whose blocking asks with no timeout, of the actor's
    ``caller_served`` types, are served in the asker's thread while the actor is idle (see the
    module docstring); everything else is pykka's.

    Thread rule: any thread, as any ``ActorRef``.
    """

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """pykka's ``ask``, served in this thread when it may be (see the module docstring).

        Args:
            message: the message.
            block: False returns a future at once (always through the inbox).
            timeout: seconds to wait for the reply; an ask with one goes through the inbox.
        Returns:
            the reply, or (``block=False``) a future of it.
        Raises:
            the reply's error, ``pykka.ActorDeadError`` for a stopped actor, ``pykka.Timeout``:
            as pykka's ``ask``.
        Thread rule: any thread.
        """
        if block and timeout is None:
            actor: CallerServer | None = self._actor_weakref()
            if actor is not None and type(message) in actor.caller_served:
                reply = actor.serve_in_caller(message)
                if reply is not NOT_SERVED:
                    return reply
        return super().ask(message, block=block, timeout=timeout)

    def serve_posted(self, message: Any) -> Any:
        """Serve a non-blocking ask of ``message`` in this thread when its handler only enqueues
        work and the actor is idle (see the module docstring).

        Args:
            message: the message.
        Returns:
            the reply, or :data:`NOT_SERVED` (the ask must go through the inbox).
        Raises:
            the handler's error, as the actor would answer it.
        Thread rule: any thread.
        """
        actor: CallerServer | None = self._actor_weakref()
        if actor is None or not actor.posts_in_caller(message):
            return NOT_SERVED
        return actor.serve_in_caller(message)

    def serve_here(self, message: Any) -> Any:
        """Serve ``message`` in this thread while the actor is idle, whatever its type and
        whether its handler waits: for an asker that is the actor's only one and waits in any
        case (an isolated device's frame reader, ``shared_copy.EnqueueShared``).

        Args:
            message: the message.
        Returns:
            the reply, or :data:`NOT_SERVED` (the ask must go through the inbox).
        Raises:
            the handler's error, as the actor would answer it.
        Thread rule: any thread.
        """
        actor: CallerServer | None = self._actor_weakref()
        if actor is None:
            return NOT_SERVED
        return actor.serve_in_caller(message)

    def serve_posts_with(self, server: Callable[[Any], Any]) -> None:
        """Serve posted asks through ``server`` from now on: a compiled equivalent of
        :meth:`serve_posted` that takes this method (as bound before the call) for whatever it
        does not serve itself (``LibraryActor`` gives its ``PostedServe``).

        Args:
            server: ``server(message)`` returns what :meth:`serve_posted` would.
        Thread rule: the actor's constructor, before the ref is handed out.
        """
        self.serve_posted = server  # type: ignore[method-assign,assignment]
