"""The figures a statistics adaptor and a block cache count, as immutable snapshots.

The adaptors build them and the memory report shows them; all import them from here, so no
adaptor and the report import each other for their types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .block import AllocTag

__all__ = ["AllocationFigures", "AllocationStatistics", "BlockCacheFigures"]


@dataclass(frozen=True, slots=True)
class AllocationFigures:
    """The six figures of one group of allocations.

    ``current_*``: allocated through the adaptor and not yet deallocated through it (a block
    whose free is queued but not reaped is no longer current: ask ``bytes_outstanding()`` for
    that). ``peak_*``: the highest ``current_*`` ever seen, bytes and count tracked separately.
    ``total_*``: every successful allocation ever.

    Immutable; any thread.
    """

    current_bytes: int = 0
    current_count: int = 0
    peak_bytes: int = 0
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0

    def as_dict(self) -> dict[str, int]:
        """The six figures by name, as plain JSON-serializable data.

        Returns:
            ``{"current_bytes": ..., ..., "total_count": ...}``.
        Thread rule: any thread.
        """
        return {
            "current_bytes": self.current_bytes,
            "current_count": self.current_count,
            "peak_bytes": self.peak_bytes,
            "peak_count": self.peak_count,
            "total_bytes": self.total_bytes,
            "total_count": self.total_count,
        }


@dataclass(frozen=True, slots=True)
class AllocationStatistics(AllocationFigures):
    """The overall figures plus ``by_tag``: the same six figures of every tag ever allocated
    through the adaptor (a read-only mapping). Immutable; any thread."""

    by_tag: Mapping[AllocTag, AllocationFigures] = field(
        default_factory=lambda: MappingProxyType({})
    )


@dataclass(frozen=True, slots=True)
class BlockCacheFigures:
    """What a block cache (``BlockCacheResource``) holds and has done, from one instant.

    ``cached_bytes``/``cached_blocks``: blocks kept idle for reuse, at their class sizes (still
    allocated from the driver, not counted in the stack's ``bytes_outstanding()``). ``hits``:
    allocations served from kept blocks, ``cross_stream_hits`` of them from another stream's
    after its fence completed; ``misses``: allocations that went upstream. ``fences``: events
    recorded to learn when another stream's kept blocks are idle. ``trims``: times kept blocks
    were given back upstream, ``trimmed_blocks``/``trimmed_bytes`` in all; ``dropped_bytes``:
    forgotten without a free after a rebuild. ``limit``: the most bytes kept idle (None: no
    limit); ``enabled``: False once released.

    Immutable; any thread.
    """

    cached_bytes: int = 0
    cached_blocks: int = 0
    hits: int = 0
    cross_stream_hits: int = 0
    misses: int = 0
    fences: int = 0
    trims: int = 0
    trimmed_blocks: int = 0
    trimmed_bytes: int = 0
    dropped_bytes: int = 0
    limit: int | None = None
    enabled: bool = True

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``, or None before the first allocation. Thread rule: any."""
        asked = self.hits + self.misses
        return None if asked == 0 else self.hits / asked

    def as_dict(self) -> dict[str, int | float | bool | None]:
        """Every figure by name, ``hit_rate`` included, as JSON-serializable data.

        Thread rule: any thread.
        """
        return {
            "cached_bytes": self.cached_bytes,
            "cached_blocks": self.cached_blocks,
            "hits": self.hits,
            "cross_stream_hits": self.cross_stream_hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "fences": self.fences,
            "trims": self.trims,
            "trimmed_blocks": self.trimmed_blocks,
            "trimmed_bytes": self.trimmed_bytes,
            "dropped_bytes": self.dropped_bytes,
            "limit": self.limit,
            "enabled": self.enabled,
        }
