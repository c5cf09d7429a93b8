"""What the runtime borrows from pykka's internals, in one place.

pykka (4.x) stops an actor whose handler raised on a *told* message, and keeps each envelope and
reply alive until the next message has been handled. Neither suits a device runtime: an actor
that owns a device must outlive a bad message, and a reply's ``GpuRef``s must be dropped as soon
as the asker drops them (a ``GetStats`` sent right after would otherwise still count them). Both
behaviours live in pykka's private message loop, so :class:`ResilientActor` replaces that loop.
It borrows, from the installed pykka:

* ``Actor._actor_loop_running``: the loop it overrides, copied with three changes (a told
  message that raises goes to :meth:`ResilientActor.on_told_failure` instead of stopping the
  actor; the envelope and the reply are dropped as soon as the reply is set; messages of
  :attr:`ResilientActor.batch_types` queued together are served in one wake-up);
* ``Actor._handle_receive(message)``: pykka's dispatch of stop and proxy messages, then
  ``on_receive``;
* ``Actor._stop()`` and ``ActorRegistry.stop_all()``: what pykka does on a ``BaseException``
  (kept unchanged);
* the inbox's envelopes: ``.message``, and ``.reply_to``, a future with ``set(value)`` and
  ``set_exception()`` (None for a ``tell``);
* for batched service (:attr:`ResilientActor.batch_types`), the inbox itself: pykka's
  ``ThreadingActor`` inbox is a ``queue.Queue`` of envelopes, and the loop reads the envelopes
  waiting at its head through the standard library's ``queue.Queue`` attributes ``.mutex``
  (the lock every ``put``/``get`` holds), ``.queue`` (the ``collections.deque`` of waiting
  items, oldest first) and ``.not_full`` (the condition a ``get`` notifies), as ``Queue.get``
  itself does under that lock. Envelopes it took but could not serve because the actor stopped
  are put back at the head, so pykka's ``_actor_loop_teardown`` answers them as it answers the
  rest of the inbox (``ActorDeadError``).

* for ``caller_inbox.CallerServedInbox`` (the inbox of ``DeviceActor`` and of the isolated
  device's proxy): ``ThreadingActor`` builds its inbox with the static
  ``_create_actor_inbox()``, which a subclass may override to return a ``queue.Queue``
  subclass; every message of a ``ThreadingActor``, asked, told or its stop, arrives through
  that queue's ``put``, and the loop takes it with ``get``, which calls the
  queue's ``_get`` under ``.mutex`` (the standard library's contract for ``Queue`` subclasses).

* for :func:`ask_into` (and :func:`ask_posting` on it), what ``ActorRef.ask`` does: an
  ``Envelope(message, reply_to=...)``
  (``pykka._envelope.Envelope``) put on ``ref.actor_inbox`` after an ``is_alive()`` check; and
  that every reply, an actor's own or the teardown's ``ActorDeadError``, goes through the reply
  object's ``set(value)`` or ``set_exception(exc_info=None)`` and nothing else (so the reply
  object need not be a ``pykka.Future``: the one here only posts the answer on a queue).

* for ``served_ref.ServedRef`` (a library actor's ref): ``Actor.__init__`` keeps the actor's ref
  in ``self._actor_ref``, which the ``actor_ref`` property returns and ``start`` registers, so an
  ``__init__`` may replace it with an ``ActorRef`` subclass made the same way (``Ref(self)``);
  and an ``ActorRef`` keeps a weak reference to its actor in ``_actor_weakref``.

* for ``LatchFuture`` (``latch_future``, whose docstring lists what it borrows): nothing here;
  the batching loop fills a ``LatchFuture`` reply and opens it later (:data:`DEFER_WAKES`).

Public pykka behaviour the runtime also relies on: ``Actor.start`` runs ``__init__`` in the
caller's thread before anything is registered (so an ``__init__`` that raises leaves no actor),
and ``ActorRef.actor_class`` names the class of the actor behind a ref.

``tests/actors/test_pykka_internals.py`` checks every one of these on the installed pykka and
fails when an upgrade changes them.

Past 400 lines on purpose: every use of pykka's private parts stays in this one module, so an
upgrade of pykka is checked against one file.
"""

from __future__ import annotations

import logging
import queue
import sys
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import pykka
from pykka._envelope import Envelope

from . import ranges
from .latch_future import LatchFuture
from .served_ref import NOT_SERVED

__all__ = [
    "BATCH_LIMIT", "DEFER_WAKES", "PYKKA_MAJOR", "Answer", "Reply", "ResilientActor", "answer", "ask_into",
    "ask_into_unrung", "ask_posting", "ask_served", "is_actor_ref_of",
]

#: The pykka major version whose loop :meth:`ResilientActor._actor_loop_running` copies.
PYKKA_MAJOR = 4

#: The most envelopes one wake-up serves in a batch (the first included): what the hook run
#: once per batch (:meth:`ResilientActor.on_batch`) does for the device, its drain of dropped
#: handles and its context check, is never further behind than this many messages.
BATCH_LIMIT = 64

#: Whether the askers of a batch whose replies are :class:`LatchFuture` objects (a ``DeviceActor``'s
#: asks) are woken together once the whole batch is served, rather than each as its message is:
#: an asker woken mid-batch finds the actor holding the GIL and goes back to sleep waiting for
#: it. The probe ``scripts/workers_anatomy.py`` sets it both ways (variants ``now`` and ``each``) to
#: measure it (docs/performance.md, "Many threads and many actors").
DEFER_WAKES = True

_pykka_logger = logging.getLogger("pykka")  # where pykka's own loop logs


class ResilientActor(pykka.ThreadingActor):
    """A pykka ``ThreadingActor`` that no told message can stop.

    A told message whose handler raises an ``Exception`` is passed to :meth:`on_told_failure`
    (by default: logged at warning level, dropped) and the actor goes on with its next message.
    An asked one is answered with the exception, as in pykka. A ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) still stops every actor, as in pykka.

    **Batched service.** A subclass that lists message types in :attr:`batch_types` has the
    envelopes of those types that are already waiting at the head of its inbox served in the
    same wake-up as the one it took: right after it takes an envelope of such a type, the loop
    also takes every further envelope at the head of the inbox whose message is of one of those
    types (up to :data:`BATCH_LIMIT` in all), stopping at the first other message, so the order
    of messages is kept exactly and nothing (a stop above all) is ever overtaken. Then it calls
    :meth:`on_batch` once and serves each message of the batch, in order, with
    :meth:`on_receive_batched`: each asker gets its own reply or its own exception, a told
    message that fails goes to :meth:`on_told_failure`, and each envelope and its reply are
    dropped as soon as that message is served. With :data:`DEFER_WAKES`, the askers whose replies
    are :class:`LatchFuture` objects get their replies as their messages are served but are woken
    together when the batch ends (however it ends). An envelope alone at the head is served by
    ``on_receive`` as always.

    Thread rule: as any pykka actor: the hooks run on the actor's own thread.
    """

    #: The message types served in batches (exact types); empty: one message per wake-up, as
    #: in pykka.
    batch_types: ClassVar[tuple[type, ...]] = ()

    #: While a batch is served with DEFER_WAKES: the latches of its LatchFuture replies filled so
    #: far, opened when the batch ends (an attribute, so overrides of ``_handle_envelope`` keep
    #: its signature).
    _woken_later: list[Any] | None = None

    def on_batch(self, size: int) -> None:
        """Called once before the messages of a batch are served, with how many there are.

        The default does nothing. A subclass does here the work it would otherwise do before
        every one of those messages. An ``Exception`` it raises is each message's answer (an
        asker gets it, a told message's failure goes to :meth:`on_told_failure`) and none of
        them is served.

        Args:
            size: the number of messages in the batch (two or more).
        Thread rule: the actor's thread only.
        """

    def on_receive_batched(self, message: Any) -> Any:
        """Serve one message of a batch, after :meth:`on_batch` ran; the default is
        ``on_receive(message)``.

        Args:
            message: a message of one of :attr:`batch_types`.
        Returns:
            the reply to an asker.
        Raises:
            Exception: the asker's answer (or the told message's failure).
        Thread rule: the actor's thread only.
        """
        return self.on_receive(message)

    def on_told_failure(self, message: Any, error: Exception) -> None:
        """A told message's handler raised ``error``; the actor lives on.

        The default logs a warning, with the traceback, on the logger named after the module of
        the actor's class, and drops the message. Subclasses may act on ``error`` as well.

        Args:
            message: the message whose handler raised.
            error: what it raised.
        Thread rule: the actor's thread only.
        """
        logging.getLogger(type(self).__module__).warning(
            "%s dropped a told %s message that failed: %r",
            self, type(message).__name__, error, exc_info=error,
        )

    def _actor_loop_running(self) -> None:
        # pykka 4.x's loop, with the three changes the module docstring gives. Each envelope is
        # handled in a call of its own (``_serve``), so it and its reply are dropped when that
        # call returns. The inbox ``get`` has no timeout on purpose: an idle actor waits for its
        # next message, and stopping it is itself a message.
        # No frame of this loop holds an envelope while it is served: a failure's traceback keeps
        # the frames above it, and an envelope kept that way would keep its reply's handles alive.
        while not self.actor_stopped.is_set():
            tracer = ranges.RANGES
            if tracer is None:
                self._serve_envelope(self.actor_inbox.get())
            else:
                self._serve_traced(tracer, self.actor_inbox.get())

    def _serve_traced(self, tracer: ranges.Ranges, envelope: Any) -> None:
        # Profiler ranges (see ``ranges``): one per wake-up, named after its (first) message; a
        # batch served at once is one range. This frame must not hold the envelope while it is
        # served (see the loop): the box is empty when the call runs.
        tracer.push(type(self), type(envelope.message))
        box = [envelope]
        del envelope
        try:
            self._serve_envelope(box.pop())
        finally:
            tracer.pop()

    def _serve_envelope(self, envelope: Any) -> None:
        if self.batch_types and type(envelope.message) in self.batch_types:
            batch = self._take_queued_batch()
            if batch:
                batch.appendleft(envelope)
                del envelope  # the batch holds it; it goes when it is served
                self._handle_batch(batch)
                return
        self._handle_envelope(envelope)

    def _take_queued_batch(self) -> deque[Any]:
        """Take the envelopes of ``batch_types`` waiting at the head of the inbox (at most
        ``BATCH_LIMIT - 1``: the caller holds the first), under the inbox's own lock."""
        inbox = self.actor_inbox
        taken: deque[Any] = deque()
        # An unlocked look first (one length read of a deque): an empty inbox, the common case of
        # a lone asker, costs no lock. A put that races it is served at the next wake-up.
        if not inbox.queue:  # type: ignore[attr-defined]
            return taken
        types = self.batch_types
        with inbox.mutex:  # type: ignore[attr-defined]
            waiting: deque[Any] = inbox.queue  # type: ignore[attr-defined]
            room = BATCH_LIMIT - 1
            while waiting and room and type(waiting[0].message) in types:
                taken.append(waiting.popleft())
                room -= 1
            if taken:
                inbox.not_full.notify(len(taken))  # type: ignore[attr-defined]
        return taken

    def _handle_batch(self, batch: deque[Any]) -> None:
        try:
            self.on_batch(len(batch))
        except Exception as error:  # noqa: BLE001 - each message's answer, or on_told_failure's
            # Nothing of the batch is served: each message gets the error as its answer.
            while batch:
                self._answer_failure(batch.popleft(), error, sys.exc_info())
            return
        except BaseException:  # noqa: BLE001 - pykka's own handling, as in _handle_envelope
            self._requeue(batch)
            _pykka_logger.debug(f"{sys.exc_info()[1]!r} in {self}. Stopping all actors.")
            self._stop()
            pykka.ActorRegistry.stop_all()
            return
        receive = self.on_receive_batched
        # The latches of the LatchFuture replies filled so far (DEFER_WAKES): opened however the
        # batch ends, so no asker is left waiting.
        woken_later: list[Any] | None = [] if DEFER_WAKES else None
        self._woken_later = woken_later
        try:
            while batch:
                if self.actor_stopped.is_set():
                    # A BaseException in a handler stopped the actor: what is left of the batch goes
                    # back to the inbox, which pykka's teardown answers with ActorDeadError.
                    self._requeue(batch)
                    return
                self._handle_envelope(batch.popleft(), receive)
        finally:
            self._woken_later = None
            if woken_later:
                for latch in woken_later:
                    latch.release()

    def _requeue(self, batch: deque[Any]) -> None:
        inbox = self.actor_inbox
        with inbox.mutex:  # type: ignore[attr-defined]
            inbox.queue.extendleft(reversed(batch))  # type: ignore[attr-defined]
            inbox.not_empty.notify(len(batch))  # type: ignore[attr-defined]
        batch.clear()

    def _answer_failure(self, envelope: Any, error: Exception, exc_info: Any) -> None:
        if envelope.reply_to is not None:
            _pykka_logger.info(f"Exception returned from {self} to caller:", exc_info=exc_info)
            envelope.reply_to.set_exception(exc_info)
        else:
            try:
                self.on_told_failure(envelope.message, error)
            except Exception as hook_error:  # noqa: BLE001 - a failing hook must not stop the actor
                _pykka_logger.error(f"on_told_failure of {self} failed: {hook_error!r}")

    def _handle_envelope(self, envelope: Any, receive: Callable[[Any], Any] | None = None) -> None:
        # ``receive``: pykka's ``_handle_receive`` (stop and proxy messages, then on_receive),
        # or ``on_receive_batched`` for a message of a batch.
        if receive is None:
            receive = self._handle_receive
        try:
            response = receive(envelope.message)
            reply = envelope.reply_to
            if reply is not None:
                woken_later = self._woken_later
                if woken_later is not None and type(reply) is LatchFuture:
                    woken_later.append(reply.fill(response))
                else:
                    reply.set(response)
        except Exception as error:  # noqa: BLE001 - the asker's answer, or on_told_failure's
            self._answer_failure(envelope, error, sys.exc_info())
        except BaseException:  # noqa: BLE001 - pykka's own handling, unchanged
            _pykka_logger.debug(f"{sys.exc_info()[1]!r} in {self}. Stopping all actors.")
            self._stop()
            pykka.ActorRegistry.stop_all()


def is_actor_ref_of(ref: object, actor_class: type[pykka.Actor]) -> bool:
    """True when ``ref`` is a pykka ``ActorRef`` of a live actor of ``actor_class`` (or a subclass).

    Args:
        ref: anything.
        actor_class: the class the actor behind ``ref`` must be.
    Returns:
        whether ``ref`` names such an actor and that actor is still running.
    Thread rule: any thread.
    """
    return (
        isinstance(ref, pykka.ActorRef)
        and isinstance(ref.actor_class, type)
        and issubclass(ref.actor_class, actor_class)
        and ref.is_alive()
    )


class Answer(NamedTuple):
    """One answered :func:`ask_posting`: the caller's ``key``, and the reply's ``value`` or the
    ``error`` the actor raised (exactly one of them is meaningful: ``error`` is None on success).

    Thread rule: immutable; any thread.
    """

    key: Hashable
    value: Any
    error: BaseException | None


class Reply(Protocol):
    """What an actor answers an ask through (``Envelope.reply_to``): exactly one of ``set`` or
    ``set_exception`` is called, once, on the thread that answers. A ``pykka.Future`` is one; so
    is anything with these two methods (see :func:`ask_into`)."""

    def set(self, value: Any | None = None) -> None:
        """The reply."""

    def set_exception(self, exc_info: Any = None) -> None:
        """The error the actor raised (``sys.exc_info()`` when ``exc_info`` is None)."""


class _PostingReply:
    """The reply slot of one :func:`ask_posting`: the actor's ``set``/``set_exception`` post an
    :class:`Answer` on the asker's queue. No lock and no condition, unlike a pykka future: the
    queue is the only thing anybody waits on."""

    __slots__ = ("_key", "_replies")

    def __init__(self, replies: queue.SimpleQueue[Answer], key: Hashable) -> None:
        self._replies = replies
        self._key = key

    def set(self, value: Any | None = None) -> None:
        self._replies.put(Answer(self._key, value, None))

    def set_exception(self, exc_info: Any = None) -> None:
        error = (exc_info if exc_info is not None else sys.exc_info())[1]
        self._replies.put(Answer(self._key, None, error))


def answer(reply: Reply, value: Any, exc_info: Any | None) -> None:
    """Answer ``reply`` with ``value`` (``exc_info`` None) or with the error of ``exc_info``, a
    ``(type, error, traceback)`` triple: what a reader that carries an answer of either kind
    hands on.

    Thread rule: the answering thread (``Reply``'s rule: once).
    """
    if exc_info is None:
        reply.set(value)
    else:
        reply.set_exception(exc_info)


def ask_into(ref: pykka.ActorRef[Any], message: Any, reply: Reply) -> None:
    """``ref.ask(message, block=False)`` answered into ``reply``, with no future: the actor calls
    ``reply.set(value)`` or ``reply.set_exception(...)`` on its own thread (an isolated device's
    child sends the reply to its parent from there; :func:`ask_posting` posts it on a queue).

    Args:
        ref: the actor to ask.
        message: the message.
        reply: what the answer goes to, exactly once. A dead actor's ``ActorDeadError`` goes to
            ``set_exception`` before this returns; an actor that stops with the message still
            queued answers it the same way.
    Thread rule: any thread.
    """
    if not ref.is_alive():
        try:
            raise pykka.ActorDeadError(f"{ref} not found")
        except pykka.ActorDeadError:
            reply.set_exception()
        return
    ref.actor_inbox.put(Envelope(message, reply_to=cast("pykka.Future[Any]", reply)))


def ask_into_unrung(ref: pykka.ActorRef[Any], message: Any, reply: Reply) -> Any:
    """:func:`ask_into`, except that an inbox that can (``hot_waits.SpinningInbox.put_unrung``)
    queues the message without ringing its doorbell, which is returned for the caller to ring
    once it lets go of the GIL (see ``put_unrung``).

    Args:
        ref, message, reply: as :func:`ask_into`.
    Returns:
        the bell to ring (a ``Doorbell``), or None: the message went as :func:`ask_into` sends
        it (an inbox without the method, a dead actor's answer).
    Thread rule: any thread.
    """
    put_unrung = getattr(ref.actor_inbox, "put_unrung", None)
    if put_unrung is None or not ref.is_alive():
        ask_into(ref, message, reply)
        return None
    return put_unrung(Envelope(message, reply_to=cast("pykka.Future[Any]", reply)))


def ask_posting(ref: pykka.ActorRef[Any], message: Any, replies: queue.SimpleQueue[Answer], key: Hashable) -> None:
    """Ask ``ref`` ``message`` without a future: the reply, or the error it raised, is posted on
    ``replies`` as ``Answer(key, value, error)``. One thread can then wait for whichever of many
    asks is answered first (``replies.get()``), and an ask costs no lock or condition of its own.

    Args:
        ref: the actor to ask.
        message: the message.
        replies: where the answer is posted, exactly once.
        key: the caller's name for this ask, posted with its answer.
    An ask of a library actor whose handler only enqueues device work (never waits) is served in
    the asking thread when the actor is idle, and its answer posted before this returns
    (:meth:`.served_ref.ServedRef.serve_posted`): no inbox hop, no wake-up of the actor.

    Thread rule: any thread. A dead actor's answer (``ActorDeadError``) is posted before this
    returns; an actor that stops with the message still queued answers it the same way.
    """
    answer = ask_served(ref, message, replies, key)
    if answer is not None:
        replies.put(answer)


def ask_served(ref: pykka.ActorRef[Any], message: Any, replies: queue.SimpleQueue[Answer],
               key: Hashable) -> Answer | None:
    """:func:`ask_posting`, except that an ask served in the asking thread (see there) returns its
    answer instead of posting it: a caller that reacts to an answer by sending the next ask runs
    that at once, with no queue round trip.

    Args:
        ref, message, replies, key: as :func:`ask_posting`.
    Returns:
        the ``Answer`` (reply or error) of an ask served in this thread; None when the answer
        will be posted on ``replies`` (a dead actor's ``ActorDeadError`` is posted before this
        returns).
    Thread rule: any thread.
    """
    serve = getattr(ref, "serve_posted", None)
    if serve is not None:
        try:
            value = serve(message)
        except Exception as exc:  # noqa: BLE001 - the handler's error is the answer, as on the actor's thread
            return Answer(key, None, exc)
        if value is not NOT_SERVED:
            return Answer(key, value, None)
    ask_into(ref, message, _PostingReply(replies, key))
    return None
