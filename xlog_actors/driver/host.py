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
* faults (:meth:`HostDriver.inject_fault`): a failing call, a lost context that must be rebuilt,
  and a sticky error that poisons the device for the life of the driver. A host kernel that raises
  (for example on an address outside device memory) poisons the device as an illegal address
  would.

Thread rules: every public method may be called from any thread. Each device has one lock that
guards its allocator and fault state; stream queues have their own locks. Nothing blocks while
holding a device lock.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import (
    ContextLost,
    ContextPoisoned,
    DriverError,
    InvalidRequest,
    OutOfMemory,
)
from .checks import (
    check_kernel_args,
    check_microseconds,
    check_nbytes,
    check_ordinal,
    writable_bytes,
)
from .host_memory import AddressSpace, DeviceArena, align_up
from .host_stream import HostEvent, HostStream
from .kernel import Kernel
from .protocol import Buffer

__all__ = ["FaultKind", "HostDriver"]

FaultKind = Literal["oom", "error", "context_lost", "sticky"]
_FAULT_KINDS = ("oom", "error", "context_lost", "sticky")
# Each device gets its own 1 TiB window of the address space, so pointers of different devices
# never collide and a pointer names its device.
_DEVICE_WINDOW = 1 << 40
_BASE = 0x7F00_0000_0000


class _Fault:
    __slots__ = ("kind", "remaining")

    def __init__(self, kind: str, remaining: int) -> None:
        self.kind = kind
        self.remaining = remaining


class _HostDevice:
    """Everything one emulated device holds. Guarded by ``lock``."""

    def __init__(self, ordinal: int, size: int) -> None:
        self.ordinal = ordinal
        self.size = size
        self.lock = threading.Lock()
        self.epoch = 0
        self.state: Literal["ok", "lost", "poisoned"] = "ok"
        self.poison_code = "CUDA_ERROR_ILLEGAL_ADDRESS"
        self.fault: _Fault | None = None
        self.streams: weakref.WeakSet[HostStream] = weakref.WeakSet()
        self._new_arena()

    def _new_arena(self) -> None:
        self.arena = DeviceArena(_BASE + self.ordinal * _DEVICE_WINDOW, self.size)
        self.space = AddressSpace(self.size)
        # ptr -> aligned size of every allocation the driver handed out and not yet freed
        self.live: dict[int, int] = {}
        # stream id -> [seq, offset, size] ranges freed on that stream whose free has not run
        # yet; later allocations on the same stream may reuse them (stream order protects them)
        self.deferred: dict[int, list[list[int]]] = {}
        self.deferred_bytes = 0


class _HostMemory:
    """The :class:`~xlog_actors.driver.kernel.DeviceMemoryView` a host kernel gets."""

    __slots__ = ("_arena",)

    def __init__(self, arena: DeviceArena) -> None:
        self._arena = arena

    def array(self, ptr: int, count: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        nbytes = int(count) * dt.itemsize
        if not self._arena.contains(int(ptr), nbytes):
            raise DriverError(
                f"host kernel touched {nbytes} bytes at {int(ptr):#x}, outside device memory",
                code="CUDA_ERROR_ILLEGAL_ADDRESS",
            )
        return np.frombuffer(self._arena.mm, dtype=dt, count=int(count), offset=int(ptr) - self._arena.base)


_live_drivers: weakref.WeakSet[HostDriver] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for driver in list(_live_drivers):
        driver.close()


class HostDriver:
    """The host emulation of a CUDA driver. See the module docstring."""

    kind: Literal["host"] = "host"

    def __init__(self, device_count: int = 1, memory_per_device: int = 1 << 30) -> None:
        if type(device_count) is not int or device_count < 1:
            raise InvalidRequest(f"device_count must be a positive int, got {device_count!r}")
        check_nbytes(memory_per_device, "memory_per_device")
        if memory_per_device > _DEVICE_WINDOW:
            raise InvalidRequest(f"memory_per_device above {_DEVICE_WINDOW} bytes is not supported")
        self._memory_per_device = align_up(memory_per_device)
        self._devices = [_HostDevice(i, self._memory_per_device) for i in range(device_count)]
        self._closed = False
        _live_drivers.add(self)

    def __repr__(self) -> str:
        return f"HostDriver(device_count={len(self._devices)}, memory_per_device={self._memory_per_device})"

    # -- gates ------------------------------------------------------------------------------
    def _device(self, ordinal: object) -> _HostDevice:
        ordinal = check_ordinal(ordinal, len(self._devices), "the host driver")
        if self._closed:
            raise DriverError("the host driver is closed", code="CUDA_ERROR_DEINITIALIZED")
        return self._devices[ordinal]

    def _raise_state(self, dev: _HostDevice) -> None:
        if dev.state == "poisoned":
            raise ContextPoisoned(
                f"device {dev.ordinal}: context poisoned by a sticky error ({dev.poison_code})",
                code=dev.poison_code,
            )
        if dev.state == "lost":
            raise ContextLost(
                f"device {dev.ordinal}: context destroyed; rebuild it", code="CUDA_ERROR_CONTEXT_IS_DESTROYED"
            )

    def _gate(self, ordinal: int, requested: int = 0) -> _HostDevice:
        """Every driver call passes here: state checks and fault injection."""
        dev = self._device(ordinal)
        if dev.state != "ok":
            self._raise_state(dev)
        fault = dev.fault
        if fault is not None:
            with dev.lock:
                fault = dev.fault
                if fault is not None:
                    if fault.remaining > 0:
                        fault.remaining -= 1
                    else:
                        dev.fault = None
                        self._trigger(dev, fault.kind, requested)
        return dev

    def _trigger(self, dev: _HostDevice, kind: str, requested: int) -> None:
        if kind == "oom":
            raise OutOfMemory(
                f"device {dev.ordinal}: injected out-of-memory ({requested} bytes requested)",
                requested=requested,
                free=dev.space.free_bytes,
            )
        if kind == "error":
            raise DriverError(f"device {dev.ordinal}: injected driver error", code="CUDA_ERROR_INVALID_VALUE")
        if kind == "context_lost":
            dev.state = "lost"
        else:
            dev.state = "poisoned"
            dev.poison_code = "CUDA_ERROR_ILLEGAL_ADDRESS"
        self._raise_state(dev)

    def _gate_stream(self, stream: HostStream, requested: int = 0) -> _HostDevice:
        dev = self._gate(stream.ordinal, requested)
        if stream.epoch != dev.epoch or stream.closed:
            raise DriverError(
                f"{stream!r} belongs to a destroyed context or was closed "
                f"(device {dev.ordinal} is at context {dev.epoch})",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        return dev

    def _check_after_sync(self, ordinal: int) -> None:
        """A sticky error raised by work that ran while we waited surfaces at the sync, as
        ``cuStreamSynchronize`` reports it."""
        dev = self._devices[ordinal]
        if dev.state != "ok":
            self._raise_state(dev)

    def _guarded(self, stream: HostStream, op: Callable[[], None]) -> Callable[[], None]:
        dev = self._devices[stream.ordinal]
        epoch = stream.epoch

        def run() -> None:
            if dev.epoch != epoch or dev.state != "ok":
                return  # the context (and its memory) is gone: the work is dropped, as on a GPU
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - any fault in device work is sticky
                code = getattr(exc, "code", None) or "CUDA_ERROR_LAUNCH_FAILED"
                with dev.lock:
                    if dev.epoch == epoch and dev.state == "ok":
                        dev.state = "poisoned"
                        dev.poison_code = code

        return run

    def _offset(self, dev: _HostDevice, ptr: object, nbytes: int, what: str) -> int:
        if type(ptr) is not int or not dev.arena.contains(ptr, nbytes):
            raise DriverError(
                f"device {dev.ordinal}: {what} of {nbytes} bytes at {ptr!r} is outside device memory",
                code="CUDA_ERROR_INVALID_VALUE",
            )
        return ptr - dev.arena.base

    # -- queries ----------------------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, ordinal: int) -> str:
        self._device(ordinal)
        return f"host-emulated device {ordinal}"

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        dev = self._device(ordinal)
        if dev.state != "ok":
            self._raise_state(dev)
        with dev.lock:
            return dev.space.free_bytes, dev.size

    def make_current(self, ordinal: int) -> None:
        self._device(ordinal)

    def check_context(self, ordinal: int) -> None:
        """``ContextLost``/``ContextPoisoned`` when the device's context is gone; no fault is
        counted (the CUDA twin detects a reset made from outside the driver)."""
        dev = self._device(ordinal)
        if dev.state != "ok":
            self._raise_state(dev)

    def inject_fault(self, ordinal: int, kind: FaultKind, after_calls: int = 0) -> None:
        """Make device ``ordinal`` fail on a later driver call: the one after ``after_calls``
        more calls. ``"oom"``: that call raises ``OutOfMemory``; ``"error"``: ``DriverError``,
        context intact; ``"context_lost"``: ``ContextLost`` from then on until
        :meth:`rebuild_context`; ``"sticky"``: ``ContextPoisoned`` for the life of the driver."""
        dev = self._device(ordinal)
        if kind not in _FAULT_KINDS:
            raise InvalidRequest(f"unknown fault kind {kind!r}; expected one of {_FAULT_KINDS}")
        if type(after_calls) is not int or after_calls < 0:
            raise InvalidRequest(f"after_calls must be a non-negative int, got {after_calls!r}")
        with dev.lock:
            dev.fault = _Fault(kind, after_calls)

    def live_allocations(self, ordinal: int) -> int:
        """How many allocations of ``ordinal``'s current context are not yet freed (diagnostic)."""
        dev = self._device(ordinal)
        with dev.lock:
            return len(dev.live)

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, ordinal: int) -> HostStream:
        dev = self._gate(ordinal)
        stream = HostStream(self, ordinal, dev.epoch)
        # Under the device lock: ``free`` and ``close`` iterate the set from other threads, and a
        # WeakSet that grows while iterated raises "Set changed size during iteration".
        with dev.lock:
            dev.streams.add(stream)
        return stream

    def create_event(self, ordinal: int) -> HostEvent:
        self._gate(ordinal)
        return HostEvent(self, ordinal)

    # -- synchronous allocation -------------------------------------------------------------
    def alloc(self, ordinal: int, nbytes: int) -> int:
        nbytes = check_nbytes(nbytes)
        dev = self._gate(ordinal, nbytes)
        size = align_up(nbytes)
        with dev.lock:
            offset = dev.space.take(size)
            if offset is None:
                raise self._oom(dev, nbytes)
            ptr = dev.arena.base + offset
            dev.live[ptr] = size
        return ptr

    def free(self, ordinal: int, ptr: int) -> None:
        dev = self._gate(ordinal)
        with dev.lock:
            if ptr not in dev.live:
                raise DriverError(
                    f"device {ordinal}: free of {ptr!r}, which is not a live allocation",
                    code="CUDA_ERROR_INVALID_VALUE",
                )
        # cuMemFree synchronizes with the device before the memory goes back. The set is copied
        # under the lock (see create_stream); the waits run outside it.
        with dev.lock:
            streams = list(dev.streams)
        for stream in streams:
            if stream.epoch == dev.epoch and not stream.closed:
                stream._wait_idle()
        with dev.lock:
            size = dev.live.pop(ptr, None)
            if size is None:
                raise DriverError(
                    f"device {ordinal}: {ptr:#x} was freed concurrently", code="CUDA_ERROR_INVALID_VALUE"
                )
            offset = ptr - dev.arena.base
            dev.arena.poison(offset, size)
            dev.space.give(offset, size)

    def _oom(self, dev: _HostDevice, nbytes: int) -> OutOfMemory:
        return OutOfMemory(
            f"device {dev.ordinal}: out of memory allocating {nbytes} bytes "
            f"({dev.space.free_bytes} of {dev.size} bytes free, "
            f"{dev.deferred_bytes} bytes waiting for stream-ordered frees)",
            requested=nbytes,
            free=dev.space.free_bytes,
        )

    # -- stream-ordered allocation ----------------------------------------------------------
    def alloc_async(self, nbytes: int, stream: HostStream) -> int:  # type: ignore[override]
        nbytes = check_nbytes(nbytes)
        dev = self._gate_stream(stream, nbytes)
        size = align_up(nbytes)
        with dev.lock:
            offset = self._take_deferred(dev, stream.id, size)
            if offset is None:
                offset = dev.space.take(size)
                if offset is None:
                    raise self._oom(dev, nbytes)
            ptr = dev.arena.base + offset
            dev.live[ptr] = size
        return ptr

    @staticmethod
    def _take_deferred(dev: _HostDevice, stream_id: int, size: int) -> int | None:
        ranges = dev.deferred.get(stream_id)
        if not ranges:
            return None
        best = None
        for entry in ranges:
            if entry[2] >= size and (best is None or entry[2] < best[2]):
                best = entry
        if best is None:
            return None
        offset = best[1]
        if best[2] == size:
            ranges.remove(best)
        else:
            best[1] += size
            best[2] -= size
        dev.deferred_bytes -= size
        return offset

    def free_async(self, ptr: int, stream: HostStream) -> None:  # type: ignore[override]
        dev = self._gate_stream(stream)
        with dev.lock:
            size = dev.live.get(ptr)
            if size is None:
                raise DriverError(
                    f"device {stream.ordinal}: stream-ordered free of {ptr!r}, which is not a live allocation",
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            offset = ptr - dev.arena.base
            entry = [0, offset, size]

            def release() -> None:
                dev.arena.poison(offset, size)
                with dev.lock:
                    ranges = dev.deferred.get(stream.id, [])
                    keep = []
                    for r in ranges:
                        if r[0] <= entry[0]:
                            dev.space.give(r[1], r[2])
                            dev.deferred_bytes -= r[2]
                        else:
                            keep.append(r)
                    if keep:
                        dev.deferred[stream.id] = keep
                    else:
                        dev.deferred.pop(stream.id, None)

            entry[0] = stream.enqueue(release)
            del dev.live[ptr]
            dev.deferred.setdefault(stream.id, []).append(entry)
            dev.deferred_bytes += size

    # -- copies and work --------------------------------------------------------------------
    def copy_to_device(self, ptr: int, data: Buffer, stream: HostStream) -> None:  # type: ignore[override]
        snapshot = bytes(memoryview(data).cast("B"))
        dev = self._gate_stream(stream)
        offset = self._offset(dev, ptr, len(snapshot), "copy to device")
        arena = dev.arena

        def run() -> None:
            arena.mm[offset : offset + len(snapshot)] = snapshot

        stream.enqueue(run)

    def copy_to_host(self, ptr: int, nbytes: int, stream: HostStream) -> bytearray:  # type: ignore[override]
        nbytes = check_nbytes(nbytes, "copy size")
        out = bytearray(nbytes)
        self.copy_to_host_into(ptr, out, stream)
        return out

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: HostStream) -> None:  # type: ignore[override]
        target = writable_bytes(out)
        nbytes = len(target)
        dev = self._gate_stream(stream)
        offset = self._offset(dev, ptr, nbytes, "copy to host")
        arena = dev.arena

        def run() -> None:
            target[:] = arena.mm[offset : offset + nbytes]

        stream.enqueue(run)

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: HostStream) -> None:  # type: ignore[override]
        nbytes = check_nbytes(nbytes, "copy size")
        dev = self._gate_stream(stream)
        dst_off = self._offset(dev, dst, nbytes, "device-to-device copy destination")
        src_off = self._offset(dev, src, nbytes, "device-to-device copy source")
        arena = dev.arena

        def run() -> None:
            arena.mm[dst_off : dst_off + nbytes] = arena.mm[src_off : src_off + nbytes]

        stream.enqueue(run)

    def fill(self, ptr: int, byte: int, nbytes: int, stream: HostStream) -> None:  # type: ignore[override]
        if type(byte) is not int or not 0 <= byte <= 255:
            raise InvalidRequest(f"fill byte must be an int in 0..255, got {byte!r}")
        nbytes = check_nbytes(nbytes, "fill size")
        dev = self._gate_stream(stream)
        offset = self._offset(dev, ptr, nbytes, "fill")
        arena = dev.arena

        def run() -> None:
            np.frombuffer(arena.mm, np.uint8, nbytes, offset)[:] = byte

        stream.enqueue(run)

    def sleep(self, stream: HostStream, microseconds: int) -> None:  # type: ignore[override]
        microseconds = check_microseconds(microseconds)
        self._gate_stream(stream)
        seconds = microseconds / 1e6
        stream.enqueue(lambda: time.sleep(seconds))

    def launch(
        self,
        kernel: Kernel,
        grid: Sequence[int] | int,
        block: Sequence[int] | int,
        args: Sequence[object],
        stream: HostStream,  # type: ignore[override]
    ) -> None:
        check_kernel_args(kernel, args)
        dev = self._gate_stream(stream)
        mem = _HostMemory(dev.arena)
        values = tuple(args)
        stream.enqueue(lambda: kernel.host(mem, grid, block, *values))

    # -- context lifetime -------------------------------------------------------------------
    def rebuild_context(self, ordinal: int) -> None:
        dev = self._device(ordinal)
        with dev.lock:
            if dev.state == "poisoned":
                self._raise_state(dev)
            dev.epoch += 1
            dev.state = "ok"
            old_streams = list(dev.streams)
            old_arena = dev.arena
            dev.streams = weakref.WeakSet()
            dev._new_arena()
        for stream in old_streams:
            stream.close()
        old_arena.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for dev in self._devices:
            with dev.lock:
                dev.epoch += 1
                streams = list(dev.streams)
            for stream in streams:
                stream.close()
            dev.arena.close()
        _live_drivers.discard(self)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter shutdown
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.close()
