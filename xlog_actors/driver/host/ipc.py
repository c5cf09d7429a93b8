"""Handles across processes on the host driver: shared device memory and emulated IPC events.

A host driver made with ``shared=True`` keeps each device's memory in a
:class:`~xlog_actors.driver.shared_memory.SharedSegment` (one per context), so an allocation is
named across processes by ``(segment, offset, nbytes)``: a :class:`HostMemoryExport`.
:func:`open_memory` maps it in any process of the node, zero-copy (segments are opened once per
process and kept).

The host driver's streams are threads, so its events cannot be waited on from another process.
:class:`HostEventTable` stands in for ``cuIpcGetEventHandle``: one small segment per device with
one int64 counter per stream. Exporting an event records, on the stream, an op that stores the
export's sequence number in the stream's counter; the picklable :class:`HostIpcEvent` names
``(segment, slot, seq)`` and is complete once the counter has reached ``seq``. The store is
enqueued as a marker (it runs even when the context died meanwhile), so no waiter waits on work
that was dropped; a waiter polls with a deadline and an abort check, since no primitive of the
standard library blocks on a flag another process sets.

Invariants: a slot's counter only grows (sequence numbers are issued in stream order, and a
stream taking a freed slot goes on from its count); a slot is handed to another stream only
after its stream was closed (which drains it) and collected, so every record of the earlier
stream has been reached and a waiter never mistakes another stream's progress for its own. The memory stays the owner's:
nothing here frees it.

Thread rules: :class:`HostEventTable` is used from any thread (a lock guards the slot table; a
collected stream gives its slot back without it, from any thread, see ``_give_back``);
:class:`HostIpcEvent` and :func:`open_memory` from any thread of any process.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

from ...errors import DeviceUnavailable, DriverError
from ..shared_memory import SharedSegment, mapped, segment_name
from .stream import HostStream

__all__ = ["EVENT_SLOTS", "HostEventTable", "HostIpcEvent", "HostMemoryExport", "open_memory"]

#: Streams one device may have exporting events at the same time.
EVENT_SLOTS = 1024

#: How long a poll sleeps at most between two looks at a counter, in seconds.
_POLL_MAX_S = 0.001

class HostMemoryExport(NamedTuple):
    """An allocation of a shared host device, named across processes.

    Fields: ``segment`` (the context's memory segment), ``offset`` (of the allocation in it),
    ``nbytes`` (its requested size).

    Thread rule: immutable; any thread.
    """

    segment: str
    offset: int
    nbytes: int


def open_memory(export: HostMemoryExport) -> memoryview:
    """The exported bytes, mapped in this process: a writable, zero-copy ``memoryview``.

    Args:
        export: what the owner's driver exported.
    Returns:
        ``nbytes`` bytes of the owner's device memory.
    Raises:
        DeviceUnavailable: the segment is gone (its context was rebuilt, or its owner ended).
    Thread rule: any thread.
    """
    segment = mapped(export.segment)
    return memoryview(segment.mm)[export.offset : export.offset + export.nbytes]


class HostIpcEvent(NamedTuple):
    """An emulated interprocess event: complete once counter ``slot`` of the event segment has
    reached ``seq``. Picklable; see the module docstring.

    Thread rule: immutable; any thread of any process.
    """

    segment: str
    slot: int
    seq: int

    def query(self) -> bool:
        """Whether the recorded work has run.

        Raises:
            DeviceUnavailable: the event segment is gone (its owner ended).
        Thread rule: any thread.
        """
        return mapped(self.segment).int64s(8 * self.slot, 1)[0] >= self.seq

    def wait(self, timeout_s: float, abort: Callable[[], object] | None = None) -> None:
        """Block until the recorded work has run.

        Args:
            timeout_s: how long to wait at most, in seconds.
            abort: called between polls; it raises to end the wait (a stale handle).
        Raises:
            DeviceUnavailable: not complete within ``timeout_s``, or the segment is gone.
            whatever ``abort`` raises.
        Thread rule: any thread.
        """
        cell = mapped(self.segment).int64s(8 * self.slot, 1)
        if cell[0] >= self.seq:
            return
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while cell[0] < self.seq:
            if abort is not None:
                abort()
            if time.monotonic() >= deadline:
                raise DeviceUnavailable(
                    f"interprocess event {self.segment}[{self.slot}] #{self.seq}: not reached in {timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)


class HostEventTable:
    """The owner's side of one device's emulated IPC events: the counter segment and which
    stream holds which slot. See the module docstring.

    Thread rule: any thread; a lock guards the slot table.
    """

    def __init__(self, ordinal: int) -> None:
        """A table for device ``ordinal``, with every slot free."""
        self._segment = SharedSegment.create(segment_name("events", ordinal), 8 * EVENT_SLOTS)
        self._cells = self._segment.int64s(0, EVENT_SLOTS)
        self._lock = threading.Lock()
        self._slots: weakref.WeakKeyDictionary[HostStream, list[int]] = weakref.WeakKeyDictionary()
        self._free = list(range(EVENT_SLOTS - 1, -1, -1))

    def _slot(self, stream: HostStream) -> list[int]:
        """``[slot, last issued seq]`` of ``stream``, taking a free slot on its first export."""
        entry = self._slots.get(stream)
        if entry is None:
            if not self._free:
                raise DriverError(
                    f"device {stream.ordinal}: {EVENT_SLOTS} streams already export events",
                    code="CUDA_ERROR_OUT_OF_MEMORY",
                )
            slot = self._free.pop()
            # The counter goes on from the slot's last stream: a late waiter on that stream's
            # records (all run before the slot was freed) still finds them reached.
            entry = [slot, int(self._cells[slot])]
            self._slots[stream] = entry
            # The stream is collected only after close() drained it: every record has run.
            weakref.finalize(stream, self._give_back, slot)
        return entry

    def _give_back(self, slot: int) -> None:
        # A stream's finalizer: the garbage collector runs it on whatever thread allocates, a
        # thread inside ``record`` (holding the lock) included, so it takes no lock (a plain
        # one would deadlock that thread and every later export). One append is atomic, and
        # ``_slot`` only pops under the lock: an append between its look and its pop only adds.
        self._free.append(slot)

    def record(self, stream: HostStream) -> HostIpcEvent:
        """Record an interprocess event at the current end of ``stream``.

        Returns:
            The picklable event.
        Raises:
            DriverError: every slot is taken, or the stream is closed.
        Thread rule: any thread.
        """
        with self._lock:
            entry = self._slot(stream)
            entry[1] += 1
            slot, seq = entry
            cells = self._cells

            def reach() -> None:
                cells[slot] = seq

            stream.enqueue(reach, always=True)
        return HostIpcEvent(self._segment.name, slot, seq)

    def close(self) -> None:
        """Unlink the segment (processes that mapped it keep their mapping). Idempotent. The
        cells stay mapped until the table is collected: a record still queued on a stream of
        another driver's making must not fault its stream's thread.

        Thread rule: the driver, once its streams drained.
        """
        self._segment.close()
