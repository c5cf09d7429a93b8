"""``DeviceLifecycle``: the phases a device goes through, as a plain state machine.

A device starts, runs, may be rebuilt (any number of times), and ends either poisoned (a sticky
error: no rebuild is possible in this process) or stopped for good. The machine knows nothing of
actors or drivers: it holds the status, the current context (of any type) and the
:class:`DeviceState` that handles validate against, and every transition changes all three
together, so that "a context is present exactly while the device is running" always holds.

=============  ==========================================  =====================================
status         meaning                                     left by
=============  ==========================================  =====================================
``starting``   no context yet (the first build is due)      ``built``, ``begin_rebuild``,
                                                            ``poison``, ``stop``
``running``    a context serves requests                    ``begin_rebuild``, ``poison``, ``stop``
``rebuilding`` the old context is gone, a new one is built  ``built``, ``rebuild_failed``,
                                                            ``poison``, ``stop``
``broken``     a rebuild failed; the next request retries   ``begin_rebuild``, ``poison``, ``stop``
``poisoned``   a sticky error: no new work in this process  ``stop``
``stopped``    stopped for good                             nothing (terminal)
=============  ==========================================  =====================================

Any other transition raises :class:`~xlog_actors.errors.IllegalTransition` and changes nothing.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from ..errors import IllegalTransition
from .device_state import DeviceState

__all__ = ["DeviceLifecycle", "DeviceStatus"]

C = TypeVar("C")


class DeviceStatus(str, enum.Enum):
    """The status of a device; its value is the string ``DeviceStats.status`` reports."""

    STARTING = "starting"
    RUNNING = "running"
    REBUILDING = "rebuilding"
    BROKEN = "broken"
    POISONED = "poisoned"
    STOPPED = "stopped"


_S = DeviceStatus
#: event -> the statuses it may leave from.
_ALLOWED: dict[str, frozenset[DeviceStatus]] = {
    "built": frozenset({_S.STARTING, _S.REBUILDING}),
    "begin_rebuild": frozenset({_S.STARTING, _S.RUNNING, _S.BROKEN}),
    "rebuild_failed": frozenset({_S.REBUILDING}),
    "poison": frozenset({_S.STARTING, _S.RUNNING, _S.REBUILDING, _S.BROKEN}),
    "stop": frozenset({_S.STARTING, _S.RUNNING, _S.REBUILDING, _S.BROKEN, _S.POISONED}),
}


class DeviceLifecycle(Generic[C]):
    """The status, current context and handle-validation state of one device.

    Invariants: ``context`` is not None exactly while ``status`` is ``running``; the state's
    ``generation`` grows by one on every ``begin_rebuild`` and never otherwise; ``restarts`` counts the rebuilds
    that completed; once ``poisoned`` or ``stopped``, the device state says so for good, so every
    handle of the device is stale.

    Thread rule: transitions run on one thread, the owner's (the device actor's); any thread may
    read ``status``, ``context`` and the other properties (each a single attribute load).
    """

    __slots__ = ("_context", "_restarts", "_state", "_status")

    def __init__(self, state: DeviceState) -> None:
        """A lifecycle in ``starting``, without a context.

        Args:
            state: the device state the lifecycle drives (generation, shutdown, poisoning).
        Thread rule: any thread.
        """
        self._state = state
        self._status = DeviceStatus.STARTING
        self._context: C | None = None
        self._restarts = 0

    def __repr__(self) -> str:
        return (
            f"DeviceLifecycle(device={self._state.device_id}, status={self._status.value}, "
            f"generation={self._state.generation}, restarts={self._restarts})"
        )

    # -- reads ------------------------------------------------------------------------------------
    @property
    def status(self) -> DeviceStatus:
        """The current status. Thread rule: any thread."""
        return self._status

    @property
    def context(self) -> C | None:
        """The running context, None unless ``status`` is ``running``. Thread rule: any thread."""
        return self._context

    @property
    def state(self) -> DeviceState:
        """The device state handles validate against. Thread rule: any thread."""
        return self._state

    @property
    def restarts(self) -> int:
        """How many rebuilds completed (``built`` after ``begin_rebuild``). Thread rule: any thread."""
        return self._restarts

    @property
    def needs_build(self) -> bool:
        """True in ``starting`` and ``broken``: no context, and one may still be built.
        Thread rule: any thread."""
        return self._status in (DeviceStatus.STARTING, DeviceStatus.BROKEN)

    @property
    def ended(self) -> bool:
        """True in ``poisoned`` and ``stopped``: no context can be built again in this process.
        Thread rule: any thread."""
        return self._status in (DeviceStatus.POISONED, DeviceStatus.STOPPED)

    # -- transitions ----------------------------------------------------------------------------
    def _check(self, event: str) -> None:
        if self._status not in _ALLOWED[event]:
            allowed = ", ".join(sorted(s.value for s in _ALLOWED[event]))
            raise IllegalTransition(
                f"device {self._state.device_id}: {event} is not allowed in status {self._status.value!r} "
                f"(only from {allowed})",
                current=self._status.value,
                event=event,
            )

    def built(self, context: C) -> None:
        """A context was built: ``starting``/``rebuilding`` -> ``running``.

        A build after ``begin_rebuild`` counts one restart.

        Args:
            context: the new context; it must be of the current generation.
        Raises:
            IllegalTransition: in any other status (nothing changes).
        Thread rule: the owner's thread only.
        """
        self._check("built")
        if self._status is DeviceStatus.REBUILDING:
            self._restarts += 1
        self._context = context
        self._status = DeviceStatus.RUNNING

    def begin_rebuild(self) -> tuple[C | None, int]:
        """Drop the context and bump the generation: ``starting``/``running``/``broken`` ->
        ``rebuilding``. Every handle of an older generation is stale from here on.

        Returns:
            the context that was running (None if there was none), for the caller to close, and
            the new generation.
        Raises:
            IllegalTransition: in ``rebuilding``, ``poisoned`` or ``stopped`` (nothing changes).
        Thread rule: the owner's thread only.
        """
        self._check("begin_rebuild")
        old, self._context = self._context, None
        generation = self._state.bump_generation()
        self._status = DeviceStatus.REBUILDING
        return old, generation

    def rebuild_failed(self) -> None:
        """The rebuild did not produce a context: ``rebuilding`` -> ``broken`` (the next request
        tries again).

        Raises:
            IllegalTransition: in any other status (nothing changes).
        Thread rule: the owner's thread only.
        """
        self._check("rebuild_failed")
        self._status = DeviceStatus.BROKEN

    def poison(self) -> C | None:
        """A sticky error: any live status -> ``poisoned``. Every handle becomes stale with
        "context poisoned" and no context can be built again.

        Returns:
            the context that was running (None if there was none); the caller closes it without
            freeing into it.
        Raises:
            IllegalTransition: in ``poisoned`` or ``stopped`` (nothing changes).
        Thread rule: the owner's thread only.
        """
        self._check("poison")
        self._state.poison()
        return self._end(DeviceStatus.POISONED)

    def stop(self) -> C | None:
        """Stop for good: any status but ``stopped`` -> ``stopped``. Every handle becomes stale
        with "device shutting down".

        Returns:
            the context that was running (None if there was none), for the caller to close.
        Raises:
            IllegalTransition: in ``stopped`` (nothing changes).
        Thread rule: the owner's thread only.
        """
        self._check("stop")
        self._state.begin_shutdown()
        return self._end(DeviceStatus.STOPPED)

    def _end(self, status: DeviceStatus) -> C | None:
        old, self._context = self._context, None
        self._status = status
        return old
