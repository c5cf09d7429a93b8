"""The importing process's cache of cross-process copy sources: a second ``CopyDeviceToDevice``
from the same exported allocation reads through the mapping the first one opened, instead of
opening it again (``cuIpcOpenMemHandle`` or a pool pointer import: milliseconds each) and closing
it when the copy's handle is dropped.

**What is cached.** A whole ``SharedGpuRef`` (:func:`reader_of` keeps the copy's source handle),
not the bare mapping: the handle holds one count of the owner's export slot, and the count is what
keeps the owner from freeing the memory. CUDA wants every importer to close its mapping (or free
its imported pool pointer) *before* the owner frees the allocation; a mapping kept without a count
could outlive the free and read whatever the owner's allocator put there next. With the count
held, the owner cannot free the block, so its slot and serial cannot name another allocation while
the entry lives.

**The key** is what names one export of one allocation in one generation: the owner's table, the
slot and its serial (bumped whenever the slot is freed), the generation cell and the generation
the handle was exported under. A block freed and reallocated gets a new slot or a new serial, so a
new key: it is never read through the old mapping. A copy's source handle carries an export whose
event marks the source's last write: a fresh export, or, for a copy asked of an isolated device's
copy actor, the export that actor keeps while the source's device got no library work since (see
:mod:`.isolated._library`; a descriptor kept past a later write would carry an older write's
event). The copy validates and waits for its own handle; only the mapping comes from the cache
(and the opened CUDA event, which the cached handle keeps for the handles of its slot).

**Lifetime rule.** An entry is kept open (its count held, its mapping open) until one of:

* it is evicted, least recently used first, when a new key would make more than
  :data:`CAPACITY` entries in this process;
* it has served :data:`REUSE_MAX` copies: it is dropped after the copy it serves last, and that
  copy's own handle is not cached, so that no entry pins its block for ever: the slot's count can
  reach zero (unless a copy actor keeps the export too), and the owner can free a block its user
  dropped and let go of the interprocess events its exports keep alive (one per stream that wrote
  the block while the slot was pinned);
* its owner's generation cell no longer says the handle's generation is running (a rebuild, a
  restart of an isolated device, a poisoning, a stop, an owner process that ended): every lookup
  drops every such entry first, so a handle of a dead owner is never served (the copy's own handle
  raises ``GpuRefStale`` as before);
* :func:`clear` is called.

Dropping an entry drops the handle: its mapping is closed first, then its count goes back (the
order :mod:`.shared_ref` keeps). The cost of the rule: memory its owner released stays allocated
while an entry of it is cached here (at most :data:`CAPACITY` blocks per importing process).

Thread rule: any thread; the table is guarded by one lock, and handles are dropped outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Final

from ..errors import GpuRefStale
from .shared_ref import SharedGpuRef

__all__ = ["CAPACITY", "REUSE_MAX", "CacheStats", "clear", "configure", "reader_of", "stats", "usable"]

#: Entries (exported allocations kept open) per importing process.
CAPACITY: Final = 4
#: Copies one entry serves before it is dropped (see the module docstring).
REUSE_MAX: Final = 64

_Key = tuple[str, int, int, str, int]


class _Entry:
    __slots__ = ("ref", "uses")

    def __init__(self, ref: SharedGpuRef) -> None:
        self.ref = ref
        self.uses = 0


class CacheStats:
    """Counters of this process's cache (for tests and reports): ``opened`` (copies that opened
    their source's mapping), ``reused`` (copies that read through a cached one), ``evicted``
    (entries dropped for the bound, the reuse limit or staleness), ``size`` (entries now).

    Thread rule: a snapshot; any thread.
    """

    __slots__ = ("evicted", "opened", "reused", "size")

    def __init__(self, opened: int, reused: int, evicted: int, size: int) -> None:
        self.opened = opened
        self.reused = reused
        self.evicted = evicted
        self.size = size

    def __repr__(self) -> str:
        return f"CacheStats(opened={self.opened}, reused={self.reused}, evicted={self.evicted}, size={self.size})"


_entries: OrderedDict[_Key, _Entry] = OrderedDict()
_lock = threading.Lock()
_counts = {"opened": 0, "reused": 0, "evicted": 0}
_capacity = CAPACITY
_reuse_max = REUSE_MAX


def _key(ref: SharedGpuRef) -> _Key:
    e = ref.export
    return (e.table, e.slot, e.serial, e.cell, e.generation)


def usable(ref: SharedGpuRef) -> bool:
    """Whether ``ref`` still validates (its owner's generation is the one it was made in, and it
    was not released). Thread rule: any thread."""
    try:
        ref.access()
    except GpuRefStale:
        return False
    return True


def reader_of(src: SharedGpuRef) -> SharedGpuRef:
    """The handle a copy of ``src`` reads through: a cached handle of the same export (its mapping
    open already), or ``src`` itself, then cached (see the module docstring for the rule).

    Args:
        src: the copy's source, validated by the caller (which also waits for its write).
    Returns:
        A handle of the same memory; the caller holds it until the copy has landed.
    Thread rule: any thread.
    """
    dropped: list[_Entry] = []  # dropped after the lock is let go: their finalizers close mappings
    try:
        with _lock:
            for stale_key, held in list(_entries.items()):
                if not usable(held.ref):
                    dropped.append(_entries.pop(stale_key))
            key = _key(src)
            entry = _entries.get(key)
            if entry is not None:
                entry.uses += 1
                _counts["reused"] += 1
                if entry.uses >= _reuse_max:
                    dropped.append(_entries.pop(key))  # this copy is its last; src is not cached
                else:
                    _entries.move_to_end(key)
                return entry.ref
            _counts["opened"] += 1
            if src.released:
                return src
            _entries[key] = _Entry(src)
            while len(_entries) > _capacity:
                dropped.append(_entries.popitem(last=False)[1])
            return src
    finally:
        if dropped:
            with _lock:
                _counts["evicted"] += len(dropped)
            dropped.clear()


def clear() -> None:
    """Drop every entry (each closes its mapping, then gives its count back). Thread rule: any thread."""
    with _lock:
        dropped = list(_entries.values())
        _entries.clear()
        _counts["evicted"] += len(dropped)
    dropped.clear()


def stats() -> CacheStats:
    """This process's counters. Thread rule: any thread."""
    with _lock:
        return CacheStats(_counts["opened"], _counts["reused"], _counts["evicted"], len(_entries))


def configure(capacity: int = CAPACITY, reuse_max: int = REUSE_MAX) -> None:
    """Set the bound and the reuse limit (tests); entries beyond a smaller bound are evicted at the
    next lookup. Thread rule: any thread."""
    global _capacity, _reuse_max
    with _lock:
        _capacity, _reuse_max = capacity, reuse_max
