"""What the runtime borrows from pykka's internals, in one place.

pykka (4.x) stops an actor whose handler raised on a *told* message, and keeps each envelope and
reply alive until the next message has been handled. Neither suits a device runtime: an actor
that owns a device must outlive a bad message, and a reply's ``GpuRef``s must be dropped as soon
as the asker drops them (a ``GetStats`` sent right after would otherwise still count them). Both
behaviours live in pykka's private message loop, so :class:`ResilientActor` replaces that loop.
It borrows, from the installed pykka:

* ``Actor._actor_loop_running``: the loop it overrides, copied with two changes (a told message
  that raises goes to :meth:`ResilientActor.on_told_failure` instead of stopping the actor; the
  envelope and the reply are dropped as soon as the reply is set);
* ``Actor._handle_receive(message)``: pykka's dispatch of stop and proxy messages, then
  ``on_receive``;
* ``Actor._stop()`` and ``ActorRegistry.stop_all()``: what pykka does on a ``BaseException``
  (kept unchanged);
* the inbox's envelopes: ``.message``, and ``.reply_to``, a future with ``set(value)`` and
  ``set_exception()`` (None for a ``tell``).

Public pykka behaviour the runtime also relies on: ``Actor.start`` runs ``__init__`` in the
caller's thread before anything is registered (so an ``__init__`` that raises leaves no actor),
and ``ActorRef.actor_class`` names the class of the actor behind a ref.

``tests/actors/test_pykka_internals.py`` checks every one of these on the installed pykka and
fails when an upgrade changes them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pykka

__all__ = ["PYKKA_MAJOR", "ResilientActor", "is_actor_ref_of"]

#: The pykka major version whose loop :meth:`ResilientActor._actor_loop_running` copies.
PYKKA_MAJOR = 4

_pykka_logger = logging.getLogger("pykka")  # where pykka's own loop logs


class ResilientActor(pykka.ThreadingActor):
    """A pykka ``ThreadingActor`` that no told message can stop.

    A told message whose handler raises an ``Exception`` is passed to :meth:`on_told_failure`
    (by default: logged at warning level, dropped) and the actor goes on with its next message.
    An asked one is answered with the exception, as in pykka. A ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) still stops every actor, as in pykka.

    Thread rule: as any pykka actor: the hooks run on the actor's own thread.
    """

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
        # pykka 4.x's loop, with the two changes the module docstring gives. Each envelope is
        # handled in its own call, so it and its reply are dropped when that call returns. The
        # inbox ``get`` has no timeout on purpose: an idle actor waits for its next message, and
        # stopping it is itself a message.
        while not self.actor_stopped.is_set():
            self._handle_envelope(self.actor_inbox.get())

    def _handle_envelope(self, envelope: Any) -> None:
        try:
            response = self._handle_receive(envelope.message)
            if envelope.reply_to is not None:
                envelope.reply_to.set(response)
        except Exception as error:
            if envelope.reply_to is not None:
                _pykka_logger.info(f"Exception returned from {self} to caller:", exc_info=sys.exc_info())
                envelope.reply_to.set_exception()
            else:
                try:
                    self.on_told_failure(envelope.message, error)
                except Exception as hook_error:  # noqa: BLE001 - a failing hook must not stop the actor
                    _pykka_logger.error(f"on_told_failure of {self} failed: {hook_error!r}")
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
