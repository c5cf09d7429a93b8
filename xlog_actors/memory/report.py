"""Memory reports: what a resource stack holds now, and out-of-memory messages that say why.

:func:`memory_report` takes a snapshot of any stack: its description, what it has outstanding,
what the driver says is free, the statistics of a ``StatisticsResource`` in it, the figures of a
``BlockCacheResource`` in it, the budget of a ``BudgetResource`` in it, and its live blocks
grouped by tag and by stream with their ages.
:func:`enrich_out_of_memory` rewrites an ``OutOfMemory`` message in place so it says what was
asked, what is free and which tags hold the most.

Both read the stack by duck typing (an adaptor forwards the attributes it lacks to its
upstream, so ``stack.live_blocks()`` or ``stack.statistics()`` reach the nearest layer that has
them): this module imports no adaptor, so adaptors may import it.

Thread rules: any thread, any time. Each part of a report is consistent by itself (taken under
the lock of the layer that owns it); parts taken from different layers may be a few
operations apart while other threads allocate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import OutOfMemory, XlogError
from .block import AllocTag, DeviceBlock, LiveBlock, StreamId
from .figures import AllocationStatistics, BlockCacheFigures
from .pinned import PinnedUsage
from .resource import DeviceMemoryResource
from .sizes import human_bytes

__all__ = [
    "GroupSummary",
    "MemoryReport",
    "enrich_out_of_memory",
    "memory_report",
]

# How many tags an out-of-memory message names.
_OOM_TOP_TAGS = 3


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """The live blocks of one tag or one stream: how many, how many bytes, the oldest's age
    (None where no block of the group has one). Immutable; any thread."""

    count: int
    nbytes: int
    oldest_age_s: float | None


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """A snapshot of one resource stack; see the module docstring.

    ``blocks`` is None where no layer of the stack can list its live blocks; ``by_tag`` and
    ``by_stream`` are then empty. ``free_bytes``/``total_bytes`` are None where the stack
    exposes no driver or the driver could not answer (``mem_info_error`` says why).
    ``statistics`` is None where the stack has no statistics adaptor, ``budget_limit`` where it
    has no budget. ``pinned_count``/``pinned_bytes``/``pinned_by_tag`` are the device's pinned
    host memory not yet freed (zero where the report was taken without it; the device actor's
    reports always include it). ``cached_by_tag`` is the share of each tag's live blocks that
    caches above the device hold idle (the allocator bridge's, for PyTorch): counted in
    ``by_tag`` too, so a tag's bytes in use are its ``by_tag`` bytes less its cached bytes (empty
    where the report was taken without caches; the device actor's reports include them).
    ``block_cache`` is the figures of a block cache (``cache``) in the stack, None where it has
    none: what it keeps is not in ``bytes_outstanding`` nor in the live blocks.

    Immutable; any thread.
    """

    description: str
    device_ordinal: int
    driver_kind: str | None
    bytes_outstanding: int
    free_bytes: int | None
    total_bytes: int | None
    mem_info_error: str | None
    budget_limit: int | None
    statistics: AllocationStatistics | None
    blocks: tuple[LiveBlock, ...] | None
    by_tag: Mapping[AllocTag, GroupSummary]
    by_stream: Mapping[StreamId, GroupSummary]
    pinned_count: int = 0
    pinned_bytes: int = 0
    pinned_by_tag: Mapping[AllocTag, GroupSummary] = field(default_factory=lambda: MappingProxyType({}))
    cached_by_tag: Mapping[AllocTag, GroupSummary] = field(default_factory=lambda: MappingProxyType({}))
    block_cache: BlockCacheFigures | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data (for ``GetStats`` replies and ``--json`` output).

        Returns:
            A dict of the fields; tags and stream ids become strings as JSON keys.
        Thread rule: any thread.
        """
        stats: dict[str, Any] | None = None
        if self.statistics is not None:
            s = self.statistics
            stats = {**s.as_dict(), "by_tag": {str(t): f.as_dict() for t, f in s.by_tag.items()}}
        return {
            "description": self.description,
            "device_ordinal": self.device_ordinal,
            "driver_kind": self.driver_kind,
            "bytes_outstanding": self.bytes_outstanding,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "mem_info_error": self.mem_info_error,
            "budget_limit": self.budget_limit,
            "statistics": stats,
            "blocks": None
            if self.blocks is None
            else [
                {
                    "ptr": b.ptr,
                    "nbytes": b.nbytes,
                    "tag": str(b.tag),
                    "stream": int(b.stream),
                    "age_s": b.age_s,
                }
                for b in self.blocks
            ],
            "by_tag": {str(t): _group(g) for t, g in self.by_tag.items()},
            "by_stream": {str(int(s)): _group(g) for s, g in self.by_stream.items()},
            "pinned": {
                "count": self.pinned_count,
                "nbytes": self.pinned_bytes,
                "by_tag": {str(t): _group(g) for t, g in self.pinned_by_tag.items()},
            },
            "cached": {
                "count": sum(g.count for g in self.cached_by_tag.values()),
                "nbytes": sum(g.nbytes for g in self.cached_by_tag.values()),
                "by_tag": {str(t): _group(g) for t, g in self.cached_by_tag.items()},
            },
            "block_cache": None if self.block_cache is None else self.block_cache.as_dict(),
        }

    def format(self) -> str:
        """A human-readable, multi-line rendering (``xlog-actors info``).

        Returns:
            The text, groups largest first, without a final newline.
        Thread rule: any thread.
        """
        kind = f", {self.driver_kind} driver" if self.driver_kind else ""
        lines = [f"device {self.device_ordinal}{kind}: stack {self.description}"]
        line = f"  outstanding {human_bytes(self.bytes_outstanding)}"
        if self.free_bytes is not None and self.total_bytes is not None:
            line += (
                f"; device free {human_bytes(self.free_bytes)} of {human_bytes(self.total_bytes)}"
            )
        elif self.mem_info_error is not None:
            line += f"; device free unknown ({self.mem_info_error})"
        if self.budget_limit is not None:
            line += f"; budget {human_bytes(self.budget_limit)}"
        lines.append(line)
        if self.pinned_count:
            tags = ", ".join(
                f"{t} {human_bytes(g.nbytes)} in {g.count}"
                for t, g in sorted(self.pinned_by_tag.items(), key=lambda kv: -kv[1].nbytes)
            )
            total = human_bytes(self.pinned_bytes)
            lines.append(f"  pinned host memory: {self.pinned_count} buffers, {total} ({tags})")
        if self.statistics is not None:
            s = self.statistics
            lines.append(
                f"  statistics: current {s.current_count} blocks / {human_bytes(s.current_bytes)}, "
                f"peak {s.peak_count} / {human_bytes(s.peak_bytes)}, "
                f"total {s.total_count} / {human_bytes(s.total_bytes)}"
            )
        if self.block_cache is not None:
            lines.append(_cache_line(self.block_cache))
        if self.blocks is None:
            lines.append("  live blocks: not listed by this stack")
            return "\n".join(lines)
        lines.append(f"  live blocks: {len(self.blocks)}")
        shares = {str(t): g for t, g in self.cached_by_tag.items()}
        for title, groups in (("by tag", self.by_tag), ("by stream", self.by_stream)):
            if not groups:
                continue
            lines.append(f"  {title}:")
            for key, g in sorted(groups.items(), key=lambda kv: -kv[1].nbytes):
                name = f"stream {int(key)}" if isinstance(key, StreamId) else str(key)
                age = "" if g.oldest_age_s is None else f", oldest {g.oldest_age_s:.1f} s"
                cached = None if isinstance(key, StreamId) else shares.get(str(key))
                share = "" if cached is None else f" ({human_bytes(cached.nbytes)} in {cached.count} idle in a cache)"
                lines.append(f"    {name}: {g.count} blocks, {human_bytes(g.nbytes)}{share}{age}")
        return "\n".join(lines)


def _cache_line(c: BlockCacheFigures) -> str:
    rate = "no allocations yet" if c.hit_rate is None else f"hit rate {100 * c.hit_rate:.1f}%"
    limit = "" if c.limit is None else f" (limit {human_bytes(c.limit)})"
    off = "" if c.enabled else ", released"
    return (f"  block cache: {c.cached_blocks} blocks, {human_bytes(c.cached_bytes)} kept{limit}{off}; {rate} "
            f"({c.hits} hits, {c.cross_stream_hits} across streams, {c.misses} misses); {c.trims} trims gave back "
            f"{human_bytes(c.trimmed_bytes)}")


def _group(g: GroupSummary) -> dict[str, Any]:
    return {"count": g.count, "nbytes": g.nbytes, "oldest_age_s": g.oldest_age_s}


def _live_block(entry: LiveBlock | DeviceBlock) -> LiveBlock:
    """Normalize what a base resource's ``live_blocks()`` returns: ``LiveBlock`` (with an age)
    from the async resource, ``DeviceBlock`` (without one) from the direct resource."""
    return LiveBlock.of(entry) if isinstance(entry, DeviceBlock) else entry


def _summarize(blocks: Iterable[LiveBlock], key: str) -> dict[Any, GroupSummary]:
    acc: dict[Any, list[Any]] = {}
    for b in blocks:
        slot = acc.setdefault(getattr(b, key), [0, 0, None])
        slot[0] += 1
        slot[1] += b.nbytes
        if b.age_s is not None and (slot[2] is None or b.age_s > slot[2]):
            slot[2] = b.age_s
    return {k: GroupSummary(c, n, a) for k, (c, n, a) in acc.items()}


def _live_blocks(resource: DeviceMemoryResource) -> tuple[LiveBlock, ...] | None:
    lister = getattr(resource, "live_blocks", None)
    if lister is None:
        return None
    blocks = [_live_block(e) for e in lister()]
    # oldest first, then largest: the blocks a leak hunt looks at first
    blocks.sort(key=lambda b: (-(b.age_s or 0.0), -b.nbytes))
    return tuple(blocks)


def _mem_info(
    resource: DeviceMemoryResource,
) -> tuple[str | None, int | None, int | None, str | None]:
    """``(driver kind, free, total, error)``; a driver that cannot answer gives its error text
    instead of failing the report (a report is most wanted when something is wrong)."""
    driver = getattr(resource, "driver", None)
    if driver is None:
        return None, None, None, None
    try:
        free, total = driver.mem_info(resource.device_ordinal)
    except XlogError as exc:
        return driver.kind, None, None, f"{type(exc).__name__}: {exc}"
    return driver.kind, free, total, None


def memory_report(
    resource: DeviceMemoryResource,
    pinned: PinnedUsage | None = None,
    cached: Mapping[AllocTag, tuple[int, int]] | None = None,
) -> MemoryReport:
    """A snapshot of ``resource`` (any stack, or a base resource alone).

    Args:
        resource: the outermost resource of the stack.
        pinned: the device's pinned host memory (``PinnedAllocator.usage()``); None reports none.
        cached: what caches above the device hold idle, tag -> ``(count, nbytes)``
            (``CacheShares.usage()``); None reports none.
    Returns:
        The :class:`MemoryReport`; a driver that cannot report its free memory gives its error
        text in ``mem_info_error`` instead of failing the report.
    Raises:
        Nothing of its own: the error of a layer's diagnostic that fails propagates (none
        fails on the stacks ``build_resource`` makes).
    Thread rule: any thread; see the module docstring for how consistent the parts are.
    """
    kind, free, total, error = _mem_info(resource)
    stats_of = getattr(resource, "statistics", None)
    cache_of = getattr(resource, "cache_statistics", None)
    blocks = _live_blocks(resource)
    return MemoryReport(
        description=resource.describe(),
        device_ordinal=resource.device_ordinal,
        driver_kind=kind,
        bytes_outstanding=resource.bytes_outstanding(),
        free_bytes=free,
        total_bytes=total,
        mem_info_error=error,
        budget_limit=getattr(resource, "limit_bytes", None),
        statistics=None if stats_of is None else stats_of(),
        blocks=blocks,
        by_tag=MappingProxyType(_summarize(blocks, "tag") if blocks else {}),
        by_stream=MappingProxyType(_summarize(blocks, "stream") if blocks else {}),
        pinned_count=0 if pinned is None else pinned.count,
        pinned_bytes=0 if pinned is None else pinned.nbytes,
        pinned_by_tag=MappingProxyType(
            {} if pinned is None else {t: GroupSummary(c, n, None) for t, (c, n) in pinned.by_tag.items()}
        ),
        cached_by_tag=MappingProxyType(
            {} if cached is None else {t: GroupSummary(c, n, None) for t, (c, n) in cached.items()}
        ),
        block_cache=None if cache_of is None else BlockCacheFigures(**cache_of()),
    )


# Set on an exception once its message was enriched, so that a second statistics adaptor (or
# the actor above the stack) does not append the same facts again.
_ENRICHED = "_xlog_enriched"


def enrich_out_of_memory(
    exc: OutOfMemory,
    resource: DeviceMemoryResource,
    tags: Mapping[AllocTag, tuple[int, int]] | None = None,
) -> OutOfMemory:
    """Append to ``exc``'s message what was asked, what the device has free, what the stack
    holds, and the largest tags; return ``exc`` (same object, same type and attributes, so
    ``except BudgetExceeded`` still matches). Sets ``exc.free`` where it was unknown.

    Idempotent: an exception already enriched is returned unchanged, so a second statistics
    adaptor (or the actor above the stack) does not append the same facts again.

    Args:
        exc: the exception to enrich, in place.
        resource: the stack that raised it (its description, driver and live blocks are read).
        tags: a tag -> ``(current bytes, current count)`` map; without it the tags come from the
            stack's live blocks where it can list them.
    Returns:
        ``exc`` itself.
    Thread rule: any thread, on an exception no other thread is enriching.
    """
    if getattr(exc, _ENRICHED, False):
        return exc
    parts = [
        f"asked for {human_bytes(exc.requested)} ({exc.requested} bytes) on device "
        + f"{resource.device_ordinal} through {resource.describe()}"
    ]
    _kind, free, total, error = _mem_info(resource)
    if free is not None and total is not None:
        parts.append(f"device free {human_bytes(free)} of {human_bytes(total)}")
        if exc.free is None:
            exc.free = free
    elif error is not None:
        parts.append(f"device free unknown ({error})")
    parts.append(f"outstanding in this stack {human_bytes(resource.bytes_outstanding())}")
    if tags is None:
        blocks = _live_blocks(resource)
        if blocks is not None:
            tags = {t: (g.nbytes, g.count) for t, g in _summarize(blocks, "tag").items()}
    if tags:
        top = sorted(tags.items(), key=lambda kv: -kv[1][0])[:_OOM_TOP_TAGS]
        parts.append(
            "largest tags: "
            + ", ".join(f"{tag} {human_bytes(nb)} in {count} blocks" for tag, (nb, count) in top)
        )
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    exc.args = (f"{message}; " + "; ".join(parts),)
    setattr(exc, _ENRICHED, True)
    return exc
