"""``DeviceState``: the generation counter and liveness flags of one device, and the watchers
told synchronously when they change (a cache of the device's blocks outside the runtime, such
as the allocator bridge's, must drop them before the old context is closed).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from .._core.handles import TokenCell

__all__ = ["DeviceState"]

logger = logging.getLogger("xlog_actors.actors")


class DeviceState:
    """What a ``GpuRef`` validates against.

    ``generation`` starts at 0 (or where it is told to) and is bumped on every context rebuild; ``accepting_ops`` turns
    false for good on ``begin_shutdown``; ``poisoned`` turns true for good when a sticky error
    poisoned the context. ``token`` is replaced on every one of those changes, so a handle can
    validate with one identity comparison on its fast path.

    Watchers (:meth:`add_watcher`) are called after each of those changes, in the thread that
    made it (the device actor's), before the caller goes on (a rebuild closes the old context
    after). They are held weakly (a bound method's object may go away); one that raises is
    logged and the others still run.

    Mirrors (:meth:`mirror`) are told every change under the same lock, so a copy of the state
    kept elsewhere (the shared generation cell other processes read) never lags the handles here.

    Thread rules: writes take a lock; reads are single attribute loads; mirrors are called inside
    the lock, watchers outside it.
    """

    __slots__ = (
        "__weakref__", "_accepting", "_device_id", "_generation", "_lock", "_mirrors", "_poisoned", "_watchers",
        "cell",
    )

    def __init__(self, device_id: int, generation: int = 0) -> None:
        """A state at ``generation``, accepting operations, not poisoned.

        Args:
            device_id: the device's ordinal.
            generation: the first generation (an isolated device's new process goes on from
                the generation of the one it replaces).
        """
        self._device_id = device_id
        self._generation = generation
        self._accepting = True
        self._poisoned = False
        self.cell = TokenCell()
        self._lock = threading.Lock()
        self._watchers: list[weakref.WeakMethod[Callable[[], None]]] = []
        self._mirrors: list[Callable[[DeviceState], None]] = []

    def mirror(self, callback: Callable[[DeviceState], None]) -> None:
        """Call ``callback(state)`` now and after every later change, under the state's lock.

        Args:
            callback: must not block nor touch this state's writers; it may read the state.
        Thread rule: any thread.
        """
        with self._lock:
            self._mirrors.append(callback)
            callback(self)

    def _changed(self) -> None:
        # Under the lock: a new token, and every mirror told.
        self.cell.token = object()
        for callback in self._mirrors:
            callback(self)

    @property
    def token(self) -> object:
        """An object that changes (by identity) on every status change: what a handle or a
        context compares with the one it was made under. Held in :attr:`cell`, which handles
        read in C."""
        return self.cell.token

    @property
    def device_id(self) -> int:
        """The device's ordinal."""
        return self._device_id

    @property
    def generation(self) -> int:
        """0 at start, bumped by every context rebuild."""
        return self._generation

    @property
    def accepting_ops(self) -> bool:
        """False for good once ``begin_shutdown`` ran."""
        return self._accepting

    @property
    def poisoned(self) -> bool:
        """True for good once ``poison`` ran."""
        return self._poisoned

    def bump_generation(self) -> int:
        """Start a new generation: every handle of an older one is stale ("context rebuilt").

        Returns:
            the new generation.
        """
        with self._lock:
            self._generation += 1
            self._changed()
            generation = self._generation
        self._tell_watchers()
        return generation

    def begin_shutdown(self) -> None:
        """Refuse new operations for good: every handle is stale ("device shutting down")."""
        with self._lock:
            self._accepting = False
            self._changed()
        self._tell_watchers()

    def poison(self) -> None:
        """Mark the context poisoned for good: every handle is stale ("context poisoned")."""
        with self._lock:
            self._poisoned = True
            self._changed()
        self._tell_watchers()

    def add_watcher(self, method: Callable[[], None]) -> None:
        """Call the bound method ``method()`` after every later change of the state (rebuild,
        shutdown, poisoning), held weakly: it stops when its object goes away.

        Raises:
            TypeError: ``method`` is not a bound method.
        Thread rule: any thread.
        """
        ref = weakref.WeakMethod(method)
        with self._lock:
            self._watchers = [w for w in self._watchers if w() is not None] + [ref]

    def remove_watcher(self, method: Callable[[], None]) -> None:
        """Stop calling ``method`` (nothing happens if it was not watching). Thread rule: any thread."""
        with self._lock:
            self._watchers = [w for w in self._watchers if w() is not None and w() != method]

    def _tell_watchers(self) -> None:
        for ref in self._watchers:
            method = ref()
            if method is None:
                continue
            try:
                method()
            except Exception:  # a watcher must not stop a rebuild or a shutdown
                logger.exception("device %d: a state watcher failed: %r", self._device_id, method)

    def __repr__(self) -> str:
        return (
            f"DeviceState(device_id={self._device_id}, generation={self._generation}, "
            f"accepting_ops={self._accepting}, poisoned={self._poisoned})"
        )
