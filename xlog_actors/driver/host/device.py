"""One emulated device of the host driver: its context state, fault injection and allocator.

A :class:`HostDevice` outlives its contexts: a rebuild bumps ``epoch`` and replaces the arena,
the address space and the allocation tables, while the device object (and the lock) stays. Every
driver call passes :meth:`HostDevice.gate`, which raises for a dead context and fires an injected
fault that is due. Device work (stream ops) runs through :meth:`HostDevice.guarded`, which drops
work of a dead context and turns an exception inside the work into the sticky error a GPU would
report, so a faulting host kernel poisons the device exactly as an injected sticky fault does.

Thread rule: every method may be called from any thread. ``lock`` guards the allocator and the
fault state; nothing blocks while holding it.

The module runs past 400 lines because the allocator's stream-ordered reuse and the context's
retirement are one state guarded by one lock; splitting them would split the lock's invariants.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Literal

from ...errors import ContextLost, ContextPoisoned, DriverError, OutOfMemory
from ..shared_memory import segment_name
from .ipc import HostEventTable
from .memory import AddressSpace, DeviceArena, align_up
from .stream import HostStream

__all__ = ["FAULT_KINDS", "FaultKind", "HostDevice"]

#: The faults ``HostDriver.inject_fault`` can plant.
FaultKind = Literal["oom", "error", "context_lost", "sticky"]
FAULT_KINDS: tuple[FaultKind, ...] = ("oom", "error", "context_lost", "sticky")
_ILLEGAL_ADDRESS = "CUDA_ERROR_ILLEGAL_ADDRESS"


class _Fault:
    __slots__ = ("kind", "remaining")

    def __init__(self, kind: FaultKind, remaining: int) -> None:
        self.kind = kind
        self.remaining = remaining


class HostDevice:
    """Everything one emulated device holds; see the module docstring.

    Invariants: ``epoch`` only grows; ``live`` maps the pointer of every allocation handed out and
    not yet freed to its (aligned, requested) sizes, and the arena records the same allocations
    until their free takes effect on the device; ``deferred`` holds, per stream id, the ``[seq,
    offset, size]`` ranges freed on that stream whose free has not run yet (later allocations on
    the same stream may reuse them, stream order protects them), and ``deferred_bytes`` is their
    total.

    Thread rule: any thread; the fields are guarded by ``lock``.
    """

    def __init__(self, ordinal: int, base: int, size: int, shared: bool = False) -> None:
        """Device ``ordinal`` with ``size`` bytes at addresses from ``base``, context 0 live;
        ``shared``: each context's memory is a named shared-memory segment (see :mod:`.ipc`).

        Raises:
            DeviceUnavailable: ``shared`` where the system has no POSIX shared memory.
        """
        self._ordinal = ordinal
        self._base = base
        self.size = size
        self.shared = shared
        self.events: HostEventTable | None = None
        self.lock = threading.Lock()
        self.epoch = 0
        self.closed = False
        self.state: Literal["ok", "lost", "poisoned"] = "ok"
        self.poison_code = _ILLEGAL_ADDRESS
        self.fault: _Fault | None = None
        self.streams: weakref.WeakSet[HostStream] = weakref.WeakSet()
        self.arena = self._new_arena()
        self.space = AddressSpace(size)
        self.live: dict[int, tuple[int, int]] = {}
        self.deferred: dict[int, list[list[int]]] = {}
        self.deferred_bytes = 0

    def _new_arena(self) -> DeviceArena:
        return DeviceArena(self._base, self.size, segment_name("mem", self._ordinal) if self.shared else None)

    def event_table(self) -> HostEventTable:
        """The device's emulated IPC event table, made on first use.

        Thread rule: any thread; takes ``lock``.
        """
        with self.lock:
            if self.events is None:
                self.events = HostEventTable(self._ordinal)
            return self.events

    @property
    def ordinal(self) -> int:
        """The device's ordinal."""
        return self._ordinal

    def __repr__(self) -> str:
        return f"HostDevice({self._ordinal}, epoch={self.epoch}, {self.state})"

    # -- gates ------------------------------------------------------------------------------
    def raise_state(self) -> None:
        """Raise for a dead context; return when it is usable.

        Raises:
            ContextPoisoned: after a sticky fault, with its code.
            ContextLost: after a lost context, until it is rebuilt.
        Thread rule: any thread.
        """
        if self.state == "poisoned":
            raise ContextPoisoned(
                f"device {self._ordinal}: context poisoned by a sticky error ({self.poison_code})",
                code=self.poison_code,
            )
        if self.state == "lost":
            raise ContextLost(
                f"device {self._ordinal}: context destroyed; rebuild it", code="CUDA_ERROR_CONTEXT_IS_DESTROYED"
            )

    def check_open(self) -> None:
        """Raise ``DriverError`` (``CUDA_ERROR_DEINITIALIZED``) once the driver is closed.

        Thread rule: any thread.
        """
        if self.closed:
            raise DriverError("the host driver is closed", code="CUDA_ERROR_DEINITIALIZED")

    def gate(self, requested: int = 0) -> None:
        """The check every driver call passes: the driver is open, the context usable, and an
        injected fault that is due fires.

        Args:
            requested: the bytes an allocation asks for, carried by an injected ``OutOfMemory``.
        Raises:
            DriverError: the driver is closed, or an injected ``"error"``.
            ContextLost, ContextPoisoned: see :meth:`raise_state` (an injected fault included).
            OutOfMemory: an injected ``"oom"``.
        Thread rule: any thread.
        """
        self.check_open()
        if self.state != "ok":
            self.raise_state()
        if self.fault is not None:
            with self.lock:
                fault = self.fault
                if fault is not None:
                    if fault.remaining > 0:
                        fault.remaining -= 1
                    else:
                        self.fault = None
                        self._trigger(fault.kind, requested)

    def gate_stream(self, stream: HostStream, requested: int = 0) -> None:
        """:meth:`gate`, then check that ``stream`` is open and of the current context.

        Raises:
            DriverError: ``CUDA_ERROR_INVALID_HANDLE`` for a closed stream or one of an older
                context; and whatever :meth:`gate` raises.
        Thread rule: any thread.
        """
        self.gate(requested)
        if stream.epoch != self.epoch or stream.closed:
            raise DriverError(
                f"{stream!r} belongs to a destroyed context or was closed "
                f"(device {self._ordinal} is at context {self.epoch})",
                code="CUDA_ERROR_INVALID_HANDLE",
            )

    def inject(self, kind: FaultKind, after_calls: int) -> None:
        """Plant a fault that fires on the call after ``after_calls`` more calls (arguments
        already checked by the driver).

        Thread rule: any thread.
        """
        with self.lock:
            self.fault = _Fault(kind, after_calls)

    def _trigger(self, kind: FaultKind, requested: int) -> None:
        """Fire an injected fault; called under ``lock``."""
        if kind == "oom":
            raise OutOfMemory(
                f"device {self._ordinal}: injected out-of-memory ({requested} bytes requested)",
                requested=requested,
                free=self.space.free_bytes,
            )
        if kind == "error":
            raise DriverError(f"device {self._ordinal}: injected driver error", code="CUDA_ERROR_INVALID_VALUE")
        if kind == "context_lost":
            self.state = "lost"
        else:
            self.state = "poisoned"
            self.poison_code = _ILLEGAL_ADDRESS
        self.raise_state()

    def check_after_sync(self) -> None:
        """Raise the error of a sticky fault that work raised while the caller waited, as
        ``cuStreamSynchronize`` reports it.

        Raises:
            ContextLost, ContextPoisoned: see :meth:`raise_state`.
        Thread rule: any thread.
        """
        if self.state != "ok":
            self.raise_state()

    def guarded(self, stream: HostStream, op: Callable[[], object]) -> Callable[[], object]:
        """Wrap device work for ``stream``'s thread.

        The wrapper drops ``op`` when the stream's context (and its memory) is gone by the time it
        runs, as a GPU drops it; an exception from ``op`` poisons the context with the
        exception's ``code`` (``CUDA_ERROR_LAUNCH_FAILED`` when it has none), as a sticky
        error does.

        Args:
            stream: the stream that will run the work.
            op: the work.
        Returns:
            The wrapper; it never raises.
        Thread rule: any thread; the wrapper runs on ``stream``'s thread.
        """
        epoch = stream.epoch

        def run() -> None:
            if self.epoch != epoch or self.state != "ok":
                return
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - any fault in device work is sticky
                code = getattr(exc, "code", None) or "CUDA_ERROR_LAUNCH_FAILED"
                with self.lock:
                    if self.epoch == epoch and self.state == "ok":
                        self.state = "poisoned"
                        self.poison_code = code

        return run

    # -- memory -----------------------------------------------------------------------------
    def offset_of(self, ptr: object, nbytes: int, what: str) -> int:
        """The arena offset of ``nbytes`` bytes at device address ``ptr``.

        Args:
            ptr: the address.
            nbytes: how many bytes from it the call touches.
            what: names the call for the message.
        Returns:
            ``ptr - arena.base``.
        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when the range is outside device memory.
        Thread rule: any thread.
        """
        if type(ptr) is not int or not self.arena.contains(ptr, nbytes):
            raise DriverError(
                f"device {self._ordinal}: {what} of {nbytes} bytes at {ptr!r} is outside device memory",
                code="CUDA_ERROR_INVALID_VALUE",
            )
        return ptr - self.arena.base

    def rebuild(self) -> None:
        """Destroy the context (its streams, events and memory) and make a new, usable one.

        Raises:
            ContextPoisoned: a poisoned device cannot get a new context in-process.
        Thread rule: any thread but a stream thread of this device (it joins them).
        """
        with self.lock:
            if self.state == "poisoned":
                self.raise_state()
            self.epoch += 1
            self.state = "ok"
            old_streams, old_arena = self._retire()
            self.arena = self._new_arena()
            self.space = AddressSpace(self.size)
            self.live = {}
            self.deferred = {}
            self.deferred_bytes = 0
        for stream in old_streams:
            stream.close()
        old_arena.close()

    def shutdown(self) -> None:
        """Close the device for good: every later call raises ``DriverError``. Idempotent.

        Thread rule: any thread but a stream thread of this device (it joins them).
        """
        with self.lock:
            self.closed = True
            self.epoch += 1
            streams, arena = self._retire()
            events, self.events = self.events, None
        for stream in streams:
            stream.close()
        arena.close()
        if events is not None:
            events.close()  # after the streams drained: their last records have run

    def _retire(self) -> tuple[list[HostStream], DeviceArena]:
        """Detach the current streams; called under ``lock``, the caller closes what it gets."""
        streams = list(self.streams)
        self.streams = weakref.WeakSet()
        return streams, self.arena

    def allocate(self, nbytes: int, stream: HostStream | None) -> int:
        """Allocate ``nbytes`` (checked, positive) bytes; on ``stream``, memory freed earlier on
        that stream whose free has not run yet may be reused.

        Returns:
            The device address.
        Raises:
            OutOfMemory: no free range is large enough.
        Thread rule: any thread; takes ``lock``.
        """
        size = align_up(nbytes)
        with self.lock:
            offset = None if stream is None else self._take_deferred(stream.id, size)
            if offset is None:
                offset = self.space.take(size)
                if offset is None:
                    raise self._oom(nbytes)
            ptr = self.arena.base + offset
            self.live[ptr] = (size, nbytes)
            self.arena.allocations.add(ptr, nbytes)
        return ptr

    def _take_deferred(self, stream_id: int, size: int) -> int | None:
        ranges = self.deferred.get(stream_id)
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
        self.deferred_bytes -= size
        return offset

    def _oom(self, nbytes: int) -> OutOfMemory:
        return OutOfMemory(
            f"device {self._ordinal}: out of memory allocating {nbytes} bytes "
            f"({self.space.free_bytes} of {self.size} bytes free, "
            f"{self.deferred_bytes} bytes waiting for stream-ordered frees)",
            requested=nbytes,
            free=self.space.free_bytes,
        )

    def _not_live(self, ptr: object, what: str) -> DriverError:
        return DriverError(
            f"device {self._ordinal}: {what} of {ptr!r}, which is not a live allocation",
            code="CUDA_ERROR_INVALID_VALUE",
        )

    def free(self, ptr: int) -> None:
        """Free ``ptr`` as ``cuMemFree`` does: after every stream of the context has drained.

        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is not a live allocation (or
                was freed concurrently).
        Thread rule: any thread but a stream thread of this device; takes ``lock`` briefly,
        never while waiting.
        """
        with self.lock:
            if ptr not in self.live:
                raise self._not_live(ptr, "free")
            # The set is copied under the lock: other threads add to it, and a WeakSet that grows
            # while iterated raises "Set changed size during iteration".
            streams = list(self.streams)
        for stream in streams:
            if stream.epoch == self.epoch and not stream.closed:
                stream.wait_idle()
        with self.lock:
            entry = self.live.pop(ptr, None)
            if entry is None:
                raise self._not_live(ptr, "concurrent free")
            size, nbytes = entry
            offset = ptr - self.arena.base
            self.arena.allocations.remove(ptr, nbytes)
            self.arena.poison(offset, size)
            self.space.give(offset, size)

    def free_async(self, ptr: int, stream: HostStream) -> None:
        """Free ``ptr`` when ``stream`` reaches this point, as ``cuMemFreeAsync`` does.

        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is not a live allocation;
                ``CUDA_ERROR_INVALID_HANDLE`` when the stream is closed.
        Thread rule: any thread; takes ``lock``.
        """
        with self.lock:
            live = self.live.get(ptr)
            if live is None:
                raise self._not_live(ptr, "stream-ordered free")
            size, nbytes = live
            arena = self.arena
            offset = ptr - arena.base
            entry = [0, offset, size]

            def release() -> None:
                arena.allocations.remove(ptr, nbytes)
                arena.poison(offset, size)
                with self.lock:
                    ranges = self.deferred.get(stream.id, [])
                    keep = []
                    for r in ranges:
                        if r[0] <= entry[0]:
                            self.space.give(r[1], r[2])
                            self.deferred_bytes -= r[2]
                        else:
                            keep.append(r)
                    if keep:
                        self.deferred[stream.id] = keep
                    else:
                        self.deferred.pop(stream.id, None)

            entry[0] = stream.enqueue(release)
            del self.live[ptr]
            self.deferred.setdefault(stream.id, []).append(entry)
            self.deferred_bytes += size
