"""``DevicePool``: devices for workers that do not name an ordinal.

A pool holds the ``ActorRef`` of several device actors (in-process or isolated, one per ordinal)
and routes each ``Allocate`` asked of it (:meth:`DevicePool.allocate`) to one of them;
:meth:`DevicePool.pick` names the device a worker should put its next piece of work on.

**The choice: least outstanding work.** Each device's load is the bytes of the pool's own
allocations on it that are still referenced, plus those of its asks in flight; the pool picks the
serving device of least load, ties going round the devices in turn. The count is kept by the pool
itself (a finalizer on each handle gives its bytes back when the handle is dropped), so a choice
costs no ask: the other policy, most free memory, needs a ``GetStats`` round trip per device per
choice (a pipe round trip for an isolated one), and a device's free memory says little about its
load anyway, since its stream-ordered pool keeps freed memory reserved.

**Restarts.** A device is skipped from the moment its state changes (a rebuild begins, an
isolated device's process is seen dead, it is poisoned) or an allocation fails with its status
(``DeviceUnavailable``, ``ContextPoisoned``, ``ContextLost``, ``GpuRefStale``, its actor gone; the
allocation then goes to the next device), and rejoins once it serves again, at its new generation,
its count started anew; ``poisoned`` and ``stopped`` keep it out (:mod:`.pool_members` says how
each is learnt). Only that device changes: no other device's generation, handles or count is
touched. An ``OutOfMemory`` or ``BudgetExceeded`` tries the other devices without taking any out.
An ``Allocate`` an isolated device had already taken when its process died is served by its next
process, as any ask of it is.

Thread rule: every method may be called from any thread (one lock guards the devices' records);
the subscriptions and probes are served by the pool's watcher actor.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pykka

from ..driver.protocol import Driver
from ..errors import ContextLost, ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest, OutOfMemory
from ..memory.block import AllocTag, StreamId
from .gpu_ref import GpuRef
from .messages import Allocate
from .pool_members import PROBE_INTERVAL_S, Membership, PoolMember

__all__ = ["PROBE_INTERVAL_S", "DevicePool", "PoolDevice", "PoolMember"]

_DOWN = (DeviceUnavailable, ContextPoisoned, ContextLost, GpuRefStale, pykka.ActorDeadError)


@dataclass(frozen=True)
class PoolDevice:
    """A device the pool chose: its ``ordinal``, its ``ref`` (the device actor's ``ActorRef``) and
    the ``generation`` the pool knows it at.

    Thread rule: immutable; any thread.
    """

    ordinal: int
    ref: pykka.ActorRef[Any]
    generation: int


class DevicePool:
    """Devices for workers that do not name an ordinal; see the module docstring.

    Thread rule: any thread.
    """

    def __init__(self, devices: Sequence[pykka.ActorRef[Any]], *, owned: bool = False) -> None:
        """Pool ``devices`` (started ``DeviceActor`` refs, in-process or isolated, of distinct
        ordinals), subscribe to each and watch its state.

        Args:
            devices: the devices' ``ActorRef``s (a list or tuple), at least one.
            owned: stop the devices when the pool stops (``start`` sets it).
        Raises:
            InvalidRequest: no devices, something that is not a device's ``ActorRef``, or two
                devices of one ordinal.
            DeviceUnavailable: a device's actor is gone.
        Thread rule: any thread.
        """
        refs = list(devices) if isinstance(devices, (list, tuple)) else None
        if not refs:
            raise InvalidRequest(f"DevicePool takes a non-empty list of device ActorRefs, got {devices!r}")
        for ref in refs:
            if not isinstance(ref, pykka.ActorRef):
                raise InvalidRequest(f"DevicePool: {ref!r} is not the ActorRef of a device actor")
        self._members = Membership(refs, "DevicePool")
        self._owned = owned

    @classmethod
    def start(
        cls, devices: int | Sequence[int], driver: Driver | str | None = None, *, isolate: bool = False,
        **options: Any,
    ) -> DevicePool:
        """Start a device actor per ordinal and pool them; :meth:`stop` stops them.

        Args:
            devices: a count (ordinals ``0 .. n - 1``) or the ordinals.
            driver: as ``DeviceActor.start`` takes it (with ``isolate=True``: a kind or None).
            isolate: each device in its own process (``DeviceActor.start(..., isolate=True)``).
            options: more keywords of ``DeviceActor.start`` (``resource``, ``supervisor``,
                ``hot_spare``, ...), the same for every device.
        Returns:
            The pool.
        Raises:
            InvalidRequest: a bad count or ordinal, or as ``DeviceActor.start``; the devices
                already started are stopped.
            DeviceUnavailable: as ``DeviceActor.start``.
        Thread rule: any thread.
        """
        from .device_actor import DeviceActor  # here: the isolated package imports this module's layer

        if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
            raise InvalidRequest(f"DevicePool.start: devices must be a count or a list of ordinals, got {devices!r}")
        ordinals = list(range(devices)) if isinstance(devices, int) else list(devices)
        if not ordinals:
            raise InvalidRequest(f"DevicePool.start: no devices in {devices!r}")
        started: list[pykka.ActorRef[Any]] = []
        try:
            for ordinal in ordinals:
                started.append(DeviceActor.start(ordinal, driver, isolate=isolate, **options))
            return cls(started, owned=True)
        except BaseException:
            for ref in started:
                ref.stop()
            raise

    def pick(self) -> PoolDevice:
        """The serving device of least outstanding work (ties in turn), for a worker to put its
        next piece of work on.

        Returns:
            The device.
        Raises:
            DeviceUnavailable: no device serves now (every one restarting, poisoned or stopped),
                or the pool is stopped.
        Thread rule: any thread.
        """
        members = self._members
        with members.lock:
            member = members.choose(())
            return PoolDevice(member.ordinal, member.ref, member.generation)

    def allocate(self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED) -> GpuRef:
        """``Allocate(nbytes, stream, tag)`` asked of the device :meth:`pick` would name; a device
        that fails with its status is taken out, and the next one asked.

        Args:
            nbytes, stream, tag: as ``Allocate``.
        Returns:
            The handle, of whichever device served it (``ref.device_id``); its bytes count on that
            device until the handle is dropped.
        Raises:
            InvalidRequest: a bad field (from the first device asked; no other is tried).
            OutOfMemory, BudgetExceeded: every serving device refused for room (the last error).
            DeviceUnavailable: no device serves, or every one failed with its status.
        Thread rule: any thread.
        """
        members = self._members
        tried: list[int] = []
        last: BaseException | None = None
        message = Allocate(nbytes, stream, tag)
        size = nbytes if type(nbytes) is int else 0
        while True:
            with members.lock:
                try:
                    member = members.choose(tried)
                except DeviceUnavailable:
                    if last is not None and not isinstance(last, _DOWN):
                        raise last from None
                    raise
                member.load += size
                epoch, generation = member.epoch, member.generation
            try:
                ref: GpuRef = member.ref.ask(message)  # type: ignore[assignment]  # a blocking ask
            except BaseException as exc:
                members.give_back(member, size, epoch)
                if isinstance(exc, _DOWN):
                    members.failed(member, generation)
                elif not isinstance(exc, OutOfMemory):  # BudgetExceeded included: another may have room
                    raise
                tried.append(member.ordinal)
                last = exc
                continue
            weakref.finalize(ref, members.give_back, member, size, epoch)
            members.answered(member, ref)
            return ref

    def members(self) -> list[PoolMember]:
        """A snapshot of every device of the pool, by ordinal.

        Returns:
            One :class:`PoolMember` per device.
        Thread rule: any thread.
        """
        return self._members.snapshot()

    @property
    def devices(self) -> list[pykka.ActorRef[Any]]:
        """The devices' ``ActorRef``s, by ordinal. Thread rule: any thread."""
        return [self._members.members[o].ref for o in self._members.order]

    def wait_serving(self, ordinal: int, timeout_s: float = 30.0) -> PoolMember:
        """Block until device ``ordinal`` serves in the pool (after a restart, say).

        Args:
            ordinal: the device.
            timeout_s: how long at most.
        Returns:
            Its snapshot once serving.
        Raises:
            InvalidRequest: no device of that ordinal in the pool.
            DeviceUnavailable: not serving within ``timeout_s``, or poisoned or stopped.
        Thread rule: any thread.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            member = next((m for m in self.members() if m.ordinal == ordinal), None)
            if member is None:
                raise InvalidRequest(f"DevicePool: no device of ordinal {ordinal!r}")
            if member.status == "serving":
                return member
            if member.status in ("stopped", "poisoned") or time.monotonic() >= deadline:
                raise DeviceUnavailable(f"device {ordinal} of the pool is {member.status}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Unsubscribe and stop the pool's watcher; stop the devices too when the pool started
        them (:meth:`start`). Idempotent; a stopped pool answers :meth:`pick` and
        :meth:`allocate` with ``DeviceUnavailable``. Thread rule: any thread."""
        if self._members.stop() and self._owned:
            for ref in self.devices:
                ref.stop()

    def __repr__(self) -> str:
        states = ", ".join(f"{m.ordinal}: {m.status}" for m in self.members())
        return f"DevicePool({states})"
