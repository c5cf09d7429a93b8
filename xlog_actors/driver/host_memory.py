"""Device memory of the host driver: an address-space allocator over one anonymous mapping.

Each emulated device owns one anonymous ``mmap`` of its full size. Pages are committed only when
touched, so a 1 GiB device costs nothing until it is used. Device pointers are real, distinct
integers ``base + offset``; the allocator hands out 256-byte aligned ranges, as the CUDA
allocators do.
"""

from __future__ import annotations

import bisect
import mmap

__all__ = ["ALIGNMENT", "POISON_BYTE", "AddressSpace", "DeviceArena"]

ALIGNMENT = 256
# What a freed byte reads as: a use after free sees garbage, not the old data.
POISON_BYTE = 0xDD


def align_up(n: int, align: int = ALIGNMENT) -> int:
    return (n + align - 1) & ~(align - 1)


class AddressSpace:
    """Best-fit range allocator with coalescing. Not thread-safe: the owning device's lock
    guards it.

    Free ranges live in three views kept in step: ``_by_start`` (start -> size), ``_by_end``
    (end -> start) for O(1) coalescing, and ``_sorted`` ((size, start) pairs) for best fit with
    the lowest address winning ties, which makes address reuse deterministic.
    """

    def __init__(self, size: int) -> None:
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
        """Offset of a free range of ``nbytes`` (already aligned), or None."""
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
        """Return a range taken earlier, merging it with free neighbours."""
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


class DeviceArena:
    """The bytes of one emulated device context: the mapping and its address range."""

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def poison(self, offset: int, nbytes: int) -> None:
        self.mm[offset : offset + nbytes] = bytes([POISON_BYTE]) * nbytes

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            # A host kernel's numpy view still exports the mapping; it is unmapped when the
            # last view goes away.
            pass
