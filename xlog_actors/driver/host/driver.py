"""The host driver: the CUDA stream model emulated on host threads and host memory.

What it reproduces, so that code tested here behaves the same on a GPU:

* device memory with real, distinct, 256-byte aligned addresses; synchronous allocation
  (``cuMemAlloc``; ``free`` is device-synchronizing like ``cuMemFree``) and stream-ordered
  allocation (``cuMemAllocAsync``/``cuMemFreeAsync``): a free takes effect when its stream reaches
  it, and, as in CUDA's pools, memory freed on a stream may be handed out again at once to a later
  allocation *on the same stream*, whose work is ordered after the free anyway;
* freed memory is overwritten with ``0xDD`` when the free takes effect, so a use after free reads
  garbage, as it may on a GPU;
* streams that run in order on their own threads, concurrently with each other; events; waits
  enqueued without blocking the host; ``sleep`` to make a stream slow;
* launches judged as ``cuLaunchKernel`` judges them (:func:`~xlog_actors.driver.checks.check_launch`):
  what a GPU refuses is refused here, with the same error and code;
* faults (:meth:`HostDriver.inject_fault`): a failing call, a lost context that must be rebuilt,
  and a sticky error that poisons the device for the life of the driver. A host kernel that
  touches memory outside the allocations live on the device, or raises, poisons the device as an
  illegal address (or a launch failure) would.

Thread rules: every public method may be called from any thread. Each device has one lock that
guards its allocator and fault state; stream queues have their own locks. Nothing blocks while
holding a device lock.

The module is long (past 500 lines) because it is the facade of every driver call (the exports
for other processes included), each with its contract written out; the work itself lives in
``device``, ``stream``, ``memory``, ``launch`` and ``ipc``.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import Sequence
from typing import Final, Literal

import numpy as np

from ...errors import DriverError, InvalidRequest
from ..checks import Dims, check_launch, check_microseconds, check_nbytes, check_ordinal, writable_bytes
from ..graph import DeviceToHost, GraphStep, HostToDevice, SteppedGraph, check_lanes, check_steps
from ..kernel import Kernel
from ..protocol import Buffer
from .device import FAULT_KINDS, FaultKind, HostDevice
from .ipc import HostIpcEvent, HostMemoryExport
from .launch import KernelMemory, kernel_work
from .memory import align_up
from .pinned import HostPinnedTable
from .staging import StagingPool
from .stream import HostEvent, HostStream

__all__ = ["MAX_EMULATED_DEVICES", "HostDriver"]

#: The most devices the runtime asks a host driver to emulate when it picks the count itself (a
#: worker process per device of the multi-device demo, an isolated device's child emulating the
#: ordinals up to its own). A ``HostDriver`` made by a caller may emulate any number.
MAX_EMULATED_DEVICES: Final = 16

# Each device gets its own 1 TiB window of the address space, so pointers of different devices
# never collide and a pointer names its device.
_DEVICE_WINDOW = 1 << 40
_BASE = 0x7F00_0000_0000

_live_drivers: weakref.WeakSet[HostDriver] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for driver in list(_live_drivers):
        driver.close()


class HostDriver:
    """The host emulation of a CUDA driver; see the module docstring.

    It implements the driver protocol with its own stream and event types (:class:`HostStream`,
    :class:`HostEvent`): a stream or event of another driver is not accepted.

    Invariant: once closed, every call raises ``DriverError`` (``CUDA_ERROR_DEINITIALIZED``).

    Thread rule: any thread may call every method.
    """

    kind: Literal["host"] = "host"

    def __init__(self, device_count: int = 1, memory_per_device: int = 1 << 30, shared: bool = False) -> None:
        """Emulate ``device_count`` devices of ``memory_per_device`` bytes each (rounded up to the
        alignment); memory is committed only when touched.

        ``shared=True`` keeps each device context's memory in a named shared-memory segment, so
        that its allocations can be exported to other processes of the node
        (:meth:`export_memory`, :meth:`export_event`; ``GpuRef`` pickling uses them).

        Raises:
            InvalidRequest: ``device_count`` is not a positive int, ``memory_per_device`` is not
                a positive int of at most 1 TiB, or ``shared`` is not a bool.
            DeviceUnavailable: ``shared`` where the system has no POSIX shared memory.
        """
        if type(device_count) is not int or device_count < 1:
            raise InvalidRequest(f"device_count must be a positive int, got {device_count!r}")
        if type(shared) is not bool:
            raise InvalidRequest(f"shared must be a bool, got {shared!r}")
        check_nbytes(memory_per_device, "memory_per_device")
        if memory_per_device > _DEVICE_WINDOW:
            raise InvalidRequest(f"memory_per_device above {_DEVICE_WINDOW} bytes is not supported")
        self._memory_per_device = align_up(memory_per_device)
        self._shared = shared
        self._devices: list[HostDevice] = []
        try:
            for i in range(device_count):
                self._devices.append(HostDevice(i, _BASE + i * _DEVICE_WINDOW, self._memory_per_device, shared))
        except BaseException:
            for dev in self._devices:
                dev.shutdown()
            raise
        self._closed = False
        self._pinned = HostPinnedTable()
        self._staging = StagingPool()
        _live_drivers.add(self)

    def __repr__(self) -> str:
        shared = ", shared=True" if self._shared else ""
        return f"HostDriver(device_count={len(self._devices)}, memory_per_device={self._memory_per_device}{shared})"

    def _device(self, ordinal: object) -> HostDevice:
        """Device ``ordinal`` of an open driver, no fault counted."""
        dev = self._devices[check_ordinal(ordinal, len(self._devices), "the host driver")]
        dev.check_open()
        return dev

    def _gate(self, ordinal: object, requested: int = 0) -> HostDevice:
        dev = self._device(ordinal)
        dev.gate(requested)
        return dev

    def _stream_device(self, stream: HostStream, requested: int = 0) -> HostDevice:
        dev = self._device(stream.ordinal)
        dev.gate_stream(stream, requested)
        return dev

    # -- queries ----------------------------------------------------------------------------
    def device_count(self) -> int:
        """How many devices this driver emulates. Thread rule: any thread."""
        return len(self._devices)

    def device_name(self, ordinal: int) -> str:
        """A name for device ``ordinal``.

        Raises:
            InvalidRequest: a bad ordinal. DriverError: the driver is closed.
        Thread rule: any thread.
        """
        self._device(ordinal)
        return f"host-emulated device {ordinal}"

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        """``(free, total)`` bytes of device ``ordinal``; stream-ordered frees that have not run
        yet are not free.

        Raises:
            InvalidRequest: a bad ordinal. DriverError: the driver is closed.
            ContextLost, ContextPoisoned: the context is gone.
        Thread rule: any thread.
        """
        dev = self._device(ordinal)
        dev.check_after_sync()
        with dev.lock:
            return dev.space.free_bytes, dev.size

    def make_current(self, ordinal: int) -> None:
        """Nothing to do on the host, beyond checking ``ordinal`` (``InvalidRequest``) and that
        the driver is open (``DriverError``). Thread rule: any thread."""
        self._device(ordinal)

    def check_context(self, ordinal: int) -> None:
        """Check that device ``ordinal``'s context is usable; no fault is counted (the CUDA twin
        detects a reset made from outside the driver).

        Raises:
            InvalidRequest: a bad ordinal. DriverError: the driver is closed.
            ContextLost, ContextPoisoned: the context is gone.
        Thread rule: any thread.
        """
        self._device(ordinal).check_after_sync()

    def inject_fault(self, ordinal: int, kind: FaultKind, after_calls: int = 0) -> None:
        """Make device ``ordinal`` fail on a later driver call: the one after ``after_calls`` more.

        Args:
            ordinal: the device.
            kind: ``"oom"``: that call raises ``OutOfMemory``; ``"error"``: ``DriverError``,
                context intact; ``"context_lost"``: ``ContextLost`` from then on until
                :meth:`rebuild_context`; ``"sticky"``: ``ContextPoisoned``
                (``CUDA_ERROR_ILLEGAL_ADDRESS``) for the life of the driver.
            after_calls: how many calls pass before it, a non-negative int.
        Raises:
            InvalidRequest: a bad ordinal, kind or count; nothing is planted then.
        Thread rule: any thread.
        """
        dev = self._device(ordinal)
        if kind not in FAULT_KINDS:
            raise InvalidRequest(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        if type(after_calls) is not int or after_calls < 0:
            raise InvalidRequest(f"after_calls must be a non-negative int, got {after_calls!r}")
        dev.inject(kind, after_calls)

    def live_allocations(self, ordinal: int) -> int:
        """How many allocations of ``ordinal``'s current context are not yet freed (diagnostic).

        Thread rule: any thread.
        """
        dev = self._device(ordinal)
        with dev.lock:
            return len(dev.live)

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, ordinal: int) -> HostStream:
        """A new stream of device ``ordinal``'s current context, its thread started.

        Raises:
            InvalidRequest, DriverError, ContextLost, ContextPoisoned, OutOfMemory: from the gate.
        Thread rule: any thread.
        """
        dev = self._gate(ordinal)
        stream = HostStream(dev, dev.epoch)
        # Under the device lock: ``free`` and ``close`` iterate the set from other threads.
        with dev.lock:
            dev.streams.add(stream)
        return stream

    def create_event(self, ordinal: int) -> HostEvent:
        """A new, unrecorded event of device ``ordinal``.

        Raises:
            InvalidRequest, DriverError, ContextLost, ContextPoisoned, OutOfMemory: from the gate.
        Thread rule: any thread.
        """
        return HostEvent(self._gate(ordinal))

    # -- allocation -------------------------------------------------------------------------
    def alloc(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` on device ``ordinal`` at once, as ``cuMemAlloc`` does.

        Returns:
            The device address, 256-byte aligned.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int, or a bad ordinal.
            OutOfMemory: no room (``.requested``, ``.free`` set).
            DriverError, ContextLost, ContextPoisoned: from the gate.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes)
        return self._gate(ordinal, nbytes).allocate(nbytes, None)

    def free(self, ordinal: int, ptr: int) -> None:
        """Free ``ptr`` once device ``ordinal`` is idle, as ``cuMemFree`` does.

        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is not a live allocation; and
                whatever the gate raises.
        Thread rule: any thread but a stream thread of this driver.
        """
        self._gate(ordinal).free(ptr)

    def alloc_async(self, nbytes: int, stream: HostStream) -> int:
        """Allocate ``nbytes`` in ``stream``'s order, as ``cuMemAllocAsync`` does.

        Returns:
            The device address, 256-byte aligned.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            OutOfMemory: no room. DriverError, ContextLost, ContextPoisoned: from the gate.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes)
        return self._stream_device(stream, nbytes).allocate(nbytes, stream)

    def free_async(self, ptr: int, stream: HostStream) -> None:
        """Like :meth:`free`, but the free takes effect when ``stream`` reaches this point, as
        with ``cuMemFreeAsync``; until then the memory may be handed out again on ``stream`` only.
        Raises what :meth:`free` raises; any thread may call it.
        """
        self._stream_device(stream).free_async(ptr, stream)

    # -- pinned host memory -----------------------------------------------------------------
    def alloc_pinned(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` of 4096-aligned host memory through device ``ordinal``; a rebuild
        of its context leaves it alone, ``close`` drops it.

        Returns:
            Its host address.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int, or a bad ordinal.
            OutOfMemory: the host cannot give ``nbytes``, or an injected ``"oom"`` fault.
            DriverError, ContextLost, ContextPoisoned: from the gate.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned allocation size")
        self._gate(ordinal, nbytes)
        return self._pinned.alloc(ordinal, nbytes)

    def free_pinned(self, ordinal: int, ptr: int) -> None:
        """Free an ``alloc_pinned`` pointer; a view still held keeps the bytes readable (they are
        Python memory), but the allocation is gone from the driver's table.

        Raises:
            InvalidRequest: a bad ordinal.
            DriverError: ``ptr`` is no live pinned allocation of device ``ordinal`` (freed already,
                or foreign: nothing changes), or the driver is closed.
        Thread rule: any thread, finalizers included (no fault is counted, no gate taken).
        """
        self._device(ordinal)
        self._pinned.free(ordinal, ptr)

    def pinned_view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of the first ``nbytes`` of a live ``alloc_pinned`` allocation.

        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            DriverError: ``ptr`` is no live pinned allocation, or ``nbytes`` exceeds it.
        Thread rule: any thread.
        """
        return self._pinned.view(ptr, nbytes)

    def register_host(self, ordinal: int, data: Buffer) -> int:
        """Register the caller's buffer as page-locked (``cuMemHostRegister``): until
        :meth:`unregister_host`, a ``copy_to_device`` from it reads it when the copy runs, with no
        snapshot. For a buffer whose bytes cannot change while it is referenced (an object in
        Ray's store, say), that saves the snapshot's copy.

        Args:
            ordinal: the device it is registered through.
            data: a non-empty C-contiguous buffer; the caller keeps its bytes unchanged until
                every copy from it ran (the queued copy keeps the buffer itself alive).
        Returns:
            Its host address, the key for :meth:`unregister_host`.
        Raises:
            InvalidRequest: a bad ordinal, or ``data`` not a non-empty C-contiguous buffer.
            DriverError: ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` when it overlaps a
                registered buffer or a pinned allocation; whatever the gate raises. Nothing
                changes then.
        Thread rule: any thread.
        """
        self._gate(ordinal)
        return self._pinned.register(ordinal, data)

    def unregister_host(self, ordinal: int, ptr: int) -> None:
        """Undo :meth:`register_host` (``cuMemHostUnregister``); copies already enqueued from the
        buffer still read it when they run.

        Raises:
            InvalidRequest: a bad ordinal.
            DriverError: ``CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`` for a pointer not registered
                through device ``ordinal`` (nothing changes).
        Thread rule: any thread.
        """
        self._device(ordinal)
        self._pinned.unregister(ordinal, ptr)

    def device_view(self, ordinal: int, ptr: int, nbytes: int) -> memoryview:
        """A read-only view of ``nbytes`` bytes of device memory at ``ptr``, as a host kernel sees
        them: no copy, no stream order. Ordering is the caller's: the view shows whatever the
        streams wrote by the time it is read, so read it only after the work that writes the
        range is known to have run and before any later work on the range is enqueued.

        Args:
            ordinal: the device.
            ptr: an address inside one live allocation of that device.
            nbytes: a positive byte count, the range inside that allocation.
        Returns:
            The view; while it lives, the memory it shows stays mapped (a rebuild of the context
            unmaps it only when the last view goes).
        Raises:
            InvalidRequest: a bad ordinal or ``nbytes``.
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when the range is not inside one live
                allocation; whatever the gate raises.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "view size")
        dev = self._gate(ordinal)
        offset = dev.offset_of(ptr, nbytes, "device view")
        arena = dev.arena
        if not arena.allocations.covers(ptr, nbytes):
            raise DriverError(
                f"device {ordinal}: view of {nbytes} bytes at {ptr:#x} is not inside one live allocation",
                code="CUDA_ERROR_INVALID_VALUE",
            )
        with memoryview(arena.mm) as whole:
            return whole[offset : offset + nbytes].toreadonly()

    # -- copies and work --------------------------------------------------------------------
    def copy_to_device(self, ptr: int, data: Buffer, stream: HostStream) -> None:
        """Enqueue a copy of ``data`` to ``ptr``: snapshotted now, as CUDA stages pageable memory,
        or read when the copy runs where ``data`` lies in pinned memory (as CUDA reads it).

        A large snapshot lands in a staging buffer reused from earlier copies (warm pages, no
        fresh allocation); the copy into device memory is one ``memcpy``.

        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` for a range outside device memory; and
                whatever the gate raises.
            OutOfMemory: the host cannot give the snapshot's staging buffer (nothing enqueued).
        Thread rule: any thread; the bytes of a pinned ``data`` must stay put until the copy ran.
        """
        view = memoryview(data).cast("B")
        nbytes = len(view)
        dev = self._stream_device(stream)
        offset = dev.offset_of(ptr, nbytes, "copy to device")
        arena = dev.arena
        if self._pinned.holds(view):
            # Pinned bytes are read when the copy runs; the queued work holds the view (and so
            # the pinned memory's owner) until then.
            source: memoryview = view
            lent = None
        elif nbytes < self._staging.min_bytes:
            source = memoryview(bytes(view))
            lent = None
        else:
            lent = self._staging.take(nbytes)
            source = lent.data[:nbytes]
            source[:] = view
        staging = self._staging

        def run() -> None:
            with memoryview(arena.mm) as whole, whole[offset : offset + nbytes] as target:
                target[:] = source
            if lent is not None:
                staging.give(lent)

        stream.enqueue(run)

    def copy_to_host(self, ptr: int, nbytes: int, stream: HostStream) -> bytearray:
        """Enqueue a copy of ``nbytes`` at ``ptr`` into a new buffer, valid once ``stream`` is
        synchronized.

        Raises:
            InvalidRequest: ``nbytes`` is not a positive int. DriverError: a range outside device
                memory; and whatever the gate raises.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "copy size")
        out = bytearray(nbytes)
        self.copy_to_host_into(ptr, out, stream)
        return out

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: HostStream) -> None:
        """Enqueue a copy of ``len(out)`` bytes at ``ptr`` into the writable buffer ``out``.

        Raises:
            InvalidRequest: ``out`` is read-only. DriverError: a range outside device memory; and
                whatever the gate raises.
        Thread rule: any thread.
        """
        target = writable_bytes(out)
        nbytes = len(target)
        dev = self._stream_device(stream)
        offset = dev.offset_of(ptr, nbytes, "copy to host")
        arena = dev.arena

        def run() -> None:
            # A view of the mapping, not a slice of it: one memcpy, no temporary bytes object.
            with memoryview(arena.mm) as whole, whole[offset : offset + nbytes] as source:
                target[:] = source

        stream.enqueue(run)

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: HostStream) -> None:
        """Enqueue a copy of ``nbytes`` from ``src`` to ``dst``.

        Raises:
            InvalidRequest: ``nbytes`` is not a positive int. DriverError: a range outside device
                memory; and whatever the gate raises.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "copy size")
        dev = self._stream_device(stream)
        dst_off = dev.offset_of(dst, nbytes, "device-to-device copy destination")
        src_off = dev.offset_of(src, nbytes, "device-to-device copy source")
        arena = dev.arena

        def run() -> None:
            with memoryview(arena.mm) as whole, whole[src_off : src_off + nbytes] as source:
                arena.mm[dst_off : dst_off + nbytes] = source

        stream.enqueue(run)

    def fill(self, ptr: int, byte: int, nbytes: int, stream: HostStream) -> None:
        """Enqueue setting ``nbytes`` bytes at ``ptr`` to ``byte``.

        Raises:
            InvalidRequest: ``byte`` is not an int in 0..255 or ``nbytes`` not a positive int.
            DriverError: a range outside device memory; and whatever the gate raises.
        Thread rule: any thread.
        """
        if type(byte) is not int or not 0 <= byte <= 255:
            raise InvalidRequest(f"fill byte must be an int in 0..255, got {byte!r}")
        nbytes = check_nbytes(nbytes, "fill size")
        dev = self._stream_device(stream)
        offset = dev.offset_of(ptr, nbytes, "fill")
        arena = dev.arena

        def run() -> None:
            np.frombuffer(arena.mm, np.uint8, nbytes, offset)[:] = byte

        stream.enqueue(run)

    # -- peer copies -------------------------------------------------------------------------
    def copy_peer(
        self, dst_ordinal: int, dst: int, src_ordinal: int, src: int, nbytes: int, stream: HostStream
    ) -> None:
        """Enqueue a copy of ``nbytes`` from ``src`` on device ``src_ordinal`` to ``dst`` on device
        ``dst_ordinal`` (two emulated devices of this driver), in ``stream``'s order; ``stream``
        is of either device. The bytes move between the two devices' emulated memories when the
        stream reaches the copy; it is dropped then if either device's context was rebuilt
        meanwhile (that memory is gone), as a GPU drops work of a destroyed context.

        Raises:
            InvalidRequest: a bad ordinal or ``nbytes``, the same device twice, or ``stream`` of
                neither device (nothing is enqueued).
            DriverError: a range outside its device's memory; and whatever either device's gate
                raises.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "peer copy size")
        dst_dev, src_dev = self._device(dst_ordinal), self._device(src_ordinal)
        if dst_dev is src_dev:
            raise InvalidRequest(
                f"peer copy from device {src_ordinal} to itself: use copy_device_to_device within one device"
            )
        if not isinstance(stream, HostStream):
            raise InvalidRequest(f"expected a HostStream of this driver, got {stream!r}")
        if stream.ordinal not in (dst_ordinal, src_ordinal):
            raise InvalidRequest(
                f"peer copy {src_ordinal} -> {dst_ordinal}: {stream!r} is of device {stream.ordinal}, "
                "neither of the two"
            )
        other = src_dev if stream.ordinal == dst_ordinal else dst_dev
        self._stream_device(stream)
        other.gate()
        dst_off = dst_dev.offset_of(dst, nbytes, f"peer copy destination (from device {src_ordinal})")
        src_off = src_dev.offset_of(src, nbytes, f"peer copy source (to device {dst_ordinal})")
        dst_arena, src_arena, other_epoch = dst_dev.arena, src_dev.arena, other.epoch

        def run() -> None:
            # The stream's own context is checked by the stream (``HostDevice.guarded``); the
            # other device's memory is gone if its context was rebuilt since.
            if other.epoch == other_epoch:
                with memoryview(src_arena.mm) as whole, whole[src_off : src_off + nbytes] as source:
                    dst_arena.mm[dst_off : dst_off + nbytes] = source

        stream.enqueue(run)

    def sleep(self, stream: HostStream, microseconds: int) -> None:
        """Enqueue a pause of ``microseconds`` on ``stream``.

        Raises:
            InvalidRequest: not a non-negative number. DriverError, ContextLost, ContextPoisoned:
                from the gate.
        Thread rule: any thread.
        """
        seconds = check_microseconds(microseconds) / 1e6
        self._stream_device(stream)
        stream.enqueue(lambda: time.sleep(seconds))

    def launch(self, kernel: Kernel, grid: Dims, block: Dims, args: Sequence[object], stream: HostStream) -> None:
        """Enqueue ``kernel``'s host implementation, after judging the launch as CUDA does.

        When it runs, every access it makes through its memory view must lie inside one
        allocation live on the device; one that does not poisons the context
        (``ContextPoisoned``, ``CUDA_ERROR_ILLEGAL_ADDRESS``, met by the next call), as on a GPU.

        Args:
            kernel: the kernel.
            grid: blocks per grid, an int or 1 to 3 ints.
            block: threads per block, an int or 1 to 3 ints.
            args: one value per parameter, pointers as ints.
            stream: where it runs.
        Raises:
            InvalidRequest, DriverError: what :func:`~xlog_actors.driver.checks.check_launch`
                refuses (nothing is enqueued, no fault counted); and whatever the gate raises.
        Thread rule: any thread.
        """
        grid3, block3 = check_launch(kernel, grid, block, args)
        dev = self._stream_device(stream)
        stream.enqueue(kernel_work(kernel, KernelMemory(dev.arena, dev.ordinal), grid3, block3, args))

    # -- context lifetime -------------------------------------------------------------------
    # -- across processes (shared=True) -------------------------------------------------------
    @property
    def shared(self) -> bool:
        """Whether device memory lives in shared memory (exportable). Thread rule: any thread."""
        return self._shared

    def export_memory(self, ordinal: int, ptr: int, nbytes: int) -> HostMemoryExport:
        """Name ``nbytes`` bytes of the live allocation at ``ptr`` for other processes.

        Args:
            ordinal: the device.
            ptr: the allocation's address.
            nbytes: at most its requested size.
        Returns:
            The picklable export (open it with :func:`~xlog_actors.driver.host.ipc.open_memory`).
        Raises:
            InvalidRequest: the driver was not made with ``shared=True``, or a bad ordinal.
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is not a live allocation of
                at least ``nbytes`` bytes; the driver is closed.
            ContextLost, ContextPoisoned: the context is dead.
        Thread rule: any thread.
        """
        if not self._shared:
            raise InvalidRequest("export needs device memory in shared memory: make the driver HostDriver(shared=True)")
        dev = self._gate(ordinal)
        with dev.lock:
            live = dev.live.get(ptr)
            if live is None or type(nbytes) is not int or not 0 < nbytes <= live[1]:
                raise DriverError(
                    f"device {ordinal}: export of {nbytes!r} bytes at {ptr!r}, not a live allocation that large",
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            segment = dev.arena.segment
            assert segment is not None  # a shared device's arenas are all segments
            return HostMemoryExport(segment.name, ptr - dev.arena.base, nbytes)

    def export_event(self, stream: HostStream) -> HostIpcEvent:
        """Record an interprocess event at the current end of ``stream`` (the
        ``cuIpcGetEventHandle`` twin): another process can wait until ``stream`` reached it.

        Returns:
            The picklable event.
        Raises:
            InvalidRequest: the driver was not made with ``shared=True``.
            DriverError: a closed stream or driver, or every event slot is taken.
            ContextLost, ContextPoisoned: the context is dead.
        Thread rule: any thread.
        """
        if not self._shared:
            raise InvalidRequest("interprocess events need HostDriver(shared=True)")
        dev = self._stream_device(stream)
        return dev.event_table().record(stream)

    def record_graph(self, ordinal: int, steps: Sequence[GraphStep],
                     lanes: Sequence[int] | None = None) -> SteppedGraph:
        """A graph that replays ``steps`` through this driver's calls, in order, on the launch
        stream (see :mod:`..graph`): its lanes, run one after the other, which is one valid
        schedule of them.

        Arguments and result: as ``Driver.record_graph``.
        Raises:
            InvalidRequest: a malformed step or lane list, a host view outside pinned memory, a
                bad ordinal.
            DriverError, ContextLost, ContextPoisoned: from the device's gate.
        Thread rule: any thread.
        """
        dev = self._gate(ordinal)
        checked = check_steps(steps)
        lane_lengths = check_lanes(lanes, len(checked))
        for i, step in enumerate(checked):
            if isinstance(step, (HostToDevice, DeviceToHost)):
                view = step.src if isinstance(step, HostToDevice) else step.dst
                if not self._pinned.holds(view):
                    raise InvalidRequest(f"graph step {i}: the host view is not of pinned memory (alloc_pinned)")
        return SteppedGraph(self, ordinal, checked, lambda: dev.epoch, self._pinned.holds, lane_lengths)

    def rebuild_context(self, ordinal: int) -> None:
        """Destroy device ``ordinal``'s context (every allocation, stream and event of it) and
        make a new one.

        Raises:
            InvalidRequest: a bad ordinal. DriverError: the driver is closed.
            ContextPoisoned: a sticky fault makes a rebuild impossible in-process.
        Thread rule: any thread but a stream thread of this driver.
        """
        self._device(ordinal).rebuild()

    def close(self) -> None:
        """Stop every stream thread and release every device's memory. Idempotent.

        Thread rule: any thread but a stream thread of this driver.
        """
        if self._closed:
            return
        self._closed = True
        for dev in self._devices:
            dev.shutdown()
        self._pinned.clear()
        self._staging.clear()
        _live_drivers.discard(self)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter shutdown
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.close()
