"""``IsolatedLibrary``: the parent's ``CopyActor``/``KernelActor`` of an isolated device, whose work
runs in the child process, on a real library actor next to the memory.

``CopyActor.start(ref)`` and ``KernelActor.start(ref)`` on the ``ActorRef`` of an isolated device
start one (:func:`start_library`). Each message it gets is forwarded, in order, to the device's
proxy as a :class:`~._protocol.LibraryWork`; the proxy maps every ``GpuRef`` in it to the child's
handle (:func:`to_child`) and sends it down the same pipe as the device's own asks; the child
starts its library actor for this one on first use and serves the message there.

**The asker's path.** While this actor is idle (nothing queued, nothing in hand), an ask of one
of the library messages is forwarded from the asker's own thread (``CallerServedInbox``, as the
device actor serves an ``Allocate``): the export of a foreign source and the ``LibraryWork``,
which the proxy, idle too, sends to the child from that same thread (``_proxy``'s fast path). An
ask of an isolated copy actor then wakes no thread of the parent on its way out: the asker
pickles and writes the frame, the child's frame reader takes it, and the parent's reader answers
the asker, who spins for it. Tells, other messages, asks that find this actor busy or something
queued, and a ``CopyToDevice`` of more than :data:`CALLER_DATA_BYTES` (whose bytes a non-blocking
ask should not wait to write) go through this actor's thread, as before. On the asker's path
``ask`` returns (or starts its timeout) once the message was forwarded: after the export of a
foreign source, a round trip to its device's process unless a kept export serves.

Invariants:

* **Order.** Messages reach the child's library actor in the order each sender sent them: an
  asker forwards its own ask only once everything put before it here was forwarded (the rule of
  ``CallerServedInbox``), the proxy keeps the same rule, and then one pipe and the child's one
  reading thread keep it. Asks of different senders forwarded at once are concurrent, as pykka
  orders nothing between senders.
* **What crosses.** A message is pickled. ``CopyToDevice.data`` goes as its bytes (a numpy
  array or a buffer); ``CopyToHost`` comes back as ``bytes``. Pinned host memory does not cross:
  ``CopyToDevice`` from a ``PinnedBuffer`` and ``CopyToHost(out=...)`` are refused with
  ``InvalidRequest``. A ``Kernel`` crosses by its definition, so its host implementation must be
  picklable (a module-level function); one that is not is refused with ``InvalidRequest``.
* **Handles** are the parent-side handles of the same isolated device; one of another device, or
  a stale one, is refused in the parent before anything is sent (``InvalidRequest``,
  ``GpuRefStale``), with one exception: the source of a ``CopyDeviceToDevice`` may be a handle of
  another device that can export it (another isolated device, or a device of a ``shared=True``
  host driver or the CUDA driver in this process). It is exported here, on the thread that
  forwards the message (an ask of its device: the proxies never wait on each other), and crosses
  as a ``SharedGpuRef``; the child's copy actor pulls it (``actors/shared_copy.py``).
* **Kept exports.** The export of a source of another *isolated* device is a round trip to that
  device's process, which records the interprocess event of the source's last write. This actor
  keeps the imported result (its count held) for the next copies of the same handle, as long as
  the source's device got no library work since and had none in flight when it exported
  (:class:`~._remote.LibraryWorkCount`): everything that writes an isolated device's memory is
  library work, so the kept export's event still marks the source's last write, and a copy of an
  unchanged source costs no round trip to its owner. At most :data:`KEPT_EXPORTS` are kept, the
  least recently used dropped first; one whose handle was released or went stale is dropped at
  the next copy, and all of them when this actor stops. The kept exports are read and changed
  under a lock (two askers may forward at once), never held across the export or a send; two
  askers that miss at once both export, and the later one is kept. The cost: a source dropped
  (not released) by its owner's user stays allocated while it is kept.
* **Kept exports cross as tokens** (:mod:`._sources`): the first copy of a kept export carries
  its ``KeptSource`` with the ``SharedGpuRef``, every later one the token alone, so it takes no
  count here and the child makes no handle (it serves the one that crossed the first time). Each kept export counts the
  messages naming its token that are not yet answered (:class:`LibraryAnswer`'s ``settled``);
  one dropped here is forgotten by the child (``LibraryWork.forget``, on this actor's next
  message) only once none is, so no message naming a token reaches the child after its forget.
* **Waits.** An asker of this actor spins a while for the reply before it sleeps
  (``hot_waits.SpinningFuture``), as the asker of an in-process library actor does.
* **Restarts.** This actor's ``ActorRef`` stays valid across child restarts: the new child starts
  its library actor on the next message; a message in flight when a child dies is answered with
  the death's typed error; a device stopped for good answers ``DeviceUnavailable``.
* **Stop.** Stopping closes the askers' path and waits for the asks being forwarded on it, so
  the child's actor is stopped (``LibraryStop``) after every message forwarded before.

Thread rules: forwarding runs on this actor's thread or on an asker's (the asker's path, while
this actor is idle); replies are set by the proxy's reader thread.

Past 400 lines: the actor's two forwarding paths (its thread, an asker's) share the kept
exports, their lock and the stop's wait for asks in flight; apart, each would have to restate
the other's invariants.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import pykka

from ..._core.doorbell import Doorbell
from ...errors import DeviceUnavailable, GpuRefStale, InvalidRequest
from ...memory.pinned import PinnedBuffer
from ..caller_inbox import CallerServedInbox
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, SpinningFuture, spin_budget
from ..library_messages import BufferArg, CopyDeviceToDevice, CopyToDevice, CopyToHost, Fill, Launch, Launches
from ..messages import GetStats
from ..pykka_internals import ResilientActor, answer, ask_into
from ..shared_ref import SharedGpuRef, export_ref, import_ref
from ._protocol import MESSAGE_FIELDS, LibraryStop, LibraryWork, PickledWork, RemoteHandle
from ._remote import RemoteContext
from ._sources import KeptSource

if TYPE_CHECKING:
    from ._link import ChildLink

__all__ = [
    "CALLER_DATA_BYTES", "KEPT_EXPORTS", "IsolatedLibrary", "LibraryAnswer", "map_refs", "payload_of", "start_library",
    "to_child",
]

#: Exports of other isolated devices' sources a copy actor keeps for its next copies.
KEPT_EXPORTS: Final = 4

#: The largest ``CopyToDevice.data`` (bytes) an asker's own thread forwards; a larger one is
#: pickled and written to the pipe on the actor's thread, so a non-blocking ask of it returns
#: before its bytes are written.
CALLER_DATA_BYTES: Final = 1 << 20

logger = logging.getLogger(__name__)

_MESSAGES = (CopyToDevice, CopyToHost, CopyDeviceToDevice, Fill, Launch, Launches)


def map_refs(value: Any, leaf: Any) -> Any:
    """``value`` with every handle in it replaced by ``leaf(handle)``: in a library message, its
    fields, a ``BufferArg``, and lists and tuples of them; anything else is kept as it is (the
    library actor judges it).

    Args:
        value: a library message or a part of one.
        leaf: maps one handle (a ``GpuRef`` in the parent, a ``RemoteHandle`` in the child).
    Returns:
        the mapped value (the same object when nothing in it is a handle's type).
    Raises:
        whatever ``leaf`` raises.
    Thread rule: any thread.
    """
    if isinstance(value, (GpuRef, RemoteHandle)):
        return leaf(value)
    if type(value) is BufferArg:
        return BufferArg(map_refs(value.ref, leaf), value.access)
    if type(value) in (list, tuple):
        return type(value)(map_refs(item, leaf) for item in value)
    names = MESSAGE_FIELDS.get(type(value))
    if names is not None:
        changes = {name: map_refs(getattr(value, name), leaf) for name in names}
        return type(value)(**changes)  # what dataclasses.replace does, without its field walk
    return value


def to_child(message: Any, owner: str, ctx: RemoteContext, ordinal: int) -> Any:
    """``message`` as the child serves it: every ``GpuRef`` a ``RemoteHandle``, a buffer as bytes.

    Args:
        message: a library actor's message, asked in the parent.
        owner: the isolated device's actor URN (a handle must be of it).
        ctx: the serving child's current context (a handle must be of it).
        ordinal: the device ordinal, for the errors.
    Returns:
        the payload of the ``LibraryWork`` sent to the child.
    Raises:
        InvalidRequest: pinned host memory, or a handle of another device.
        GpuRefStale: a released handle, or one of a replaced generation or process.
    Thread rule: the proxy's thread.
    """
    where = type(message).__name__
    if isinstance(message, CopyToDevice):
        if isinstance(message.data, PinnedBuffer):
            raise InvalidRequest(
                f"CopyToDevice.data: a PinnedBuffer cannot cross to isolated device {ordinal}'s process; "
                "pass bytes or a numpy array"
            )
        try:
            view = memoryview(message.data)
        except TypeError:
            pass  # not a buffer: the library actor refuses it
        else:
            if not view.c_contiguous:  # pickling would make it contiguous: refuse it as the actor does
                raise InvalidRequest(
                    f"CopyToDevice.data must be a C-contiguous buffer, got a non-contiguous "
                    f"{type(message.data).__name__}"
                )
            if isinstance(message.data, memoryview):
                message = dataclasses.replace(message, data=view.tobytes())  # a view cannot be pickled
    if isinstance(message, CopyToHost) and message.out is not None:
        raise InvalidRequest(
            f"CopyToHost.out: pinned memory cannot cross to isolated device {ordinal}'s process; "
            "leave out as None to get the bytes"
        )

    def handle(ref: GpuRef | RemoteHandle) -> RemoteHandle:
        if isinstance(ref, RemoteHandle):
            raise InvalidRequest(f"{where}: a RemoteHandle is the wire's, not a handle; pass a GpuRef")
        ref_ctx = ref.context
        if not isinstance(ref_ctx, RemoteContext) or ref_ctx.owner != owner:
            raise InvalidRequest(
                f"{where}: {ref!r} is not a handle of isolated device {ordinal}; its library actors take only its "
                "own handles (a peer copy does not cross processes)"
            )
        ref.access()  # GpuRefStale: released, rebuilt, poisoned, shutting down
        if ref_ctx is not ctx:
            raise GpuRefStale("context rebuilt", f"{where}: {ref!r}: its process or generation was replaced")
        return RemoteHandle(ref.block.ptr, ctx.child_generation)

    return map_refs(message, handle)


def payload_of(work: LibraryWork, owner: str, child: ChildLink, ordinal: int) -> LibraryWork | PickledWork:
    """``work`` as ``child`` gets it: its message through :func:`to_child`. A copy of a kept
    source (its token alone) into a handle of the child's current context, with nothing to
    forget, is pickled once and its bytes sent again while it is the same copy
    (``child.last_work``): the same library actor, kept export (an ``ident`` names one export)
    and destination address in the same child generation, which is everything its payload holds.
    The destination is still validated every time, as ``to_child`` validates it; one that fails
    takes ``to_child``'s path, which raises its error.

    Args:
        work: the ``LibraryWork`` asked of the proxy.
        owner: the proxy's actor URN.
        child: the serving child's link.
        ordinal: the device ordinal, for the errors.
    Returns:
        The payload to send: a ``LibraryWork``, or the ``PickledWork`` of one.
    Raises:
        InvalidRequest, GpuRefStale: as :func:`to_child`.
    Thread rule: the proxy's thread, or an asker's on the fast path (several at once: the cached
    pair is read and replaced whole).
    """
    message, ctx = work.message, child.ctx
    if not work.forget and type(message) is CopyDeviceToDevice:
        src: object = message.src  # the message's type names a GpuRef
        dst = message.dst
        if type(src) is KeptSource and not src.carry and type(dst) is GpuRef:
            dst_ctx: object = dst.context  # a RemoteContext, for a handle of an isolated device
            cached = _cached_copy(work, src, dst, dst_ctx, ctx, child)
            if cached is not None:
                return cached
    return LibraryWork(work.library, work.actor_class, work.track, to_child(message, owner, ctx, ordinal), work.forget)


def _cached_copy(work: LibraryWork, src: KeptSource, dst: GpuRef, dst_ctx: object, ctx: RemoteContext,
                 child: ChildLink) -> PickledWork | None:
    """:func:`payload_of`'s pickled copy of a kept source into ``dst``, or None when ``dst`` is
    not a valid handle of ``ctx`` (the child's current context) or the work does not pickle
    (``to_child`` and the send then say why)."""
    if dst_ctx is not ctx:
        return None
    try:
        dst.access()
    except GpuRefStale:
        return None
    ptr = dst.block.ptr
    key = (work.library, work.actor_class, work.track, src.ident, ptr, ctx.child_generation)
    last = child.last_work
    if last is not None and last[0] == key:
        cached: PickledWork = last[1]
        return cached
    copy = CopyDeviceToDevice(src, RemoteHandle(ptr, ctx.child_generation))  # type: ignore[arg-type]
    try:
        payload = PickledWork(pickle.dumps(LibraryWork(work.library, work.actor_class, work.track, copy),
                                           pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - an actor class that cannot cross: the send refuses it as always
        return None
    child.last_work = (key, payload)
    return payload


class LibraryAnswer:
    """The reply slot of one forwarded message (a ``pykka_internals.Reply``): the asker's future,
    with a proxy that stopped meanwhile answered as ``DeviceUnavailable``; a told message's
    failure is logged. ``settled``, when given, is called once the message is answered, before
    the asker hears (its frame, if one was sent, was served or its child is gone), whichever
    way it is: :class:`IsolatedLibrary` counts there the frames naming a kept source that are
    in flight, and takes back the kept sources a refused frame was to tell the child to forget.
    Thread rule: set once, from whichever thread answers."""

    __slots__ = ("_future", "_settled", "_what")

    def __init__(self, future: pykka.Future[Any] | None, what: str,
                 settled: Callable[[bool], None] | None = None) -> None:
        """Args:
            future: the asker's future (None: a told message).
            what: the library actor, for errors and the log.
            settled: called with whether the answer is an error, once, before the asker hears.
        """
        self._future = future
        self._what = what
        self._settled = settled

    def _settle(self, failed: bool) -> None:
        settled, self._settled = self._settled, None
        if settled is not None:
            settled(failed)

    def set(self, value: Any | None = None) -> None:
        """The reply, to the asker (nothing for a told message). Thread rule: the answering thread."""
        self._settle(False)
        if self._future is not None:
            self._future.set(value)

    def set_exception(self, exc_info: Any = None) -> None:
        """The error (the one being handled when ``exc_info`` is None), to the asker; a told
        message's is logged. Thread rule: the answering thread."""
        exc_info = exc_info if exc_info is not None else sys.exc_info()
        self._settle(True)
        if isinstance(exc_info[1], pykka.ActorDeadError):
            error = DeviceUnavailable(f"{self._what}: its isolated device was stopped")
            exc_info = (type(error), error, None)
        if self._future is not None:
            self._future.set_exception(exc_info)
        else:
            logger.warning("%s dropped a told message that failed: %r", self._what, exc_info[1])

    def fill(self, value: Any, exc_info: Any | None) -> Doorbell | None:
        """Answer as :meth:`set` (``exc_info`` None) or :meth:`set_exception` would, but leave
        the asker's ``SpinningFuture`` unrung and return its bell, for the child's reader to
        ring once it let go of the GIL (``_reader.RING_AFTER_RELEASE``); None when it answered
        in full already. Thread rule: the reader thread."""
        future = self._future
        if type(future) is SpinningFuture and (exc_info is None or not isinstance(exc_info[1], pykka.ActorDeadError)):
            self._settle(exc_info is not None)
            return future.fill(value, exc_info)
        answer(self, value, exc_info)
        return None


#: The numbers of kept exports (``KeptSource.ident``): one per kept export of this process, never
#: given twice, so that a child never serves one export for another.
_idents = itertools.count(1)


class _Kept:
    """An export this actor keeps: the source handle, its import here, its device's library work
    count when it was asked, the token it crosses to the child as, the frames naming that token
    not yet answered (``inflight``), and whether it was dropped here (the child is told to forget
    it once ``inflight`` is zero)."""

    __slots__ = ("dropped", "inflight", "mark", "ref", "shared", "source")

    def __init__(self, ref: GpuRef, shared: SharedGpuRef, mark: tuple[int, int]) -> None:
        self.ref = ref
        self.shared = shared
        self.mark = mark
        self.source = KeptSource(next(_idents), pickle.dumps(shared.export, pickle.HIGHEST_PROTOCOL), shared)
        self.inflight = 0
        self.dropped = False

    def usable(self) -> bool:
        """Neither handle released nor stale."""
        if self.ref.released or self.shared.released:
            return False
        try:
            self.shared.access()
        except GpuRefStale:
            return False
        return True


class IsolatedLibrary(ResilientActor):
    """A ``CopyActor`` or ``KernelActor`` of an isolated device, in the parent; see the module
    docstring. It serves whatever its class serves, with the same replies and errors, except
    pinned host memory (refused).

    Thread rule: as any pykka actor; ask or tell it from any thread.
    """

    def __init__(self, device: pykka.ActorRef[Any], actor_class: type, track: bool) -> None:
        """Args:
            device: the ``ActorRef`` of the isolated device.
            actor_class: the library actor class the child runs (``CopyActor``, ``KernelActor``).
            track: the library actor's ``track``.
        Thread rule: the caller's thread (``start`` runs it there).
        """
        super().__init__()
        self._device = device
        self._class = actor_class
        self._track = track
        self._what = repr(self)
        #: Guards ``_kept``, ``_serving`` and ``_closed``: held only while they are read or
        #: changed, never across an ask or a send.
        self._lock = threading.Lock()
        self._served = threading.Condition(self._lock)
        #: Exports of other isolated devices' sources, by the source handle's id (the entry
        #: holds the handle, so the id is not reused while it is there).
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        #: Asks being served in their askers' threads now, and whether ``on_stop`` closed that
        #: path (see :meth:`_serve_in_caller`).
        self._serving = 0
        self._closed = False
        #: The kept sources dropped here whose frames were all answered: the next message tells
        #: the child to forget them (``LibraryWork.forget``, see :mod:`._sources`).
        self._forget: list[int] = []

    def __repr__(self) -> str:
        return f"IsolatedLibrary({self._class.__name__}, {self._device})"

    # -- pykka hooks ------------------------------------------------------------------------------
    @staticmethod
    def _create_actor_inbox() -> CallerServedInbox:
        return CallerServedInbox()

    @staticmethod
    def _create_future() -> SpinningFuture:
        # pykka's hook, for ``ask``: the asker spins a while for the reply before it sleeps, as
        # the asker of an in-process library actor does (hot_waits): a copy that replies once it
        # landed answers within the spin, and the asker does not pay a wake-up on top.
        return SpinningFuture(spin_budget(FUTURE_SPIN_S))

    def on_start(self) -> None:
        """Let askers forward their asks from their own threads while this actor is idle (see
        the module docstring). Thread rule: this actor's thread (pykka calls it)."""
        inbox = self.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        inbox.serve_in_caller(_MESSAGES, self._serve_in_caller)

    def _handle_envelope(self, envelope: Any, receive: Any = None) -> None:
        # Not answered here: the proxy's reader thread answers the asker once the child replied.
        if type(envelope.message).__module__.startswith("pykka"):  # a stop, a proxy call: this actor's own
            super()._handle_envelope(envelope, receive)
            return
        self._forward(envelope.message, envelope.reply_to)

    def _serve_in_caller(self, envelope: Any) -> Any:
        """Forward ``envelope``'s ask from the asker's thread (``CallerServedInbox.put`` calls it
        while this actor is idle and nothing is queued): None once forwarded, or ``envelope``
        for this actor's thread to take (a large ``CopyToDevice``, or this actor stopping)."""
        message = envelope.message
        if type(message) is CopyToDevice and not _small(message.data):
            return envelope  # its bytes are pickled and written on this actor's thread, not the asker's
        with self._lock:
            if self._closed:
                return envelope  # stopping: its teardown answers it, as pykka answers a late ask
            self._serving += 1
        try:
            self._forward(message, envelope.reply_to)
        finally:
            with self._lock:
                self._serving -= 1
                if not self._serving:
                    self._served.notify_all()
        return None

    def _forward(self, message: Any, reply_to: pykka.Future[Any] | None) -> None:
        """Send ``message`` to the device's proxy as a ``LibraryWork`` answered into
        ``reply_to`` (the source of a copy from another device exported first). Thread rule:
        this actor's thread, or an asker's (``_serve_in_caller``)."""
        kept: _Kept | None = None
        if type(message) is CopyDeviceToDevice and self._foreign(message.src):
            try:  # a handle of another device: it crosses as a SharedGpuRef (see the module docstring)
                source, kept = self._shared_source(message.src)  # or as the token of a kept export
                message = CopyDeviceToDevice(source, message.dst)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - the asker's answer
                LibraryAnswer(reply_to, self._what).set_exception()
                return
        with self._lock:
            forget, self._forget = tuple(self._forget), []
        settled = None if kept is None and not forget else self._settler(kept, forget)
        ask_into(self._device, LibraryWork(self.actor_urn, self._class, self._track, message, forget),
                 LibraryAnswer(reply_to, self._what, settled))

    def _settler(self, kept: _Kept | None, forget: tuple[int, ...]) -> Callable[[bool], None]:
        """What the answer of a message naming ``kept``'s token (None: none) and telling the
        child to forget ``forget`` calls once it is answered: the token's frame is no longer in
        flight (a dropped one's forget is due once none is), and a failed message's forgets
        are taken back for the next one (it may not have been sent; telling the child twice is
        harmless, its idents are never given again)."""

        def settled(failed: bool) -> None:
            with self._lock:
                if kept is not None:
                    kept.inflight -= 1
                    if kept.dropped and not kept.inflight:
                        self._forget.append(kept.source.ident)
                if failed and forget:
                    self._forget.extend(forget)

        return settled

    def _drop(self, entry: _Kept | None) -> None:
        """Drop ``entry`` from what is kept (under ``_lock``): the child is told to forget its
        token once no frame naming it is in flight."""
        if entry is None or entry.dropped:
            return
        entry.dropped = True
        if not entry.inflight:
            self._forget.append(entry.source.ident)

    def _shared_source(self, ref: GpuRef) -> tuple[SharedGpuRef | KeptSource, _Kept | None]:
        """``ref`` (a handle of another device) as the child gets it: the token of the export
        kept for it when that is still the export of its last write (see the module docstring),
        else a fresh export, kept (and sent as its token) when nothing was in flight on the
        source's device. The kept exports are read and changed under ``_lock``; the export
        itself, an ask of the source's device, is made without it, and the entries dropped go
        (their counts given back) once it is released.

        Returns:
            What the message carries (a ``SharedGpuRef``, or a ``KeptSource`` counted in flight
            in its entry until the message is answered), and that entry (None for a
            ``SharedGpuRef``).
        Raises:
            GpuRefStale, InvalidRequest, DeviceUnavailable, DriverError: as the export.
        """
        ctx = ref.context
        if not isinstance(ctx, RemoteContext):
            return import_ref(self._export(ref)), None  # exported in this process: no round trip to save
        ref.access()  # a stale or released source is refused as its export would refuse it
        key = id(ref)
        dropped: list[_Kept] = []
        with self._lock:
            kept = self._kept
            for old_key, old in list(kept.items()):
                if not old.usable():
                    dropped.append(kept.pop(old_key))
                    self._drop(old)
            mark = ctx.work.mark()  # before the export: work sent meanwhile makes it differ next time
            entry = kept.get(key)
            if entry is not None and entry.ref is ref and entry.mark == mark:
                kept.move_to_end(key)
                entry.inflight += 1
                return entry.source, entry
            if entry is not None:
                dropped.append(kept.pop(key))
                self._drop(entry)
        del dropped  # their counts go back with them, outside the lock
        shared = import_ref(self._export(ref))
        if mark[0] != mark[1]:  # library work in flight: the export's event may miss its write
            return shared, None
        made = _Kept(ref, shared, mark)
        evicted: list[_Kept | None] = []
        with self._lock:
            other = kept.pop(key, None)  # another asker's, made meanwhile
            evicted.append(other)
            self._drop(other)
            kept[key] = made
            made.inflight += 1
            while len(kept) > KEPT_EXPORTS:
                oldest = kept.popitem(last=False)[1]
                evicted.append(oldest)
                self._drop(oldest)
        del evicted
        return made.source.carrying(), made  # the first copy carries the export in full

    def _export(self, ref: GpuRef) -> Any:
        """``ref`` exported for the child, or ``InvalidRequest`` naming why it cannot cross."""
        try:
            return export_ref(ref)
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"CopyDeviceToDevice.src: {ref!r} is not a handle of isolated device {self._device_ordinal()}, "
                f"and its device cannot export it to another process: {exc}"
            ) from None

    def _device_ordinal(self) -> object:
        """This actor's device ordinal, for an error (asked: the error path only)."""
        try:
            return self._device.ask(GetStats(), timeout=10.0).device_id  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - only the message's wording depends on it
            return "?"

    def _foreign(self, ref: object) -> bool:
        """Whether ``ref`` is a handle of a device other than this actor's."""
        if not isinstance(ref, GpuRef):
            return False
        ctx = ref.context
        return not isinstance(ctx, RemoteContext) or ctx.owner != self._device.actor_urn

    def on_stop(self) -> None:
        """Close the askers' path and wait for the asks being forwarded on it, drop the kept
        exports (their counts go back) and have the child stop its library actor (after every
        message forwarded before). Thread rule: this actor's thread."""
        inbox = self.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        inbox.serve_in_caller((), None)
        with self._lock:
            self._closed = True
            while self._serving:
                self._served.wait()
            dropped = list(self._kept.values())
            self._kept.clear()
            self._forget.clear()  # the child drops every kept source of this actor at its stop
        del dropped
        try:
            self._device.tell(LibraryStop(self.actor_urn))
        except pykka.ActorDeadError:
            pass  # the device went first, and its child with it


def _small(data: object) -> bool:
    """Whether ``CopyToDevice.data`` is at most :data:`CALLER_DATA_BYTES` (a non-buffer counts as
    small: it is refused at once)."""
    try:
        return memoryview(data).nbytes <= CALLER_DATA_BYTES  # type: ignore[arg-type]
    except TypeError:
        return True


def start_library(actor_class: type, device: pykka.ActorRef[Any], track: object = True) -> pykka.ActorRef[Any]:
    """``CopyActor.start(device)``/``KernelActor.start(device)`` on an isolated device.

    Args:
        actor_class: the library actor class.
        device: the isolated device's ``ActorRef``.
        track: the library actor's ``track`` (a bool).
    Returns:
        the ``ActorRef`` of an :class:`IsolatedLibrary`.
    Raises:
        InvalidRequest: ``track`` is not a bool; nothing is started.
    Thread rule: any thread.
    """
    if not isinstance(track, bool):
        raise InvalidRequest(f"{actor_class.__name__}.start: track must be a bool, got {track!r}")
    ref: pykka.ActorRef[Any] = IsolatedLibrary.start(device, actor_class, track)
    return ref
