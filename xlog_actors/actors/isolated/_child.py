"""The child process of an isolated device: its own driver and a normal ``DeviceActor``, served
over the pipe of :mod:`._protocol`.

The child boots (imports) before it knows its device, so the parent can keep one booted child in
reserve and hand it the device the moment the serving child dies: ``serve`` says ``booted``,
waits for ``config``, opens the driver, starts the device actor with a supervisor whose
escalation hook reports the poisoning to the parent and exits with ``EXIT_POISONED``, and then
serves frames until ``stop`` or the end of the pipe (the parent is gone).

Handles: every ``GpuRef`` the device answers with stays in :class:`_Handles` (keyed by address)
until the parent drops or frees it, so the memory lives while the parent holds the handle. A
handle of an older generation of the child's own context (an in-process rebuild) is dropped when
the child's device tells its subscribers of the rebuild; its memory went with that context.

Library actors: the work of a parent-side ``CopyActor``/``KernelActor`` (a ``LibraryWork``) is
served by a real one here, started on the child's device on first use and kept by the parent
actor's URN until a ``LibraryStop``; the parent's handles in it are replaced by the ones in
:class:`_Handles` (``GpuRefStale("released")`` when one is gone), so writes are recorded on the
child's handles, where the tracking of every library actor here, and an export, see them. A copy's
source that crossed as the token of a kept export is replaced by the handle this process made of
that export, kept per parent actor until the parent forgets it or the actor stops (``_sources``).

Ordering: the frame reader serves an ``Allocate`` or a ``Free`` itself, through the device's
``DeviceClient``, only while the device actor is quiet (nothing queued, nothing being served:
``CallerServedInbox.quiet``; no dropped handle waiting for it to free it), so every frame read
before it has been served and every dropped handle freed; otherwise it goes to the actor's
inbox behind them. The frees of dropped parent handles are freed the same way when the parent's was the last
reference (an export's pin or a library actor's work keeps the block alive: then the reference
is dropped, and the actor frees the block before its next message). An ``Allocate`` with a
memory-history origin always goes to the actor.

Thread rules: frames are read on the child's main thread, which spins on the pipe a while after
each frame before it sleeps (only on machines of four cores or more), and on, a while at a time,
while library work it handed to a library actor is unanswered or was answered during the last
while (the asker's next message follows the reply: a back-to-back copy finds it awake), up to
``WORK_SPIN_S`` in all; replies are sent by the
thread that served the ask (the reader's, or the device actor's through a future whose ``set``
sends them: no extra thread hop); generation frames by a listener actor.
:class:`~._protocol.Channel` keeps concurrent frames whole.

Past 400 lines: the frame server, the quiet-inbox rule it serves by and the fault hook share one
frame loop and its handle table; split apart, each would need the others' state in view.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pykka

from ..._core import call_lane as lanes
from ..._core.call_lane import CallLane
from ..._core.doorbell import Doorbell
from ...driver.host import MAX_EMULATED_DEVICES, HostDriver
from ...driver.open import open_driver
from ...driver.protocol import Driver
from ...driver.shared_memory import SharedSegment
from ...errors import GpuRefStale, InvalidRequest, XlogError
from ...kernels import Kernel
from ...memory.block import AllocTag, StreamId
from ..caller_inbox import CallerServedInbox
from ..copy_actor import CopyActor
from ..device_actor import DeviceActor
from ..device_client import DeviceClient
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, INBOX_SPIN_S, spin_budget
from ..kernel_actor import KernelActor
from ..library_messages import CopyDeviceToDevice, CopyToHost, Launch
from ..messages import Allocate, Free, GenerationChanged, GetClient, GetStats, Subscribe
from ..pykka_internals import ask_into, ask_into_unrung
from ..served_ref import NOT_SERVED
from ..shared_copy import EnqueueShared
from ..shared_ref import SharedGpuRef, export_ref
from ..supervisor import Supervisor, exit_process
from ._library import KEPT_EXPORTS, map_refs
from ._protocol import (
    FAULT_KINDS,
    STATE_INDEX,
    Channel,
    ChildFault,
    ExportBlock,
    FreeBlock,
    LibraryStop,
    LibraryWork,
    RemoteBlock,
    encode_error,
    loads_payload,
)
from ._sources import KeptImports, KeptSource

__all__ = ["serve"]


#: What the child allocates and gives back before it serves (see ``serve``).
_WARM_BYTES = 256  # the pool grows by its own granule whatever the size; a budget is no obstacle

logger = logging.getLogger(__name__)

#: The kernel of ``ChildFault("illegal_address")``: one store to address 16.
_WRITE_TO_16 = Kernel(
    name="xlog_write_to_16",
    params=("u64",),
    host=lambda mem, grid, block, ptr: mem.array(ptr, 4, np.uint8).fill(1),
    source='extern "C" __global__ void xlog_write_to_16(unsigned long long p) { *(volatile int*)p = 1; }',
)


#: How long, in all, the frame reader spins for the next frame while library work it handed on is
#: in flight (see ``_Server.spin_for_frame``): the bound of an asker's own spin for its reply.
WORK_SPIN_S = FUTURE_SPIN_S

#: What the frame reader serves itself when the device actor is quiet (see ``_Server.serve_here``).
_SERVED_HERE = (Allocate, Free)


class _Handles:
    """The child's live handles that the parent holds, by address. Thread rule: any thread
    (single dict operations under the GIL)."""

    def __init__(self) -> None:
        self._refs: dict[int, GpuRef] = {}

    def keep(self, ref: GpuRef) -> RemoteBlock:
        self.hold(ref)
        return RemoteBlock(ref.block, ref.generation)

    def hold(self, ref: GpuRef) -> None:
        self._refs[ref.block.ptr] = ref

    def get(self, ptr: int, generation: int) -> GpuRef | None:
        ref = self._refs.get(ptr)
        return ref if ref is not None and ref.generation == generation else None

    def take(self, ptr: int, generation: int) -> GpuRef | None:
        ref = self._refs.get(ptr)
        if ref is None or ref.generation != generation:
            return None
        # Only this entry: once popped, another thread may already have stored a new handle at
        # the same address (stream-ordered reuse).
        if self._refs.pop(ptr, None) is not ref:
            return None
        return ref

    def drop_older(self, generation: int) -> None:
        for ptr, ref in list(self._refs.items()):
            if ref.generation < generation and self._refs.get(ptr) is ref:
                del self._refs[ptr]


class _Reply:
    """The reply slot of one asked frame (a ``pykka_internals.Reply``): its ``set`` sends the
    reply to the parent, on the thread that answers (the device actor's). No future: nobody in
    the child waits on it."""

    __slots__ = ("_channel", "_handles", "rid")

    def __init__(self, channel: Channel, handles: _Handles, rid: int) -> None:
        self._channel = channel
        self._handles = handles
        self.rid = rid

    def set(self, value: Any | None = None) -> None:
        if isinstance(value, GpuRef):
            value = self._handles.keep(value)
        elif isinstance(value, list) and value and isinstance(value[0], GpuRef):
            value = [self._handles.keep(ref) for ref in value]
        self._send(True, value)

    def set_exception(self, exc_info: Any = None) -> None:
        exc = (exc_info if exc_info is not None else sys.exc_info())[1]
        self._send(False, encode_error(exc if exc is not None else RuntimeError("no error given")))

    def _send(self, ok: bool, value: Any) -> None:
        try:
            self._channel.send(("reply", self.rid, ok, value))
        except InvalidRequest as exc:  # (before ValueError, its base) a reply that cannot be pickled
            self._send(False, encode_error(exc))
        except (OSError, ValueError):
            pass  # the parent is gone: the main loop ends at the end of the pipe


class _WorkCount:
    """The library work the frame reader handed to the child's library actors (``forwarded``,
    counted by the reader) and the replies those actors sent for it (``answered``, counted by
    whichever library actor's thread replied, under a lock): what the reader's spin reads.
    Thread rule: see the fields."""

    __slots__ = ("_lock", "answered", "forwarded")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.forwarded = 0
        self.answered = 0

    def answer(self) -> None:
        with self._lock:
            self.answered += 1


class _WorkReply(_Reply):
    """The reply slot of a ``LibraryWork`` handed to a library actor: a ``_Reply`` that counts
    its answer in the server's :class:`_WorkCount` once sent."""

    __slots__ = ("_count",)

    def __init__(self, channel: Channel, handles: _Handles, rid: int, count: _WorkCount) -> None:
        super().__init__(channel, handles, rid)
        self._count = count

    def set(self, value: Any | None = None) -> None:
        try:
            super().set(value)
        finally:
            self._count.answer()

    def set_exception(self, exc_info: Any = None) -> None:
        exc_info = exc_info if exc_info is not None else sys.exc_info()
        try:
            super().set_exception(exc_info)
        finally:
            self._count.answer()


class _LaneReply:
    """The reply slot of a call-lane request that the frame reader serves (``serve_here``): a
    handle is answered in the lane, an error on the pipe under the request id (the slot says
    ``PIPED``)."""

    __slots__ = ("_lane", "_rid", "_server", "_slot")

    def __init__(self, lane: CallLane, slot: int, server: _Server, rid: int) -> None:
        self._lane = lane
        self._slot = slot
        self._server = server
        self._rid = rid

    def set(self, ref: GpuRef) -> None:
        self._server.handles.hold(ref)
        block = ref.block
        self._lane.done(self._slot, block.ptr, block.nbytes, block.align, int(block.alloc_stream),
                        int(block.generation), STATE_INDEX[block.state], ref.generation)

    def set_exception(self, exc_info: Any = None) -> None:
        self._lane.piped(self._slot)
        _Reply(self._server.channel, self._server.handles, self._rid).set_exception(exc_info)


class _Listener(pykka.ThreadingActor):
    """Subscribed to the child's device: tells the parent of every status change."""

    def __init__(self, channel: Channel, handles: _Handles) -> None:
        super().__init__()
        self._channel = channel
        self._handles = handles

    def on_receive(self, message: Any) -> None:
        if isinstance(message, GenerationChanged):
            self._handles.drop_older(message.generation)
            try:
                self._channel.send(("generation", message.generation, message.status))
            except (OSError, ValueError):
                pass  # the parent is gone


class _Server:
    """Serves the frames of one configured child."""

    def __init__(
        self, channel: Channel, driver: Driver, ordinal: int, device: pykka.ActorRef[Any],
        lane: CallLane | None = None,
    ) -> None:
        self.channel = channel
        self.lane = lane
        self.driver = driver
        self.ordinal = ordinal
        self.device = device
        self.handles = _Handles()
        self.held: list[Any] = []
        self.fault: ChildFault | None = None
        inbox = device.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        self.inbox = inbox
        self.client: DeviceClient = device.ask(GetClient())  # type: ignore[assignment]
        self.lifecycle = self.client._cell.lifecycle  # the device's, read-only here
        #: The library actors serving the parent's, by the parent actor's URN.
        self.libraries: dict[str, pykka.ActorRef[Any]] = {}
        #: The handles of each parent library actor's kept copy sources, by its URN (``_sources``).
        self.sources: dict[str, KeptImports] = {}
        self.work = _WorkCount()
        #: The doorbell of the library actor last handed work, not yet rung: the frame reader
        #: rings it once it lets go of the GIL, in its next wait (``put_unrung`` says why).
        self.bell: Doorbell | None = None

    def loop(self) -> None:
        listener = _Listener.start(self.channel, self.handles)
        self.device.ask(Subscribe(listener))
        spin = spin_budget(INBOX_SPIN_S)
        channel, lane = self.channel, self.lane
        fd = channel.fileno()
        while True:
            try:
                if lane is not None:
                    # Requests in the lane first, each once the frames sent before it are read.
                    found = self.spin_for_frame(lambda s, bell: lane.wait(fd, s, channel.received, bell), spin,
                                                lanes.NOTHING)
                    if found == lanes.NOTHING:
                        found = lane.sleep(fd, channel.received, self.take_bell())
                    if found == lanes.REQUEST:
                        self.serve_lane(lane)
                        continue
                elif spin:
                    self.spin_for_frame(channel.spin, spin, False)  # the next ask of a burst: look before sleeping
                if (bell := self.take_bell()) is not None:
                    bell.ring()  # no spin here: nothing spins on it either, but ring what was promised
                frame = channel.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            kind = frame[0]
            if kind == "ask":
                if frame[3] is not None:
                    self.free(*frame[3])  # dropped before the ask was made: freed before it is served
                self.ask_payload(frame[1], frame[2])
            elif kind == "free":
                self.free(frame[1], frame[2])
            elif kind == "stop":
                return

    def take_bell(self) -> Doorbell | None:
        """The library actor's bell still to ring (:attr:`bell`), now the caller's to ring.
        Thread rule: the frame reader's."""
        bell, self.bell = self.bell, None
        return bell

    def spin_for_frame(self, wait: Callable[[float, Doorbell | None], Any], spin: float, nothing: Any) -> Any:
        """Look for the next frame before sleeping: ``wait(seconds, bell)`` spins up to
        ``seconds``, ringing ``bell`` first once the GIL is released (the library actor last
        handed work, :attr:`bell`), and returns ``nothing`` when none came. One ``spin`` after
        every frame; more, ``spin`` at a time, while library work handed to a library actor here
        is unanswered or was answered during the last one (its asker's next message follows that
        reply within microseconds, and a copy takes milliseconds), up to :data:`WORK_SPIN_S` in
        all. What ``wait`` returned last. Thread rule: the frame reader's (the main thread)."""
        work = self.work
        spent = 0.0
        while True:
            answered = work.answered
            found = wait(spin, self.take_bell())
            spent += spin
            if found != nothing or spent >= WORK_SPIN_S or not spin:
                return found
            if work.forwarded == answered == work.answered:
                return found  # nothing in flight, nothing answered meanwhile: no message is due

    def serve_lane(self, lane: CallLane) -> None:
        """Serve every call-lane request whose earlier frames were read: its frees, then its
        allocation, answered in the lane when this thread serves it (``serve_here``: the device
        actor quiet) and it succeeds, else through the pipe under its request id (the slot says
        ``PIPED``)."""
        while (request := lane.take(self.channel.received)) is not None:
            slot, rid, nbytes, stream, tag, free_generation, frees, abandoned = request
            if frees:
                self.free(free_generation, frees)
            message = Allocate(nbytes, StreamId(stream), AllocTag(tag.decode()))
            if abandoned:
                self.ask(rid, message)  # its asker waits on the pipe now
            elif self.fault is not None or not self.serve_here(message, _LaneReply(lane, slot, self, rid)):
                lane.piped(slot)
                self.ask(rid, message)  # held by a fault, or queued behind the actor's work

    def quiet(self) -> bool:
        """The device actor has served everything put to it, and no dropped handle waits for it
        to free it: this thread may serve the next frame itself (see the module docstring)."""
        if not self.inbox.quiet():
            return False
        ctx = self.lifecycle.context
        return ctx is None or not ctx.reclaims

    def free(self, generation: int, ptrs: list[int]) -> None:
        for ptr in ptrs:
            ref = self.handles.take(ptr, generation)
            # Two references (this name and getrefcount's argument): the table's was the last,
            # so dropping it would free the block now; an export's pin or a library actor's work
            # keeps it alive instead, and then only the drop below is right.
            if ref is not None and sys.getrefcount(ref) == 2 and self.quiet():
                try:
                    self.client.free(ref)  # at once, as the actor frees a dropped handle
                except Exception:  # noqa: BLE001 - nobody asked: dropped below, the device frees it
                    pass
            # else this was the table's reference: the device frees the block before its next message

    def serve_here(self, message: Any, reply: _Reply | _LaneReply) -> bool:
        """Serve an ``Allocate`` or a ``Free`` on this thread through the device's client, as
        the actor would, when it is :meth:`quiet`; False when the actor must serve it."""
        if not self.quiet() or getattr(message, "origin", None) is not None:
            return False  # (an origin is recorded by the actor's memory history)
        try:
            if type(message) is Allocate:
                value = self.client.allocate(message.nbytes, message.stream, message.tag)
            else:
                self.client.free(message.ref)
                value = None
        except Exception as exc:  # noqa: BLE001 - the parent's asker gets it
            reply.set_exception((type(exc), exc, None))
        else:
            reply.set(value)
        return True

    def ask_payload(self, rid: int, payload: bytes) -> None:
        """Serve the ask whose message ``payload`` pickles (an ``ask`` frame's); a payload that
        does not read here is answered with its ``InvalidRequest``, and the loop goes on."""
        try:
            message = loads_payload(payload, self.ordinal)
        except InvalidRequest as exc:
            _Reply(self.channel, self.handles, rid).set_exception((type(exc), exc, None))
            return
        self.ask(rid, message)

    def ask(self, rid: int, message: Any) -> None:
        if self.fault is not None:
            self.held.append(message)  # never served: in flight when the fault strikes
            if len(self.held) >= self.fault.hold:
                self.strike(self.fault)
            return
        reply = _Reply(self.channel, self.handles, rid)
        if isinstance(message, ChildFault):
            try:
                self.arm(message)
            except InvalidRequest as exc:
                reply.set_exception((type(exc), exc, None))
            return
        if isinstance(message, ExportBlock):
            self.export(message, reply)
            return
        if isinstance(message, LibraryWork):
            self.library_work(message, reply)
            return
        if isinstance(message, LibraryStop):
            library = self.libraries.pop(message.library, None)
            if library is not None:
                library.stop(block=False)
            self.sources.pop(message.library, None)  # its kept sources' counts go back
            reply.set(None)
            return
        if isinstance(message, FreeBlock):
            ref = self.handles.take(message.ptr, message.generation)
            if ref is None:
                reply.set(None)  # freed already, or of an older generation: nothing to free
                return
            message = Free(ref)
        if type(message) in _SERVED_HERE and self.serve_here(message, reply):
            return
        ask_into(self.device, message, reply)

    def library_work(self, work: LibraryWork, reply: _Reply) -> None:
        """Serve ``work`` on the library actor of its parent-side actor, started on first use,
        with the child's own handles in place of the parent's."""

        def handle(remote: Any) -> GpuRef:
            ref = self.handles.get(remote.ptr, remote.generation)
            if ref is None:
                raise GpuRefStale("released", f"device {self.ordinal}, block {remote.ptr:#x}: freed in its process")
            return ref

        try:
            if work.forget and (kept := self.sources.get(work.library)) is not None:
                kept.forget(work.forget)
            library = self.libraries.get(work.library)
            if library is None or not library.is_alive():
                library = work.actor_class.start(self.device, track=work.track)
                self.libraries[work.library] = library
            message = work.message
            source: object = getattr(message, "src", None)  # the message's type names a GpuRef
            if type(message) is CopyDeviceToDevice and type(source) is KeptSource:
                message = CopyDeviceToDevice(self.kept_source(work.library, source), map_refs(message.dst, handle))
            else:
                message = map_refs(message, handle)
        except Exception as exc:  # noqa: BLE001 - the parent's asker gets it
            reply.set_exception((type(exc), exc, None))
            return
        self.work.forwarded += 1
        answer = _WorkReply(self.channel, self.handles, reply.rid, self.work)
        if type(message) is CopyDeviceToDevice and isinstance(message.src, SharedGpuRef):
            # Enqueued here while the copy actor is idle; its landing and the reply go to the
            # actor, whose wake-up then runs while the copy does (see shared_copy).
            serve_here = getattr(library, "serve_here", None)
            if serve_here is not None:
                try:
                    bell = serve_here(EnqueueShared(message, answer))
                except Exception as exc:  # noqa: BLE001 - the parent's asker gets it
                    answer.set_exception((type(exc), exc, None))
                    return
                if bell is not NOT_SERVED:
                    self._ring_later(bell)
                    return
        bell = ask_into_unrung(library, message, answer)
        self._ring_later(bell)

    def _ring_later(self, bell: Any) -> None:
        """Keep ``bell`` (a ``Doorbell`` or None) for the reader's next wait to ring, once it let
        go of the GIL; a bell still due from another actor is rung now."""
        if bell is not None:
            if self.bell is not None and self.bell is not bell:
                self.bell.ring()  # another actor's, still due: only the last one waits for the reader's wait
            self.bell = bell

    def kept_source(self, library: str, source: KeptSource) -> Any:
        """The handle a copy asked of ``library`` (a parent actor's URN) reads a kept source
        through: the one this process made of that kept export, or one made now (see
        :mod:`._sources`). Thread rule: the frame reader's."""
        kept = self.sources.get(library)
        if kept is None:
            kept = self.sources[library] = KeptImports(KEPT_EXPORTS)
        return kept.resolve(source, self.lifecycle.state.generation)

    def export(self, message: ExportBlock, reply: _Reply) -> None:
        """Export the handle the parent pickled (on this thread: it only records an event and
        takes a count)."""
        ref = self.handles.get(message.ptr, message.generation)
        try:
            if ref is None:
                raise GpuRefStale("released", f"device {self.ordinal}, block {message.ptr:#x}: freed in its process")
            reply.set(export_ref(ref))
        except Exception as exc:  # noqa: BLE001 - the parent's asker gets it
            reply.set_exception((type(exc), exc, None))

    def arm(self, fault: ChildFault) -> None:
        if fault.kind not in FAULT_KINDS:
            raise InvalidRequest(f"ChildFault.kind must be one of {FAULT_KINDS}, got {fault.kind!r}")
        if type(fault.hold) is not int or fault.hold < 0:
            raise InvalidRequest(f"ChildFault.hold must be a non-negative int, got {fault.hold!r}")
        if fault.kind == "sticky" and self.driver.kind != "host":
            raise InvalidRequest(f"ChildFault('sticky') needs the host driver; this child runs {self.driver.kind}")
        if fault.hold == 0:
            self.strike(fault)
        else:
            self.fault = fault

    def strike(self, fault: ChildFault) -> None:
        """Make the child fail; returns only if the fault did not end it in 30 s."""
        logger.warning("device %d: test hook %r ends this child process", self.ordinal, fault)
        if fault.kind == "exit":
            os._exit(3)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "sticky":
            self.driver.inject_fault(self.ordinal, "sticky")  # type: ignore[attr-defined]
            self.device.ask(Allocate(256))  # meets it: the supervisor poisons, the hook exits
        else:
            kernels = KernelActor.start(self.device)
            copy = CopyActor.start(self.device)
            ref: GpuRef = self.device.ask(Allocate(256))  # type: ignore[assignment]
            kernels.ask(Launch(_WRITE_TO_16, 1, 1, [16]))
            copy.ask(CopyToHost(ref, nbytes=4))  # the sticky error surfaces at the sync
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:  # the poisoning hook ends the process meanwhile
            self.device.ask(GetStats())
            time.sleep(0.01)


def serve(conn: Connection) -> None:
    """Boot, take the configuration, serve the device until ``stop`` or the parent is gone.

    Args:
        conn: the child's end of the pipe.
    Thread rule: the child's main thread.
    """
    channel = Channel(conn)
    channel.send(("booted", time.monotonic()))
    try:
        frame = channel.recv()
    except (EOFError, OSError):
        return
    if frame[0] != "config":
        return  # "stop": the parent stopped before it needed this spare
    _, ordinal, kind, resource, max_restarts, within_s, ipc_pool, lane_name = frame

    def report_poisoned(device_id: int, error: BaseException) -> None:
        try:
            channel.send(("poisoned", encode_error(error)))
        finally:
            exit_process(device_id, error)

    driver: Driver | None = None
    lane: CallLane | None = None
    try:
        if lane_name is not None:
            lane = CallLane(SharedSegment.open(lane_name).mm)
        driver = open_driver(kind)
        if ipc_pool and driver.kind == "cuda":
            from ...driver.cuda import CudaDriver

            driver.close()  # one cuInit more, once per child: it is what resolved "auto"
            driver = CudaDriver(ipc_pool=True)
        if driver.kind == "host":
            # Emulated device memory in shared memory, so that the parent's handles can be sent
            # to other processes (shared_ref); an unused private driver costs nothing to close.
            # It emulates the devices up to this one, so that each of MAX_EMULATED_DEVICES ordinals can be
            # isolated (a pool of isolated host devices); past them an ordinal is refused, as a
            # driver refuses one it does not have.
            driver.close()
            if not 0 <= ordinal < MAX_EMULATED_DEVICES:
                raise InvalidRequest(f"device ordinal {ordinal}: an isolated host device has one of the ordinals "
                                     f"0..{MAX_EMULATED_DEVICES - 1}")
            driver = HostDriver(device_count=ordinal + 1, shared=True)
        t_driver = time.monotonic()
        supervisor = Supervisor(max_restarts, within_s, on_poisoned=report_poisoned)
        device = DeviceActor.start(ordinal, driver, resource, supervisor)
        # One allocation given back before the child says it serves: its stack is built and its
        # pool has grown once, so the first allocation asked of it (after a restart, the first of
        # the new generation) meets neither. A hot spare pays this before it is needed.
        try:
            warm: GpuRef = device.ask(Allocate(_WARM_BYTES, tag=AllocTag("warm-up")), block=True)
            device.ask(Free(warm), block=True)
            del warm
        except XlogError:
            pass  # a stack that refuses it (a tiny budget, say) serves all the same, if slower at first
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        channel.send(("failed", encode_error(exc)))
        if driver is not None:
            driver.close()
        return
    channel.send(("ready", t_driver, time.monotonic()))
    try:
        _Server(channel, driver, ordinal, device, lane).loop()
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
        channel.close()
