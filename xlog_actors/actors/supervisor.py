"""``Supervisor``: what a ``DeviceActor`` does when something fails.

pykka has no supervision, so the runtime brings its own, in two tiers: the ``DeviceActor`` is
the stable address; the context under it is what gets rebuilt. The decider goes by error class:

=====================================  ==========================================================
error                                  directive
=====================================  ==========================================================
``OutOfMemory`` (``BudgetExceeded``)   resume: the asker gets the error, nothing else changes
bad requests (``InvalidRequest``,      resume: answered with their error
``UseAfterFree``, ``StreamMisuse``,
``GpuRefStale``, other ``DriverError``)
``ContextLost``                        rebuild the context, bump the generation
a crash of the actor's own code        rebuild the context, bump the generation
(any other exception)
``ContextPoisoned``                    poison: every handle stale ("context poisoned"), new work
                                       refused, the escalation hook called (no in-process
                                       rebuild: CUDA cannot do it after a sticky error)
=====================================  ==========================================================

Restart intensity: more than ``max_restarts`` rebuilds within ``within_s`` seconds stops the
device for good (``DeviceUnavailable``; handles "device shutting down"). Explicit ``Rebuild``
requests do not count: they are not failures.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import ContextLost, ContextPoisoned, InvalidRequest, OutOfMemory, XlogError

__all__ = ["EXIT_POISONED", "Directive", "SupervisedFailure", "Supervisor", "exit_process", "stop_device"]

logger = logging.getLogger(__name__)

#: Exit code of :func:`exit_process`: an outer supervisor (systemd, Kubernetes, a parent
#: process) restarts the process, which is the only way to recover a poisoned CUDA context.
EXIT_POISONED = 75

#: An escalation hook: ``hook(device_id, error)``, called once when a device is poisoned.
PoisonHook = Callable[[int, BaseException], None]


class Directive(enum.Enum):
    """What the supervisor tells a device actor to do about a failure (the table above)."""

    RESUME = "resume"
    REBUILD = "rebuild"
    POISON = "poison"


class SupervisedFailure(Exception):
    """Wraps an error the device actor already acted on, or that is an answer needing no action
    (a poisoned device's ``ContextPoisoned``, a stopped device's ``DeviceUnavailable``).

    A handler raises ``SupervisedFailure(error)``; the actor's dispatch unwraps it and hands
    ``error`` to the asker without passing it to the supervisor again, so one failure is never
    counted twice against the restart intensity. Immutable: ``error`` is read-only.

    A library actor uses it the same way for the device's own answer to its ``Attach``: the
    device acted on that failure before answering, so the library actor must not report it back.

    Thread rule: made and unwrapped on one actor's thread; never reaches a caller.
    """

    __slots__ = ()

    def __init__(self, error: BaseException) -> None:
        """Args:
            error: the error to hand to the asker as it is.
        """
        super().__init__(error)

    @property
    def error(self) -> BaseException:
        """The wrapped error."""
        error: BaseException = self.args[0]
        return error

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("__traceback__", "__cause__", "__context__", "__suppress_context__", "__notes__"):
            super().__setattr__(name, value)  # what ``raise`` itself sets
            return
        raise AttributeError(f"SupervisedFailure is immutable (cannot set {name!r})")


def stop_device(device_id: int, error: BaseException) -> None:
    """The default escalation hook: log at error level; the device stays poisoned, answering
    every request with ``ContextPoisoned``, until it is stopped or the process ends.

    Args:
        device_id: the poisoned device's ordinal.
        error: the sticky error that poisoned it.
    Thread rule: called on the device actor's thread.
    """
    logger.error("device %d poisoned (%s); it is stopped for the rest of this process", device_id, error)


def exit_process(device_id: int, error: BaseException) -> None:
    """An escalation hook that ends the process with :data:`EXIT_POISONED` so an outer
    supervisor starts a fresh one (run one process per device for this).

    Args:
        device_id: the poisoned device's ordinal.
        error: the sticky error that poisoned it.
    Returns:
        never: the process ends at once (``os._exit``), after flushing the logs.
    Thread rule: called on the device actor's thread.
    """
    logger.critical("device %d poisoned (%s); exiting with code %d", device_id, error, EXIT_POISONED)
    logging.shutdown()
    os._exit(EXIT_POISONED)


class Supervisor:
    """Decides by error class and enforces the restart intensity.

    One supervisor may watch several devices; the intensity window is kept per device.

    Thread rule: any thread (the restart windows are kept under a lock).
    """

    def __init__(
        self,
        max_restarts: int = 3,
        within_s: float = 60.0,
        on_poisoned: PoisonHook | None = None,
    ) -> None:
        """Args:
            max_restarts: rebuilds allowed within ``within_s`` (a non-negative int); one more
                stops the device for good.
            within_s: the window, in seconds (a positive number).
            on_poisoned: the escalation hook ``(device_id, error)`` called once when a device is
                poisoned; default :func:`stop_device`.
        Raises:
            InvalidRequest: a bad ``max_restarts``, ``within_s`` or ``on_poisoned``.
        """
        if type(max_restarts) is not int or max_restarts < 0:
            raise InvalidRequest(f"max_restarts must be a non-negative int, got {max_restarts!r}")
        if not isinstance(within_s, (int, float)) or within_s <= 0:
            raise InvalidRequest(f"within_s must be a positive number, got {within_s!r}")
        if on_poisoned is not None and not callable(on_poisoned):
            raise InvalidRequest(f"on_poisoned must be a callable (device_id, error), got {on_poisoned!r}")
        self.max_restarts = max_restarts
        self.within_s = float(within_s)
        self.on_poisoned: PoisonHook = on_poisoned or stop_device
        self._lock = threading.Lock()
        self._restarts: dict[int, deque[float]] = {}

    def __repr__(self) -> str:
        return f"Supervisor(max_restarts={self.max_restarts}, within_s={self.within_s})"

    @staticmethod
    def decide(error: BaseException) -> Directive:
        """The directive for ``error``, by its class (the table of the module docstring).

        Args:
            error: what failed.
        Returns:
            the :class:`Directive`.
        Thread rule: any thread.
        """
        if isinstance(error, ContextPoisoned):
            return Directive.POISON
        if isinstance(error, ContextLost):
            return Directive.REBUILD
        if isinstance(error, (OutOfMemory, XlogError)):
            return Directive.RESUME
        return Directive.REBUILD

    def allow_restart(self, device_id: int, now: float | None = None) -> bool:
        """Count one restart of ``device_id``.

        Args:
            device_id: the device's ordinal.
            now: the monotonic time to count at (default: now); tests pass their own clock.
        Returns:
            True, counting it, while within the intensity; False (counting nothing) when one
            more restart would exceed it.
        Thread rule: any thread.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            window = self._restarts.setdefault(device_id, deque())
            while window and now - window[0] > self.within_s:
                window.popleft()
            if len(window) >= self.max_restarts:
                return False
            window.append(now)
            return True


def checked_supervisor(supervisor: object) -> Supervisor:
    """The supervisor a device starts with: ``supervisor`` itself, or a default one for None.

    Args:
        supervisor: what the caller gave.
    Returns:
        A ``Supervisor``.
    Raises:
        InvalidRequest: ``supervisor`` is neither None nor a ``Supervisor``.
    Thread rule: any thread.
    """
    if supervisor is None:
        return Supervisor()
    if not isinstance(supervisor, Supervisor):
        raise InvalidRequest(f"supervisor must be a Supervisor, got {type(supervisor).__name__}")
    return supervisor
