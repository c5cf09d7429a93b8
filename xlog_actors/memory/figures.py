"""The figures a statistics adaptor counts, as immutable snapshots.

The statistics adaptor builds them and the memory report shows them; both import them from here,
so neither imports the other for its types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .block import AllocTag

__all__ = ["AllocationFigures", "AllocationStatistics"]


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
