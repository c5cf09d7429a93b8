"""The devices of a :class:`~.device_pool.DevicePool` and what the pool knows of each: its status,
generation and load, kept up to date from three sources.

* **The device's state** (``DeviceState.add_watcher``), told in the thread that changes it: a
  generation bumped at the start of an in-process rebuild or the moment an isolated device's
  process is seen dead, a poisoning, a shutdown. The device is skipped from that moment, before
  any notification or failed ask says so. The state watched is the one of the handles the device
  last answered with (an isolated device's new process has a state of its own).
* **Its notifications** (``GenerationChanged``, the pool's watcher actor subscribed to every
  device): ``running`` brings it back at its new generation; ``poisoned`` and ``stopped`` keep it
  out.
* **Its failures** (an ask of the pool answered with the device's status) and **probes**: a
  device taken out is asked ``GetStats`` (every :data:`PROBE_INTERVAL_S` until it answers
  ``running``), so it rejoins even when its notification crossed what took it out. A ``broken``
  device is sent one small ``Allocate``, which is what makes a device retry its rebuild.

A device that comes back at a new generation has its load counted anew: its old handles went with
its old context (a handle's finalizer gives back only what it took in the same epoch). Nothing
here touches another device's status, generation or load.

Thread rule: :class:`Membership` may be used from any thread (one lock); the watcher actor runs
probes on its own thread; state watches run in whichever thread changed the state.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import pykka

from ..errors import DeviceUnavailable
from ..memory.block import AllocTag
from .device_state import DeviceState
from .gpu_ref import GpuRef
from .messages import Allocate, DeviceStats, GenerationChanged, GetStats, Subscribe, Unsubscribe
from .pykka_internals import ResilientActor

__all__ = ["PROBE_INTERVAL_S", "Member", "Membership", "PoolMember"]

#: How often a device taken out is asked whether it serves again, in seconds.
PROBE_INTERVAL_S: Final = 0.2

_TAG = AllocTag("device pool")


@dataclass(frozen=True)
class PoolMember:
    """A snapshot of one device of a pool: ``ordinal``, ``status`` (``"serving"``,
    ``"restarting"``, ``"poisoned"`` or ``"stopped"``), ``generation``, ``outstanding_bytes`` (the
    pool's live and in-flight allocations on it) and ``rejoins`` (times it came back).

    Thread rule: immutable; any thread.
    """

    ordinal: int
    status: str
    generation: int
    outstanding_bytes: int
    rejoins: int


class Member:
    """One device's record (every field guarded by the membership's lock).

    Thread rule: read and written under :attr:`Membership.lock`.
    """

    __slots__ = ("epoch", "generation", "load", "ordinal", "ref", "rejoins", "state", "status", "watch")

    def __init__(self, ordinal: int, ref: pykka.ActorRef[Any], generation: int, status: str) -> None:
        self.ordinal, self.ref, self.generation = ordinal, ref, generation
        self.status = "serving" if status == "running" else status
        if status not in ("running", "poisoned", "stopped"):
            self.status = "restarting"  # starting, rebuilding, broken: probed until it runs
        self.load = 0
        self.epoch = 0  # bumped when the device comes back at a new generation
        self.rejoins = 0
        self.state: weakref.ref[DeviceState] | None = None
        self.watch: _StateWatch | None = None  # the state holds its bound method weakly: kept here


class _StateWatch:
    """The bound method a device state calls after each change (see the module docstring)."""

    __slots__ = ("__weakref__", "member", "owner", "state")

    def __init__(self, owner: Membership, member: Member, state: DeviceState) -> None:
        self.owner, self.member, self.state = weakref.ref(owner), member, weakref.ref(state)

    def changed(self) -> None:
        owner, state = self.owner(), self.state()
        if owner is not None and state is not None:
            owner.state_changed(self.member, state)


@dataclass(frozen=True)
class _Probe:
    ordinal: int


class _Watcher(ResilientActor):
    """The pool's subscriber and prober; holds the membership weakly. Thread rule: its own thread."""

    def __init__(self, owner: Membership) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)

    def on_receive(self, message: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        if isinstance(message, GenerationChanged):
            owner.changed(message.device_id, message.generation, message.status)
        elif isinstance(message, _Probe):
            owner.probe(message, self.actor_ref)
        return None


class Membership:
    """The devices of one pool; see the module docstring.

    Thread rule: any thread.
    """

    def __init__(self, refs: Sequence[pykka.ActorRef[Any]], describe: str) -> None:
        """Ask each device its ordinal, generation and status, subscribe to it, and watch its state.

        Raises:
            InvalidRequest: something that answers ``GetStats`` otherwise than a device, or two
                devices of one ordinal.
            DeviceUnavailable: a device's actor is gone.
        """
        from ..errors import InvalidRequest

        members: dict[int, Member] = {}
        for ref in refs:
            try:
                stats = ref.ask(GetStats())
            except pykka.ActorDeadError:
                raise DeviceUnavailable(f"{describe}: {ref!r} is stopped") from None
            if not isinstance(stats, DeviceStats):
                raise InvalidRequest(f"{describe}: {ref!r} did not answer GetStats as a device actor does")
            if stats.device_id in members:
                raise InvalidRequest(f"{describe}: two devices of ordinal {stats.device_id}; one per ordinal")
            members[stats.device_id] = Member(stats.device_id, ref, stats.generation, stats.status)
        self.lock = threading.Lock()
        self.members = members
        self.order = sorted(members)
        self.turn = 0
        self.stopped = False
        self.watcher = _Watcher.start(self)
        for member in members.values():
            member.ref.tell(Subscribe(self.watcher))
            if member.status == "serving":
                try:  # a first handle names the device's state, watched from now on
                    first: GpuRef = member.ref.ask(Allocate(256, tag=_TAG))  # type: ignore[assignment]
                    self.watch(member, first)
                except Exception:  # noqa: BLE001 - its failure is the next allocation's business
                    pass
            if member.status == "restarting":
                self.watcher.tell(_Probe(member.ordinal))

    def choose(self, tried: Sequence[int]) -> Member:
        """The serving member of least load not in ``tried``, ties in turn (the lock held).

        Raises:
            DeviceUnavailable: none (or the pool is stopped).
        """
        if self.stopped:
            raise DeviceUnavailable("the DevicePool is stopped")
        order, n = self.order, len(self.order)
        best: Member | None = None
        for i in range(n):
            member = self.members[order[(self.turn + i) % n]]
            if member.status == "serving" and member.ordinal not in tried and (best is None or member.load < best.load):
                best = member
        if best is None:
            states = ", ".join(f"{m.ordinal}: {m.status}" for m in self.members.values())
            raise DeviceUnavailable(f"no device of the pool serves now ({states})")
        self.turn = (order.index(best.ordinal) + 1) % n
        return best

    def give_back(self, member: Member, size: int, epoch: int) -> None:
        """``size`` bytes of ``member``'s load, taken in ``epoch``, are no longer held."""
        with self.lock:
            if member.epoch == epoch:
                member.load -= size

    def answered(self, member: Member, ref: GpuRef) -> None:
        """``member`` answered with ``ref``: watch its state if it is not the one watched."""
        watched = member.state
        if watched is None or watched() is not ref.context.state_ref():
            self.watch(member, ref)

    def watch(self, member: Member, ref: GpuRef) -> None:
        """Watch the device state of ``ref``, a handle ``member`` answered with."""
        state = ref.context.state_ref()
        if state is None:
            return
        watch = _StateWatch(self, member, state)
        with self.lock:
            if member.state is not None and member.state() is state:
                return
            member.state, member.watch = weakref.ref(state), watch  # the old watch goes with its object
        state.add_watcher(watch.changed)
        self.state_changed(member, state)  # a change before the watch was added

    def state_changed(self, member: Member, state: DeviceState) -> None:
        """``member``'s watched state changed: a generation past the one known, a poisoning or a
        shutdown takes it out until it serves again."""
        with self.lock:
            if member.state is None or member.state() is not state or member.status != "serving":
                return
            if state.generation == member.generation and not state.poisoned and state.accepting_ops:
                return
            member.status = "restarting"
        _tell(self.watcher, _Probe(member.ordinal))

    def failed(self, member: Member, generation: int) -> None:
        """An ask sent to ``member`` at ``generation`` failed with the device's status."""
        with self.lock:
            if member.generation != generation or member.status != "serving":
                return  # it came back (or was taken out) meanwhile
            member.status = "restarting"
        _tell(self.watcher, _Probe(member.ordinal))

    def changed(self, ordinal: int, generation: int, status: str) -> None:
        """A device's ``GenerationChanged`` (the watcher's thread)."""
        with self.lock:
            member = self.members.get(ordinal)
            if member is None:
                return
            if status == "running":
                self._rejoin(member, generation)
            elif status in ("poisoned", "stopped"):
                member.status = status

    def _rejoin(self, member: Member, generation: int) -> None:
        """``member`` serves at ``generation`` (the lock held)."""
        if generation != member.generation:
            member.epoch += 1
            member.load = 0
            member.generation = generation
        if member.status != "serving":
            member.rejoins += 1
            member.status = "serving"

    def probe(self, probe: _Probe, watcher: pykka.ActorRef[Any]) -> None:
        """Ask a device taken out whether it serves again (the watcher's thread)."""
        with self.lock:
            member = self.members.get(probe.ordinal)
            if member is None or member.status != "restarting" or self.stopped:
                return
        try:
            stats = member.ref.ask(GetStats(), timeout=30.0)
        except pykka.ActorDeadError:
            with self.lock:
                member.status = "stopped"
            return
        except Exception:  # noqa: BLE001 - not yet: probed again below
            stats = None
        if isinstance(stats, DeviceStats):
            if stats.status in ("running", "stopped", "poisoned"):
                with self.lock:
                    if stats.status == "running":
                        self._rejoin(member, stats.generation)
                    else:
                        member.status = stats.status
                return
            if stats.status == "broken":
                try:  # a broken context is rebuilt by the device's next request, not by a GetStats
                    member.ref.ask(Allocate(256, tag=_TAG), timeout=30.0)
                except Exception:  # noqa: BLE001 - still broken: probed again below
                    pass
        timer = threading.Timer(PROBE_INTERVAL_S, _tell, (watcher, probe))
        timer.daemon = True
        timer.start()

    def snapshot(self) -> list[PoolMember]:
        """Every device's :class:`PoolMember`, by ordinal."""
        with self.lock:
            return [PoolMember(m.ordinal, m.status, m.generation, m.load, m.rejoins)
                    for m in (self.members[o] for o in self.order)]

    def stop(self) -> bool:
        """Unsubscribe and stop the watcher; False when already stopped."""
        with self.lock:
            if self.stopped:
                return False
            self.stopped = True
        for member in self.members.values():
            try:
                member.ref.tell(Unsubscribe(self.watcher))
            except pykka.ActorDeadError:
                pass
        self.watcher.stop()
        return True


def _tell(ref: pykka.ActorRef[Any], message: Any) -> None:
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        pass  # the pool stopped meanwhile
