"""``Supervisor``: what a ``DeviceActor`` does when something fails.

pykka has no supervision (its issue #42), so the runtime brings its own, shaped after
atomr-accel's two tiers: the ``DeviceActor`` is the stable address; the context under it is what
gets rebuilt. The decider goes by error class:

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

__all__ = ["EXIT_POISONED", "Directive", "Supervisor", "exit_process", "stop_device"]

logger = logging.getLogger("xlog_actors.supervisor")

#: Exit code of :func:`exit_process`: an outer supervisor (systemd, Kubernetes, a parent
#: process) restarts the process, which is the only way to recover a poisoned CUDA context.
EXIT_POISONED = 75

PoisonHook = Callable[[int, BaseException], None]


class Directive(enum.Enum):
    RESUME = "resume"
    REBUILD = "rebuild"
    POISON = "poison"


def stop_device(device_id: int, error: BaseException) -> None:
    """The default escalation hook: log; the device stays stopped, answering every request
    with ``ContextPoisoned``, until the process ends."""
    logger.error("device %d poisoned (%s); it is stopped for the rest of this process", device_id, error)


def exit_process(device_id: int, error: BaseException) -> None:
    """An escalation hook that ends the process with :data:`EXIT_POISONED` so an outer
    supervisor starts a fresh one (run one process per device for this)."""
    logger.critical("device %d poisoned (%s); exiting with code %d", device_id, error, EXIT_POISONED)
    logging.shutdown()
    os._exit(EXIT_POISONED)


class Supervisor:
    """Decides by error class and enforces the restart intensity. One supervisor may watch
    several devices; the intensity window is kept per device. Thread-safe."""

    def __init__(
        self,
        max_restarts: int = 3,
        within_s: float = 60.0,
        on_poisoned: PoisonHook | None = None,
    ) -> None:
        if type(max_restarts) is not int or max_restarts < 0:
            raise InvalidRequest(f"max_restarts must be a non-negative int, got {max_restarts!r}")
        if not isinstance(within_s, (int, float)) or within_s <= 0:
            raise InvalidRequest(f"within_s must be a positive number, got {within_s!r}")
        self.max_restarts = max_restarts
        self.within_s = float(within_s)
        self.on_poisoned: PoisonHook = on_poisoned or stop_device
        self._lock = threading.Lock()
        self._restarts: dict[int, deque[float]] = {}

    def __repr__(self) -> str:
        return f"Supervisor(max_restarts={self.max_restarts}, within_s={self.within_s})"

    @staticmethod
    def decide(error: BaseException) -> Directive:
        if isinstance(error, ContextPoisoned):
            return Directive.POISON
        if isinstance(error, ContextLost):
            return Directive.REBUILD
        if isinstance(error, (OutOfMemory, XlogError)):
            return Directive.RESUME
        return Directive.REBUILD

    def allow_restart(self, device_id: int, now: float | None = None) -> bool:
        """Count one restart of ``device_id``; False when it would exceed the intensity."""
        now = time.monotonic() if now is None else now
        with self._lock:
            window = self._restarts.setdefault(device_id, deque())
            while window and now - window[0] > self.within_s:
                window.popleft()
            if len(window) >= self.max_restarts:
                return False
            window.append(now)
            return True
