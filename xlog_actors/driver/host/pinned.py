"""Pinned host memory of the host driver: 4096-aligned host buffers kept in a table.

The host has no page-locking to emulate, but it emulates what the CUDA driver's pinned memory
means to its callers: a real, aligned host address; a table of the live allocations, so that a
second free or a foreign pointer is refused and changes nothing; and copies from it with no
staging snapshot (the caller leaves the bytes alone until the copy ran, as with CUDA). The
allocations belong to the driver, not to a device's context: a rebuild leaves them alone, and
the driver's close drops what is left. A caller's own buffer can be registered too (the
``cuMemHostRegister`` twin): copies from it are then read when they run, with no snapshot, until
it is unregistered.

Thread rule: any thread. The two tables are copy-on-write: a reader takes the current dict
(never changed once published) with no lock, and a writer builds the new dict outside the lock and
publishes it under the lock only if the current one is still the one it copied (else it builds
again). Nothing runs under the lock but a compare and an assignment: a free may come from a
finalizer, which the garbage collector runs on whatever thread allocates, and a lock held across
an allocation would be taken again by that finalizer on its own thread and never let go.
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import numpy.typing as npt

from ...errors import DriverError, InvalidRequest, OutOfMemory
from ..checks import check_nbytes

__all__ = ["PINNED_ALIGNMENT", "HostPinnedTable"]

#: The alignment of every pinned allocation: a page, as ``cuMemHostAlloc`` gives.
PINNED_ALIGNMENT: Final = 4096

#: A table entry: the device ordinal and the buffer.
_Entry = tuple[int, npt.NDArray[np.uint8]]


class HostPinnedTable:
    """The live pinned allocations of one host driver: address -> (device ordinal, buffer).

    Invariant: each entry's buffer starts at its key and is ``PINNED_ALIGNMENT``-aligned; an
    entry leaves the table exactly once (a free or ``clear``).

    Thread rule: any thread (see the module docstring).
    """

    def __init__(self) -> None:
        """An empty table."""
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, npt.NDArray[np.uint8]]] = {}
        self._registered: dict[int, tuple[int, npt.NDArray[np.uint8]]] = {}

    def _publish(self, name: str, old: dict[int, _Entry], new: dict[int, _Entry]) -> bool:
        """Make ``new`` the table ``name`` if it is still ``old``; whether it was. No allocation
        under the lock (see the module docstring); ``old`` stays referenced by the caller, so
        nothing is deallocated under it either."""
        with self._lock:
            if getattr(self, name) is not old:
                return False
            setattr(self, name, new)
            return True

    def alloc(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` aligned host bytes for device ``ordinal``.

        Args:
            ordinal: the (checked) device ordinal it is allocated through.
            nbytes: a positive byte count.
        Returns:
            Its address.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            OutOfMemory: the host cannot give ``nbytes`` (``.requested`` says how many).
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned allocation size")
        try:
            raw = np.empty(nbytes + PINNED_ALIGNMENT, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise OutOfMemory(
                f"device {ordinal}: pinned host allocation of {nbytes} bytes failed: {exc}", requested=nbytes
            ) from None
        skip = -int(raw.ctypes.data) % PINNED_ALIGNMENT
        buf = raw[skip : skip + nbytes]
        ptr = int(buf.ctypes.data)
        entry = (ordinal, buf)
        while True:
            old = self._live
            new = dict(old)
            new[ptr] = entry
            if self._publish("_live", old, new):
                return ptr

    def free(self, ordinal: int, ptr: int) -> None:
        """Forget the allocation at ``ptr``; its bytes go when no view of them is left.

        Args:
            ordinal: the device it was allocated through.
            ptr: its address.
        Raises:
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is no live pinned allocation of
                device ``ordinal`` (nothing changes then).
        Thread rule: any thread.
        """
        while True:
            old = self._live
            entry = old.get(ptr) if type(ptr) is int else None
            if entry is None or entry[0] != ordinal:
                owner = "" if entry is None else f" (it is device {entry[0]}'s)"
                raise DriverError(
                    f"device {ordinal}: free of pinned {ptr!r}, which is not a live pinned allocation of this "
                    f"device{owner}",
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            new = dict(old)
            del new[ptr]
            if self._publish("_live", old, new):
                break
        del entry, old  # the buffer goes here, outside the lock, once no view holds it

    def view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of the first ``nbytes`` of the allocation at ``ptr``; it keeps the
        buffer's bytes alive by itself.

        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            DriverError: ``ptr`` is no live pinned allocation, or ``nbytes`` exceeds it.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned view size")
        entry = self._live.get(ptr) if type(ptr) is int else None
        if entry is None or nbytes > entry[1].nbytes:
            what = "is not a live pinned allocation" if entry is None else f"holds {entry[1].nbytes} bytes"
            raise DriverError(
                f"pinned view of {nbytes} bytes at {ptr!r}: it {what}", code="CUDA_ERROR_INVALID_VALUE"
            )
        return entry[1][:nbytes].data

    def holds(self, view: memoryview) -> bool:
        """Whether the bytes of ``view`` lie inside one live pinned allocation or one registered
        buffer.

        Thread rule: any thread.
        """
        if not (self._live or self._registered) or len(view) == 0:
            return False
        start = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        end = start + len(view)
        entries = [*self._live.items(), *self._registered.items()]  # published dicts: never changed
        return any(ptr <= start and end <= ptr + buf.nbytes for ptr, (_o, buf) in entries)

    def register(self, ordinal: int, data: object) -> int:
        """Treat the caller's buffer ``data`` as pinned until :meth:`unregister`.

        Args:
            ordinal: the (checked) device ordinal it is registered through.
            data: a C-contiguous buffer of at least one byte; the caller keeps it alive and its
                bytes unchanged until every copy from it ran.
        Returns:
            Its address, the key for :meth:`unregister`.
        Raises:
            InvalidRequest: ``data`` is not a non-empty C-contiguous buffer.
            DriverError: ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` when it overlaps a
                registered buffer or a pinned allocation (nothing changes then).
        Thread rule: any thread.
        """
        try:
            buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"host register: a C-contiguous buffer, got {type(data).__name__} ({exc})") from None
        if buf.nbytes == 0:
            raise InvalidRequest("host register: the buffer is empty")
        ptr = int(buf.ctypes.data)
        end = ptr + buf.nbytes
        entry = (ordinal, buf)
        while True:
            old, live = self._registered, self._live
            clash = [p for p, (_o, b) in (*live.items(), *old.items()) if p < end and ptr < p + b.nbytes]
            if clash:
                break
            new = dict(old)
            new[ptr] = entry
            if self._live is live and self._publish("_registered", old, new):
                break
        if clash:
            raise DriverError(
                f"device {ordinal}: host register of {buf.nbytes} bytes at {ptr:#x}: overlaps memory already "
                f"pinned or registered at {clash[0]:#x}",
                code="CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            )
        return ptr

    def unregister(self, ordinal: int, ptr: int) -> None:
        """Forget a buffer :meth:`register` took; copies enqueued from it still read it when they
        run (they hold it).

        Raises:
            DriverError: ``CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`` when ``ptr`` is no buffer
                registered through device ``ordinal`` (nothing changes then).
        Thread rule: any thread.
        """
        while True:
            old = self._registered
            entry = old.get(ptr) if type(ptr) is int else None
            if entry is None or entry[0] != ordinal:
                raise DriverError(
                    f"device {ordinal}: host unregister of {ptr!r}, which is not a buffer registered through this "
                    "device",
                    code="CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
                )
            new = dict(old)
            del new[ptr]
            if self._publish("_registered", old, new):
                return

    def clear(self) -> None:
        """Forget every allocation (the driver closes). Thread rule: any thread."""
        empty_live: dict[int, _Entry] = {}
        empty_registered: dict[int, _Entry] = {}
        with self._lock:
            live, self._live = self._live, empty_live
            registered, self._registered = self._registered, empty_registered
        del live, registered  # the buffers go here, outside the lock
