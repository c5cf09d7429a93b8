"""Device memory of the host driver: an address-space allocator over one anonymous mapping.

Each emulated device context owns one ``mmap`` of its full size (a :class:`DeviceArena`):
anonymous, or a named shared-memory segment on a driver made with ``shared=True`` (so that other
processes can map an allocation, :mod:`.ipc`). Pages are committed only when touched, so a 1 GiB device costs nothing
until it is used. Device pointers are real, distinct integers ``base + offset``; the allocator
(:class:`AddressSpace`) hands out :data:`~xlog_actors.driver.limits.ALIGNMENT`-aligned ranges,
as the CUDA allocators do. The arena also keeps the :class:`Allocations` live on the device, in
stream order, against which a host kernel's every access is checked.
"""

from __future__ import annotations

import bisect
import mmap
import threading
from typing import Final

from ..limits import ALIGNMENT
from ..shared_memory import SharedSegment

__all__ = ["ALIGNMENT", "POISON_BYTE", "AddressSpace", "Allocations", "DeviceArena", "align_up"]

#: What a freed byte reads as: a use after free sees garbage, not the old data. The guard adaptor
#: fills its canaries with the same byte.
POISON_BYTE: Final = 0xDD


def align_up(n: int, align: int = ALIGNMENT) -> int:
    """Round a byte count up to a multiple of an alignment.

    Args:
        n: a non-negative byte count.
        align: a power of two.
    Returns:
        The smallest multiple of ``align`` that is at least ``n``.
    Thread rule: any thread.
    """
    return (n + align - 1) & ~(align - 1)


class AddressSpace:
    """Best-fit range allocator with coalescing.

    Free ranges live in three views kept in step: ``_by_start`` (start -> size), ``_by_end``
    (end -> start) for O(1) coalescing, and ``_sorted`` ((size, start) pairs) for best fit with
    the lowest address winning ties, which makes address reuse deterministic. ``free_bytes`` is
    always the sum of the free ranges.

    Thread rule: not thread-safe; the owning device's lock guards it.
    """

    def __init__(self, size: int) -> None:
        """A space of ``size`` bytes, all free."""
        self.size = size
        self._by_start: dict[int, int] = {0: size}
        self._by_end: dict[int, int] = {size: 0}
        self._sorted: list[tuple[int, int]] = [(size, 0)]
        self.free_bytes = size

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        i = bisect.bisect_left(self._sorted, (size, start))
        del self._sorted[i]

    def _insert(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        bisect.insort(self._sorted, (size, start))

    def take(self, nbytes: int) -> int | None:
        """Take a free range.

        Args:
            nbytes: its size, already aligned.
        Returns:
            The offset of the range taken, or None when no free range is large enough.
        Thread rule: under the device lock.
        """
        i = bisect.bisect_left(self._sorted, (nbytes, -1))
        if i == len(self._sorted):
            return None
        size, start = self._sorted[i]
        self._remove(start, size)
        if size > nbytes:
            self._insert(start + nbytes, size - nbytes)
        self.free_bytes -= nbytes
        return start

    def give(self, start: int, nbytes: int) -> None:
        """Return a range taken earlier, merging it with its free neighbours.

        Args:
            start: its offset.
            nbytes: its size.
        Thread rule: under the device lock.
        """
        self.free_bytes += nbytes
        end = start + nbytes
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            prev_size = start - prev_start
            self._remove(prev_start, prev_size)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove(end, next_size)
            end += next_size
        self._insert(start, end - start)


class Allocations:
    """The allocations live on the device in stream order: what a kernel may touch.

    An allocation is added when it is handed out and removed when its free takes effect on the
    device (at once for ``free``, when the stream reaches it for ``free_async``), so a kernel
    enqueued before a stream-ordered free may still use its memory when it runs. Two records may
    share addresses: memory freed on a stream can be handed out again on that stream before the
    free has run, and both records are then live. Each record is the requested size, not the
    aligned one, so an access into the alignment padding is caught as compute-sanitizer catches
    it.

    Thread rule: any thread; a private lock guards the records and nothing blocks under it.
    """

    def __init__(self) -> None:
        """No allocation."""
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted, distinct
        self._ends: dict[int, list[int]] = {}  # start -> the end of each record that starts there

    def add(self, start: int, nbytes: int) -> None:
        """Record an allocation of ``nbytes`` bytes at address ``start``.

        Thread rule: any thread.
        """
        with self._lock:
            ends = self._ends.get(start)
            if ends is None:
                bisect.insort(self._starts, start)
                self._ends[start] = [start + nbytes]
            else:
                ends.append(start + nbytes)

    def remove(self, start: int, nbytes: int) -> None:
        """Forget the allocation recorded by ``add(start, nbytes)``.

        Raises:
            KeyError: when there is no such record (a driver bug).
        Thread rule: any thread.
        """
        with self._lock:
            ends = self._ends[start]
            ends.remove(start + nbytes)
            if not ends:
                del self._ends[start]
                del self._starts[bisect.bisect_left(self._starts, start)]

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies wholly inside one recorded allocation.

        The record starting nearest below ``ptr`` answers almost every access in O(log n); only
        an access it does not cover (an overlapping reuse, or a fault) scans every record.

        Thread rule: any thread.
        """
        end = ptr + nbytes
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0 and max(self._ends[self._starts[i]]) >= end:
                return True
            return any(start <= ptr and max(ends) >= end for start, ends in self._ends.items())

    def __len__(self) -> int:
        """How many records are live."""
        with self._lock:
            return sum(len(ends) for ends in self._ends.values())


class DeviceArena:
    """The bytes of one emulated device context: the mapping, its address range and the
    allocations live in it.

    Invariant: ``allocations`` only ever records ranges inside ``[base, base + size)``.

    Thread rule: any thread may read or write the mapping (the stream order is the caller's);
    ``close`` once, by the driver, when the context dies.
    """

    def __init__(self, base: int, size: int, segment_name: str | None = None) -> None:
        """A fresh, zeroed arena of ``size`` bytes whose first byte has address ``base``; in a
        new shared-memory segment of that name when ``segment_name`` is given.

        Raises:
            InvalidRequest, DeviceUnavailable: the segment cannot be made (see
                :meth:`SharedSegment.create`).
        """
        self.base = base
        self.size = size
        self.segment = None if segment_name is None else SharedSegment.create(segment_name, size)
        self.mm = mmap.mmap(-1, size) if self.segment is None else self.segment.mm
        self.allocations = Allocations()

    def contains(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside the arena (allocated or not).

        Thread rule: any thread.
        """
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def poison(self, offset: int, nbytes: int) -> None:
        """Overwrite ``nbytes`` bytes at ``offset`` with :data:`POISON_BYTE`.

        Thread rule: the thread on which the free takes effect.
        """
        self.mm[offset : offset + nbytes] = bytes([POISON_BYTE]) * nbytes

    def close(self) -> None:
        """Unmap the arena, or leave that to the last numpy view still exporting it.

        Thread rule: the driver, once.
        """
        if self.segment is not None:
            self.segment.close()  # unlinks the name; importers keep their mappings
            return
        try:
            self.mm.close()
        except BufferError:
            # A host kernel's numpy view still exports the mapping; it is unmapped when the
            # last view goes away.
            pass
