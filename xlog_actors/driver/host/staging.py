"""Staging buffers of the host driver: where a copy from pageable memory keeps its snapshot.

``copy_to_device`` from pageable memory copies the caller's bytes when it is enqueued (as CUDA
stages pageable memory), and the stream copies that snapshot into device memory when it reaches
the copy. A fresh buffer per snapshot costs a page fault per 4 KiB page on first touch, which
for tens of MiB costs more than the copy itself; a :class:`StagingPool` keeps the buffers of
copies that ran and hands them out again, so a steady stream of large copies touches warm pages.

Invariants:

* A buffer is either lent (held by exactly one queued copy) or in the pool, never both: the copy
  gives it back only after it ran, and a copy that never runs (its context was rebuilt, its
  stream closed) never gives it back; the garbage collector takes it then.
* The pool holds at most ``max_bytes`` bytes; a buffer given back past that is dropped.
* Copies below ``min_bytes`` are not pooled (a small allocation comes from warm heap memory).

Thread rule: any thread; one private lock guards the free list and nothing else runs under it.
"""

from __future__ import annotations

import bisect
import threading
from typing import Final

import numpy as np
import numpy.typing as npt

from ...errors import OutOfMemory

__all__ = ["MAX_POOLED_BYTES", "MIN_POOLED_BYTES", "StagingPool"]

#: The most bytes a pool keeps between copies (a few large snapshots in flight at once).
MAX_POOLED_BYTES: Final = 256 << 20

#: Snapshots smaller than this are plain allocations.
MIN_POOLED_BYTES: Final = 1 << 20


class StagingPool:
    """Reusable host buffers for the snapshots of pageable copies.

    Thread rule: any thread (see the module docstring).
    """

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES, min_bytes: int = MIN_POOLED_BYTES) -> None:
        """An empty pool that keeps at most ``max_bytes`` bytes, of buffers of at least
        ``min_bytes`` bytes each."""
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, npt.NDArray[np.uint8]]] = []  # (nbytes, serial, buffer)
        self._serial = 0
        self._held = 0
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes

    @property
    def held_bytes(self) -> int:
        """How many bytes the pool keeps now. Thread rule: any thread."""
        return self._held

    def take(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A buffer of at least ``nbytes`` bytes, lent to the caller until :meth:`give`.

        The smallest pooled buffer that holds ``nbytes`` and is at most twice that size, else a
        new one (so a large buffer is not tied up by a small copy).

        Args:
            nbytes: a positive byte count of at least ``min_bytes``.
        Returns:
            A contiguous ``uint8`` array; its first ``nbytes`` bytes are the caller's.
        Raises:
            OutOfMemory: the host cannot give a new buffer (``.requested`` says how many bytes).
        Thread rule: any thread.
        """
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and self._free[i][0] <= 2 * nbytes:
                size, _serial, buf = self._free.pop(i)
                self._held -= size
                return buf
        try:
            return np.empty(nbytes, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise OutOfMemory(f"host staging buffer of {nbytes} bytes failed: {exc}", requested=nbytes) from None

    def give(self, buf: npt.NDArray[np.uint8]) -> None:
        """Return a buffer lent by :meth:`take`; dropped when the pool would exceed ``max_bytes``.

        Thread rule: any thread (a stream thread, once its copy ran).
        """
        with self._lock:
            if self._held + buf.nbytes > self.max_bytes:
                return
            self._serial += 1
            bisect.insort(self._free, (buf.nbytes, self._serial, buf))
            self._held += buf.nbytes

    def clear(self) -> None:
        """Drop every pooled buffer (the driver closes). Thread rule: any thread."""
        with self._lock:
            self._free, self._held = [], 0
