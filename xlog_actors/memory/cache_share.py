"""``CacheShares``: how much of a device's memory caches above it hold idle, by tag.

A cache that sits above a device (the allocator bridge's stream-ordered cache, for PyTorch)
keeps freed blocks allocated for reuse: the device counts them under their tag, like the blocks
in live tensors, and only the cache knows which are which. Each such cache adds a *source* here:
a callable that says, for each tag, how many blocks and bytes it holds idle now. The device's
memory report reads :meth:`CacheShares.usage` beside its live blocks, so a tag's bytes split into
the cache's share and the rest (in use).

Invariants: a source is added at most once (adding it again changes nothing); ``usage`` holds
only tags with at least one idle block, and sums the sources' figures per tag.

Thread rule: any thread. The source list is changed and copied under a lock; the sources are
called outside it, in the reading thread (the device actor's, for its reports): a source must
answer at once, without an ``ask`` or a driver call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from .block import AllocTag

__all__ = ["CacheShareSource", "CacheShares"]

#: A cache's idle blocks now: tag -> ``(count, nbytes)``.
CacheShareSource = Callable[[], Mapping[AllocTag, tuple[int, int]]]


class CacheShares:
    """The sources of one device's cached shares (see the module docstring).

    Thread rule: any thread.
    """

    __slots__ = ("_lock", "_sources")

    def __init__(self) -> None:
        """No sources. Thread rule: any thread."""
        self._lock = threading.Lock()
        self._sources: list[CacheShareSource] = []

    def add(self, source: CacheShareSource) -> None:
        """Count ``source``'s idle blocks in :meth:`usage` from now on (once, however often added).

        Thread rule: any thread.
        """
        with self._lock:
            if source not in self._sources:
                self._sources.append(source)

    def discard(self, source: CacheShareSource) -> None:
        """Stop counting ``source`` (nothing happens if it was not added). Thread rule: any thread."""
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def usage(self) -> dict[AllocTag, tuple[int, int]]:
        """What the sources hold idle now, per tag: ``(count, nbytes)``, tags with none left out.

        Raises:
            whatever a source raises (the sources of this package raise nothing).
        Thread rule: any thread; see the module docstring.
        """
        with self._lock:
            sources = list(self._sources)
        total: dict[AllocTag, tuple[int, int]] = {}
        for source in sources:
            for tag, (count, nbytes) in source().items():
                if count:
                    c, n = total.get(tag, (0, 0))
                    total[tag] = (c + count, n + nbytes)
        return total
