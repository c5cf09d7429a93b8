"""``CopyActor``: host-to-device, device-to-host, device-to-device copies and fills on its own
stream, tracked on the handles it touches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from ..driver.protocol import Driver, Stream
from ..errors import GpuRefStale, InvalidRequest, XlogError
from ..memory.block import Access, DeviceBlock
from ..memory.pinned import PinnedBuffer
from .gpu_ref import GpuRef
from .library_actor import LibraryActor, raise_if_rebuilt
from .library_messages import CopyDeviceToDevice, CopyDone, CopyToDevice, CopyToHost, Fill
from .pykka_internals import ask_into_unrung
from .shared_copy import EnqueueShared, LandShared, check_shared_source, enqueue_from_shared
from .shared_ref import SharedGpuRef

__all__ = ["CopyActor"]


class CopyActor(LibraryActor):
    """``CopyActor.start(device)``: copies and fills on its own stream of ``device`` (the
    ``ActorRef`` of a running ``DeviceActor``); see :class:`LibraryActor` for streams, tracking,
    and what it does with a message it does not understand.

    It serves ``CopyToDevice``, ``CopyToHost``, ``CopyDeviceToDevice`` and ``Fill`` (see each
    message for its reply and errors). ``CopyDeviceToDevice`` also copies between this device and
    a peer device of the same driver, on this actor's stream, ordered on both devices (see
    :mod:`.peer_use`), and from a ``SharedGpuRef`` (a handle of a device in another process) into
    a handle of this device, replying once the copy landed (see :mod:`.shared_copy`). A malformed
    message is answered with ``InvalidRequest`` naming the field, before anything is enqueued: no
    bytes move.

    Replies once the work is enqueued, except ``CopyToHost``, which replies with the bytes once
    they are on the host. That wait synchronizes the actor's *own* stream, which holds only this
    actor's copies: no thread parks on a whole device, and other actors' work goes on. (A host
    callback would free the actor's thread during the copy, but pykka replies from the handler's
    return value, so the actor would need a second reply path; the stream is the actor's own, so
    the wait costs nothing another design would save.) A ``CopyToHost`` into a pinned buffer
    (``out``) replies as soon as the copy is enqueued, with a ``CopyDone`` to wait on instead.
    """

    expected_messages = "CopyToDevice, CopyToHost, CopyDeviceToDevice or Fill"
    caller_served = (CopyToDevice, CopyToHost, CopyDeviceToDevice, Fill)
    posted_compiled = (CopyToDevice, CopyToHost)

    def _handler(self, message: Any) -> Callable[[Any], Any] | None:
        name = _HANDLERS.get(type(message))
        return None if name is None else getattr(self, name)

    def _enqueue_only(self, message: Any) -> bool:
        # A copy from or into pinned memory and a fill only enqueue; a copy from pageable memory
        # may be staged by the driver before it returns, one to pageable memory synchronizes, and
        # a copy between devices may wait for a peer that is not tracked.
        kind = type(message)
        if kind is Fill:
            return True
        if kind is CopyToDevice:
            return isinstance(message.data, PinnedBuffer)
        return kind is CopyToHost and message.out is not None

    def _to_device(self, msg: CopyToDevice) -> None:
        core = self._core
        if core is not None and self._compiled(core.to_device, msg.ref, msg.data):
            return  # a pinned buffer, the compiled path (the checks below refuse the rest)
        self._check_refs(msg, "ref")
        if isinstance(msg.data, PinnedBuffer):
            self._to_device_from_pinned(msg)
            return
        try:
            view = memoryview(msg.data)
            if "O" in view.format:
                # An object array exports its PyObject pointers: never bytes for a device.
                raise TypeError(f"dtype object (format {view.format!r}) holds Python objects, not data")
            data = view.cast("B")
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(
                "CopyToDevice.data must be a C-contiguous buffer (bytes, bytearray, a numpy array of a "
                f"plain dtype), got {type(msg.data).__name__} ({exc})"
            ) from None
        if len(data) == 0:
            raise InvalidRequest("CopyToDevice.data is empty")
        if len(data) > msg.ref.nbytes:
            raise InvalidRequest(f"CopyToDevice.data: {len(data)} bytes do not fit in {msg.ref!r}")

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            driver.copy_to_device(blocks[0].ptr, data, stream)

        self._run([(msg.ref, Access.WRITE)], enqueue)

    def _to_host(self, msg: CopyToHost) -> bytes | CopyDone:
        self._check_refs(msg, "ref")
        nbytes = msg.ref.nbytes if msg.nbytes is None else msg.nbytes
        if type(nbytes) is not int or not 0 < nbytes <= msg.ref.nbytes:
            raise InvalidRequest(f"CopyToHost.nbytes must be an int in 1..{msg.ref.nbytes}, got {msg.nbytes!r}")
        if msg.out is not None:
            return self._to_pinned_host(msg, nbytes)
        out: list[bytearray] = []

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            out.append(driver.copy_to_host(blocks[0].ptr, nbytes, stream))

        self._run([(msg.ref, Access.READ)], enqueue, wait=True)
        return bytes(out[0])

    def _device_to_device(self, msg: CopyDeviceToDevice) -> None:
        source: object = msg.src
        if isinstance(source, SharedGpuRef):
            self._from_other_process(msg, source)
            return
        self._check_refs(msg, "src", "dst")
        if msg.src.nbytes > msg.dst.nbytes:
            raise InvalidRequest(f"CopyDeviceToDevice.src: {msg.src!r} does not fit in dst {msg.dst!r}")
        if msg.src is msg.dst:
            raise InvalidRequest("CopyDeviceToDevice.dst: source and destination are the same handle")

        if msg.src.block.device_ordinal != msg.dst.block.device_ordinal:
            self._peer_copy(msg)
            return

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            driver.copy_device_to_device(blocks[1].ptr, blocks[0].ptr, blocks[0].nbytes, stream)

        self._run([(msg.src, Access.READ), (msg.dst, Access.WRITE)], enqueue)

    def _peer_copy(self, msg: CopyDeviceToDevice) -> None:
        """``CopyDeviceToDevice`` between two devices: on this actor's stream, so of whichever of
        the two is this actor's device; the other handle is ordered through a bridge stream on its
        own device (see :mod:`.peer_use`)."""
        ordinal = self._context_for(()).ordinal
        src_ordinal, dst_ordinal = msg.src.block.device_ordinal, msg.dst.block.device_ordinal
        if ordinal == dst_ordinal:
            local, peer = (msg.dst, Access.WRITE), (msg.src, Access.READ, "CopyDeviceToDevice.src")
        elif ordinal == src_ordinal:
            local, peer = (msg.src, Access.READ), (msg.dst, Access.WRITE, "CopyDeviceToDevice.dst")
        else:
            raise InvalidRequest(
                f"CopyDeviceToDevice.src: {msg.src!r} (device {src_ordinal}) and dst {msg.dst!r} (device "
                f"{dst_ordinal}): neither is of this CopyActor's device {ordinal}"
            )
        nbytes = msg.src.nbytes

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            dst, src = (blocks[0], blocks[1]) if ordinal == dst_ordinal else (blocks[1], blocks[0])
            driver.copy_peer(dst_ordinal, dst.ptr, src_ordinal, src.ptr, nbytes, stream)

        self._run([local], enqueue, peers=[peer])

    def _from_other_process(self, msg: CopyDeviceToDevice, src: SharedGpuRef, *, wait: bool = True) -> None:
        """``CopyDeviceToDevice`` from a handle of a device in another process (see
        :mod:`.shared_copy`): after the source's exported last write, tracked on the destination,
        replying once the copy landed (``wait`` False: once it is enqueued, for
        :meth:`_enqueue_shared`, whose landing waits)."""
        self._check_refs(msg, "dst")
        ctx = msg.dst.context
        check_shared_source(src, msg.dst.nbytes, ctx.driver.kind)
        src.wait_write()

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            enqueue_from_shared(driver, stream, src, blocks[0])

        self._run([(msg.dst, Access.WRITE)], enqueue, wait=wait)
        if wait:
            src.access()  # its owner restarted during the copy: the bytes copied are not the handle's

    def _enqueue_shared(self, msg: EnqueueShared) -> Any:
        """The asker's half of a copy from another process (see :mod:`.shared_copy`): enqueue it,
        then queue its landing, whose reply is ``msg.reply``, to this actor. Returns the inbox's
        bell, for the asker to ring once it lets go of the GIL (``ask_into_unrung``)."""
        copy = msg.copy
        source: object = copy.src
        if not isinstance(source, SharedGpuRef):
            raise InvalidRequest(f"EnqueueShared.copy.src: a SharedGpuRef, got {type(source).__name__}")
        self._from_other_process(copy, source, wait=False)
        stream = self._stream
        assert stream is not None  # attached by the enqueue just made
        landing = LandShared(source, stream, copy.dst.context)
        return ask_into_unrung(self.actor_ref, landing, msg.reply)

    def _land_shared(self, msg: LandShared) -> None:
        """The actor's half: wait for the copy enqueued by :meth:`_enqueue_shared` to land (a
        rebuild meanwhile reads as a stale handle, as in ``_run``), then check its source."""
        try:
            msg.stream.synchronize()
        except XlogError as exc:
            if not isinstance(exc, GpuRefStale):
                raise_if_rebuilt([msg.context], exc)
            raise
        if self._core is not None:
            self._core.prune()  # every compiled copy before the wait ran: its buffer may go
        msg.src.access()  # its owner restarted during the copy: the bytes copied are not the handle's

    def _fill(self, msg: Fill) -> None:
        byte = msg.byte
        if type(byte) is not int or not 0 <= byte <= 255:
            self._check_refs(msg, "ref")
            raise InvalidRequest(f"Fill.byte must be an int in 0..255, got {byte!r}")
        core = self._core
        if core is not None and self._compiled(core.fill, msg.ref, byte):
            return
        self._check_refs(msg, "ref")

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            driver.fill(blocks[0].ptr, msg.byte, blocks[0].nbytes, stream)

        self._run([(msg.ref, Access.WRITE)], enqueue)

    # -- pinned host buffers ---------------------------------------------------------------------
    @staticmethod
    def _check_pinned(buf: object, field: str, ref: GpuRef, nbytes: int) -> PinnedBuffer:
        """``buf`` when it is a live pinned buffer of ``ref``'s device and driver holding at least
        ``nbytes``; else ``InvalidRequest`` naming ``field``."""
        if not isinstance(buf, PinnedBuffer):
            raise InvalidRequest(
                f"{field}: pinned required: a PinnedBuffer from AllocatePinned, got {type(buf).__name__} "
                "(pageable memory cannot take an asynchronous copy)"
            )
        if buf.released:
            raise InvalidRequest(f"{field}: {buf!r} was released")
        ctx = ref.context
        if buf.driver is not ctx.driver or buf.device_ordinal != ctx.ordinal:
            raise InvalidRequest(
                f"{field}: {buf!r} is a pinned buffer of device {buf.device_ordinal} of a {buf.driver.kind} driver, "
                f"not of {ref!r}'s device {ctx.ordinal} ({ctx.driver.kind} driver)"
            )
        if buf.nbytes < nbytes:
            raise InvalidRequest(f"{field}: {buf!r} is smaller than the {nbytes} bytes to copy")
        return buf

    def _to_device_from_pinned(self, msg: CopyToDevice) -> None:
        """``CopyToDevice`` from a pinned buffer: all of it, with no staging copy. The driver
        keeps the view (and so the buffer's memory) referenced until the copy ran."""
        buf = self._check_pinned(msg.data, "CopyToDevice.data", msg.ref, 0)
        if buf.nbytes > msg.ref.nbytes:
            raise InvalidRequest(f"CopyToDevice.data: {buf.nbytes} bytes do not fit in {msg.ref!r}")
        data = buf.view()

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            driver.copy_to_device(blocks[0].ptr, data, stream)

        self._run([(msg.ref, Access.WRITE)], enqueue)

    def _to_pinned_host(self, msg: CopyToHost, nbytes: int) -> CopyDone:
        """``CopyToHost`` into a pinned buffer: enqueue the copy and an event after it, and reply
        at once. The driver keeps the view (and so the buffer's memory) referenced until the copy
        ran, so a release meanwhile frees nothing early."""
        core = self._core
        if core is not None:
            event = self._compiled(core.to_host, msg.ref, msg.out, nbytes)
            if event is not None:
                return CopyDone(cast(PinnedBuffer, msg.out), nbytes, event)  # the core took it as one
        buf = self._check_pinned(msg.out, "CopyToHost.out", msg.ref, nbytes)
        target = buf.view()[:nbytes]
        done: list[CopyDone] = []

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            driver.copy_to_host_into(blocks[0].ptr, target, stream)
            done.append(CopyDone(buf, nbytes, stream.record_event()))

        self._run([(msg.ref, Access.READ)], enqueue)
        return done[0]


#: Message type -> the name of the CopyActor method that serves it (a table made once, not per
#: message; by name, so the method is looked up on the instance as any call would).
_HANDLERS: dict[type, str] = {
    CopyToDevice: "_to_device",
    CopyToHost: "_to_host",
    CopyDeviceToDevice: "_device_to_device",
    Fill: "_fill",
    EnqueueShared: "_enqueue_shared",
    LandShared: "_land_shared",
}
