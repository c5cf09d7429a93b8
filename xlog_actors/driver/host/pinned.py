"""Pinned host memory of the host driver: 4096-aligned host buffers kept in a table.

The host has no page-locking to emulate, but it emulates what the CUDA driver's pinned memory
means to its callers: a real, aligned host address; a table of the live allocations, so that a
second free or a foreign pointer is refused and changes nothing; and copies from it with no
staging snapshot (the caller leaves the bytes alone until the copy ran, as with CUDA). The
allocations belong to the driver, not to a device's context: a rebuild leaves them alone, and
the driver's close drops what is left.

Thread rule: any thread; one private lock guards the table, and nothing runs under it but dict
operations (a free may come from a finalizer on any thread, so nothing under the lock can
trigger one: the buffer is dropped after the lock is let go).
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import numpy.typing as npt

from ...errors import DriverError, OutOfMemory
from ..checks import check_nbytes

__all__ = ["PINNED_ALIGNMENT", "HostPinnedTable"]

#: The alignment of every pinned allocation: a page, as ``cuMemHostAlloc`` gives.
PINNED_ALIGNMENT: Final = 4096


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
        with self._lock:
            self._live[ptr] = (ordinal, buf)
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
        with self._lock:
            entry = self._live.get(ptr) if type(ptr) is int else None
            if entry is not None and entry[0] == ordinal:
                del self._live[ptr]
        if entry is None or entry[0] != ordinal:
            owner = "" if entry is None else f" (it is device {entry[0]}'s)"
            raise DriverError(
                f"device {ordinal}: free of pinned {ptr!r}, which is not a live pinned allocation of this "
                f"device{owner}",
                code="CUDA_ERROR_INVALID_VALUE",
            )
        del entry  # the buffer goes here, outside the lock, once no view holds it

    def view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of the first ``nbytes`` of the allocation at ``ptr``; it keeps the
        buffer's bytes alive by itself.

        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            DriverError: ``ptr`` is no live pinned allocation, or ``nbytes`` exceeds it.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned view size")
        with self._lock:
            entry = self._live.get(ptr) if type(ptr) is int else None
        if entry is None or nbytes > entry[1].nbytes:
            what = "is not a live pinned allocation" if entry is None else f"holds {entry[1].nbytes} bytes"
            raise DriverError(
                f"pinned view of {nbytes} bytes at {ptr!r}: it {what}", code="CUDA_ERROR_INVALID_VALUE"
            )
        return entry[1][:nbytes].data

    def holds(self, view: memoryview) -> bool:
        """Whether the bytes of ``view`` lie inside one live pinned allocation.

        Thread rule: any thread.
        """
        if not self._live or len(view) == 0:
            return False
        start = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        end = start + len(view)
        with self._lock:
            return any(ptr <= start and end <= ptr + buf.nbytes for ptr, (_o, buf) in self._live.items())

    def clear(self) -> None:
        """Forget every allocation (the driver closes). Thread rule: any thread."""
        with self._lock:
            live, self._live = self._live, {}
        live.clear()
