"""``StatisticsResource``: current, peak and total bytes and counts, overall and per tag (RMM's
``statistics_resource_adaptor``, plus the per-tag split users of every allocator ask for)."""

from __future__ import annotations

import threading
from types import MappingProxyType

from ...errors import CorruptionDetected, OutOfMemory
from ..block import AllocTag, DeviceBlock, StreamId
from ..figures import AllocationFigures, AllocationStatistics
from ..report import enrich_out_of_memory
from ..resource import DeviceMemoryResource
from .upstream import ResourceAdaptor

__all__ = ["StatisticsResource"]


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

    def values(self) -> tuple[int, int, int, int, int, int]:
        """The six figures in :class:`AllocationFigures`' field order."""
        return (
            self.current_bytes,
            self.current_count,
            self.peak_bytes,
            self.peak_count,
            self.total_bytes,
            self.total_count,
        )


class StatisticsResource(ResourceAdaptor):
    """Counts what goes through it; see :class:`~xlog_actors.memory.figures.AllocationFigures`
    for what each figure means.

    Invariants: the figures change only after the upstream call succeeded, so a failed
    allocate or deallocate changes nothing; ``statistics()`` is one consistent snapshot (every
    figure from the same instant). A :class:`~xlog_actors.errors.CorruptionDetected` from
    upstream counts as a free (the guard raises it after freeing). Sizes are the requested
    ``nbytes``. Every block freed through the adaptor must have been allocated through it (as in
    RMM); one that was not shows up as negative figures instead of failing after its memory was
    already freed.

    An :class:`~xlog_actors.errors.OutOfMemory` from upstream is re-raised with a message that
    also says what is free and which tags hold the most memory (see
    :func:`xlog_actors.memory.report.enrich_out_of_memory`): this adaptor is the one that knows
    the tags.

    Thread rule: every method may be called from any thread. One lock guards every counter; the
    upstream is called outside it.
    """

    __slots__ = ("_by_tag", "_lock", "_overall")

    def __init__(self, upstream: DeviceMemoryResource) -> None:
        """Count what goes through ``upstream``, starting from zero.

        Args:
            upstream: the resource to wrap.
        Raises:
            InvalidRequest: ``upstream`` is not a ``DeviceMemoryResource``.
        Thread rule: any thread.
        """
        super().__init__(upstream)
        self._lock = threading.Lock()
        self._overall = _Counter()
        self._by_tag: dict[AllocTag, _Counter] = {}

    def label(self) -> str:
        """``"stats"``. Thread rule: any thread."""
        return "stats"

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate upstream, then count the block under its tag.

        Args, Returns and Raises: as the upstream's ``allocate``; an ``OutOfMemory`` (or
        ``BudgetExceeded``) is the same exception with its message enriched.
        Thread rule: any thread.
        """
        try:
            block = self._upstream.allocate(nbytes, stream, tag)
        except OutOfMemory as exc:
            enrich_out_of_memory(exc, self, tags=self.current_bytes_by_tag())
            raise
        with self._lock:
            self._overall.add(block.nbytes)
            self._counter(block.tag).add(block.nbytes)
        return block

    def deallocate(self, block: DeviceBlock) -> None:
        """Free upstream, then count the free (also when the upstream raised
        ``CorruptionDetected``: the block was freed).

        Args and Raises: as the upstream's ``deallocate``.
        Thread rule: any thread.
        """
        try:
            self._upstream.deallocate(block)
        except CorruptionDetected:
            self._count_free(block)
            raise
        self._count_free(block)

    def _counter(self, tag: AllocTag) -> _Counter:
        """The counter of ``tag``, created on first use. Call under ``_lock``."""
        counter = self._by_tag.get(tag)
        if counter is None:
            counter = self._by_tag[tag] = _Counter()
        return counter

    def _count_free(self, block: DeviceBlock) -> None:
        with self._lock:
            self._overall.remove(block.nbytes)
            self._counter(block.tag).remove(block.nbytes)

    def statistics(self) -> AllocationStatistics:
        """Every figure, overall and per tag, from one instant.

        Returns:
            An immutable snapshot; ``by_tag`` holds every tag ever allocated through the adaptor.
        Thread rule: any thread.
        """
        with self._lock:
            by_tag = {tag: AllocationFigures(*c.values()) for tag, c in self._by_tag.items()}
            return AllocationStatistics(*self._overall.values(), MappingProxyType(by_tag))

    def current_bytes_by_tag(self) -> dict[AllocTag, tuple[int, int]]:
        """What each tag holds now.

        Returns:
            ``tag -> (current_bytes, current_count)`` of every tag that holds memory now.
        Thread rule: any thread.
        """
        with self._lock:
            return {
                tag: (c.current_bytes, c.current_count)
                for tag, c in self._by_tag.items()
                if c.current_count
            }
