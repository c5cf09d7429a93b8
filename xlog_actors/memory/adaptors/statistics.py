"""``StatisticsResource``: current, peak and total bytes and counts, overall and per tag (RMM's
``statistics_resource_adaptor``, plus the per-tag split users of every allocator ask for)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ...errors import CorruptionDetected, OutOfMemory
from ..block import AllocTag, DeviceBlock, StreamId
from ..report import enrich_out_of_memory
from ..resource import DeviceMemoryResource
from .upstream import ResourceAdaptor

__all__ = ["AllocationFigures", "AllocationStatistics", "StatisticsResource"]


@dataclass(frozen=True, slots=True)
class AllocationFigures:
    """The six figures of one group of allocations.

    ``current_*``: allocated through the adaptor and not yet deallocated through it (a block
    whose free is queued but not reaped is no longer current: ask ``bytes_outstanding()`` for
    that). ``peak_*``: the highest ``current_*`` ever seen, bytes and count tracked separately.
    ``total_*``: every successful allocation ever.
    """

    current_bytes: int = 0
    current_count: int = 0
    peak_bytes: int = 0
    peak_count: int = 0
    total_bytes: int = 0
    total_count: int = 0


@dataclass(frozen=True, slots=True)
class AllocationStatistics(AllocationFigures):
    """The overall figures plus ``by_tag``: the same six figures of every tag ever allocated
    through the adaptor (read-only)."""

    by_tag: Mapping[AllocTag, AllocationFigures] = field(
        default_factory=lambda: MappingProxyType({})
    )


class _Counter:
    """Mutable figures of one group; guarded by the adaptor's lock."""

    __slots__ = (
        "current_bytes",
        "current_count",
        "peak_bytes",
        "peak_count",
        "total_bytes",
        "total_count",
    )

    def __init__(self) -> None:
        self.current_bytes = 0
        self.current_count = 0
        self.peak_bytes = 0
        self.peak_count = 0
        self.total_bytes = 0
        self.total_count = 0

    def add(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.current_count += 1
        self.total_bytes += nbytes
        self.total_count += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.peak_count = max(self.peak_count, self.current_count)

    def remove(self, nbytes: int) -> None:
        self.current_bytes -= nbytes
        self.current_count -= 1

    def figures(self) -> AllocationFigures:
        return AllocationFigures(
            self.current_bytes,
            self.current_count,
            self.peak_bytes,
            self.peak_count,
            self.total_bytes,
            self.total_count,
        )


class StatisticsResource(ResourceAdaptor):
    """Counts what goes through it; see :class:`AllocationFigures` for what each figure means.

    Invariants: the figures change only after the upstream call succeeded, so a failed
    allocate or deallocate changes nothing; ``statistics()`` is one consistent snapshot (every
    figure from the same instant). A :class:`~xlog_actors.errors.CorruptionDetected` from
    upstream counts as a free (the guard raises it after freeing). Sizes are the requested ``nbytes``. Every block freed
    through the adaptor must have been allocated through it (as in RMM).

    An :class:`~xlog_actors.errors.OutOfMemory` from upstream is re-raised with a message that
    also says what is free and which tags hold the most memory (see
    :func:`xlog_actors.memory.report.enrich_out_of_memory`): this adaptor is the one that knows
    the tags.

    Thread rules: one lock guards every counter; the upstream is called outside it.
    """

    __slots__ = ("_by_tag", "_lock", "_overall")

    def __init__(self, upstream: DeviceMemoryResource) -> None:
        super().__init__(upstream)
        self._lock = threading.Lock()
        self._overall = _Counter()
        self._by_tag: dict[AllocTag, _Counter] = {}

    def label(self) -> str:
        return "stats"

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        try:
            block = self._upstream.allocate(nbytes, stream, tag)
        except OutOfMemory as exc:
            enrich_out_of_memory(exc, self, tags=self.current_bytes_by_tag())
            raise
        with self._lock:
            self._overall.add(block.nbytes)
            counter = self._by_tag.get(block.tag)
            if counter is None:
                counter = self._by_tag[block.tag] = _Counter()
            counter.add(block.nbytes)
        return block

    def deallocate(self, block: DeviceBlock) -> None:
        try:
            self._upstream.deallocate(block)
        except CorruptionDetected:
            # A guard below raises it after the block was freed: count the free, then report.
            self._count_free(block)
            raise
        self._count_free(block)

    def _count_free(self, block: DeviceBlock) -> None:
        with self._lock:
            self._overall.remove(block.nbytes)
            # get-or-create: a block allocated around the adaptor (against the rule above) shows
            # up as negative figures instead of failing after its memory was already freed
            counter = self._by_tag.get(block.tag)
            if counter is None:
                counter = self._by_tag[block.tag] = _Counter()
            counter.remove(block.nbytes)

    def statistics(self) -> AllocationStatistics:
        with self._lock:
            o = self._overall
            by_tag = {tag: c.figures() for tag, c in self._by_tag.items()}
            return AllocationStatistics(
                o.current_bytes,
                o.current_count,
                o.peak_bytes,
                o.peak_count,
                o.total_bytes,
                o.total_count,
                MappingProxyType(by_tag),
            )

    def current_bytes_by_tag(self) -> dict[AllocTag, tuple[int, int]]:
        """``tag -> (current_bytes, current_count)`` of every tag that holds memory now."""
        with self._lock:
            return {
                tag: (c.current_bytes, c.current_count)
                for tag, c in self._by_tag.items()
                if c.current_count
            }
