"""``ExportTable``: the owner's side of the handles one device exported to other processes.

One table per device state (per device, per owning process), in a shared-memory segment
``xlog-refs-<pid>-<ordinal>-<serial>`` that every importing process maps:

* cell 0, the **generation cell**: ``generation << 2 | status`` (0 running, 1 poisoned,
  2 stopped), written by the device state's mirror under the state's own lock, so it changes in
  the same instant as the owner's handles go stale. An imported handle compares it with the word
  it was made under on every ``access()``: one aligned 8-byte load.
* cell 1: the owner's pid.
* then per slot ``i`` a pair ``(count, serial)``: how many imported handles (and pickles of one
  in flight) hold slot ``i``, and the slot's serial, bumped whenever it is freed, so a late
  pickle of a freed slot is refused instead of adopting a stranger's memory.

**Lifetime, the reference count in shared memory.** Pickling a handle takes one count for the
pickle (``pin``): the importer that unpickles it adopts that count, and gives it back when its
handle is released or collected. While a slot's count is above zero the table holds the owner's
``GpuRef`` (and what the export needs alive, such as a CUDA IPC event: each one once, however
many exports of the slot reuse it), so the memory lives whether or not the owner still holds its
handle. The importer whose give-back brings a count to
zero sends one datagram to the table's abstract unix socket; the table's sweeper thread then
drops its pins with a zero count, and the owner's ``GpuRef`` frees as any dropped handle does,
through its device actor. So memory is freed only by its device process. A new generation (or a
stopped or poisoned device) drops every pin at once: that memory went with its context.

A pickle that is never unpickled keeps its count until the device's generation ends (the cost
of a count that travels with the bytes; documented in the fault model).

Thread rules: ``pin`` runs on any thread of the owner; the counts are changed under the table's
range lock (a ``threading.Lock`` plus an ``fcntl`` record lock, so threads and processes
exclude each other); the sweeper thread is the only one that drops pins.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import weakref
from typing import Any, Final

from ..driver.once import made_once
from ..driver.shared_memory import SharedSegment, segment_name
from ..errors import InvalidRequest
from .device_state import DeviceState

__all__ = [
    "COUNTS_RANGE",
    "HEADER_CELLS",
    "SLOTS",
    "STATUS_POISONED",
    "STATUS_RUNNING",
    "STATUS_STOPPED",
    "ExportTable",
    "notify",
    "state_word",
]

#: Handles one device may have exported at the same time.
SLOTS: Final = 4096
#: The status bits of the generation cell.
STATUS_RUNNING: Final = 0
STATUS_POISONED: Final = 1
STATUS_STOPPED: Final = 2
#: Cells before the first slot: the generation cell and the owner's pid.
HEADER_CELLS: Final = 2
#: The byte range of the counts, locked for every change of one.
COUNTS_RANGE: Final = (8 * HEADER_CELLS, 16 * SLOTS)
_STOP = b"stop"

_tables: weakref.WeakKeyDictionary[DeviceState, ExportTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def state_word(generation: int, status: int) -> int:
    """The generation cell's value for ``generation`` and ``status``. Thread rule: any thread."""
    return generation << 2 | status


def _word_of(state: DeviceState) -> int:
    status = STATUS_STOPPED if not state.accepting_ops else STATUS_POISONED if state.poisoned else STATUS_RUNNING
    return state_word(state.generation, status)


def _address(table: str) -> str:
    """The abstract unix socket name of table ``table`` (no file: it goes with its process)."""
    return "\0xlog-" + table


def notify(table: str) -> None:
    """Tell the owner of ``table`` that a count reached zero; a no-op when the owner is gone.

    Thread rule: any thread of any process, a garbage collector's included (never blocks).
    """
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.sendto(b"", _address(table))


class ExportTable:
    """The exports of one device state in this process; see the module docstring.

    Thread rule: see the module docstring.
    """

    def __init__(self, state: DeviceState) -> None:
        """A table mirroring ``state`` (made by :meth:`of`)."""
        self.segment = SharedSegment.create(segment_name("refs", state.device_id), 8 * (HEADER_CELLS + 2 * SLOTS))
        self.name = self.segment.name
        self._cells = self.segment.int64s(0, HEADER_CELLS + 2 * SLOTS)
        self._cells[1] = os.getpid()
        self._lock = threading.Condition()
        self._pins: dict[int, tuple[Any, tuple[object, ...], int]] = {}  # slot -> (GpuRef, keep-alive, its word)
        self._slot_of: dict[int, int] = {}  # id(GpuRef) -> slot
        self._free = list(range(SLOTS - 1, -1, -1))
        self._word = 0
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(_address(self.name))
        self._sweeper = threading.Thread(target=self._sweep_loop, name=f"xlog-export-sweeper-{self.name}", daemon=True)
        self._sweeper.start()
        state.mirror(self._mirror)

    @classmethod
    def of(cls, state: DeviceState) -> ExportTable:
        """The table of ``state``, made on first use; it lives as long as the state.

        Thread rule: any thread.
        """

        def make() -> ExportTable:
            table = cls(state)
            weakref.finalize(state, table.close)
            return table

        return made_once(_tables, _tables_lock, state, make)

    def __repr__(self) -> str:
        return f"ExportTable({self.name!r}, {self.pinned_count()} pinned)"

    # -- the generation cell ----------------------------------------------------------------------
    def _mirror(self, state: DeviceState) -> None:
        """Under the state's lock: publish its word, and have the sweeper drop older pins."""
        if self._closed:
            return  # the state outlived its table (closed at exit): nobody reads the cell now
        word = _word_of(state)
        self._cells[0] = word
        changed = word != self._word
        self._word = word
        if changed and not self._closed:
            notify(self.name)

    @property
    def word(self) -> int:
        """The generation cell's current value. Thread rule: any thread."""
        return int(self._cells[0])

    # -- counts -----------------------------------------------------------------------------------
    def pin(self, ref: Any, keep: tuple[object, ...]) -> tuple[int, int]:
        """Take one count of ``ref``'s slot for a pickle of it, pinning ``ref`` (and ``keep``)
        until the counts of the slot go back to zero.

        Args:
            ref: the owner's ``GpuRef``, validated by the caller.
            keep: what the export needs alive while it is held (an IPC event); kept beside what
                earlier exports of the slot keep, an object already kept (reused) counted once.
        Returns:
            ``(slot, serial)`` for the descriptor.
        Raises:
            InvalidRequest: :data:`SLOTS` handles are exported already, or the table is closed.
        Thread rule: any thread.
        """
        with self._lock:
            if self._closed:
                raise InvalidRequest(f"the export table {self.name} is closed (its device state is gone)")
            slot = self._slot_of.get(id(ref))
            if slot is None:
                if not self._free:
                    raise InvalidRequest(f"device exports {SLOTS} handles already; release some first")
                slot = self._free.pop()
                self._slot_of[id(ref)] = slot
            # Every export's keep-alive stays: an importer may open an earlier export's event yet.
            earlier = self._pins.get(slot)
            kept = keep if earlier is None else earlier[1] + tuple(
                k for k in keep if not any(k is e for e in earlier[1])
            )
            self._pins[slot] = (ref, kept, state_word(ref.generation, STATUS_RUNNING))
            offset, length = COUNTS_RANGE
            with self.segment.locked(offset, length):
                self._cells[HEADER_CELLS + 2 * slot] += 1
                serial = int(self._cells[HEADER_CELLS + 2 * slot + 1])
            return slot, serial

    def kept(self, ref: Any) -> tuple[object, ...]:
        """What the pin of ``ref`` keeps alive now (its exports' IPC events), or ``()`` when it is
        not pinned: an export may reuse one of them (see ``shared_ref.export_ref``).

        Thread rule: any thread.
        """
        with self._lock:
            slot = self._slot_of.get(id(ref))
            pin = None if slot is None else self._pins.get(slot)
            return () if pin is None or pin[0] is not ref else pin[1]

    def count(self, slot: int) -> int:
        """The count of ``slot``. Thread rule: any thread."""
        return int(self._cells[HEADER_CELLS + 2 * slot])

    def pinned_count(self) -> int:
        """How many handles the table pins. Thread rule: any thread."""
        with self._lock:
            return len(self._pins)

    def wait_unpinned(self, timeout_s: float) -> bool:
        """Wait until no handle is pinned.

        Returns:
            True when none is, False when ``timeout_s`` passed first.
        Thread rule: any thread but the sweeper.
        """
        with self._lock:
            return self._lock.wait_for(lambda: not self._pins, timeout_s)

    def sweep(self) -> None:
        """Drop the pins whose count is zero, and every pin once the generation moved on.

        Thread rule: the sweeper thread (tests and ``close`` may call it too).
        """
        dropped: list[Any] = []  # the refs die after the lock is let go: their finalizers run then
        with self._lock:
            offset, length = COUNTS_RANGE
            with self.segment.locked(offset, length):
                for slot, (_, _, word) in list(self._pins.items()):
                    base = HEADER_CELLS + 2 * slot
                    if word != self._word or self._cells[base] <= 0:
                        ref, _, _ = self._pins.pop(slot)
                        del self._slot_of[id(ref)]
                        self._cells[base] = 0
                        self._cells[base + 1] += 1  # late pickles of this slot are refused
                        self._free.append(slot)
                        dropped.append(ref)
            self._lock.notify_all()
        dropped.clear()

    def _sweep_loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(64)
            except OSError:
                return
            if data == _STOP:
                return
            self.sweep()

    def close(self) -> None:
        """Drop every pin, stop the sweeper, unlink the segment. Idempotent.

        Thread rule: any thread but the sweeper.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pins.clear()
            self._slot_of.clear()
            self._lock.notify_all()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(_STOP, _address(self.name))
        if threading.current_thread() is not self._sweeper:
            self._sweeper.join(5.0)
        self._sock.close()
        self._cells[0] = state_word(self._word >> 2, STATUS_STOPPED)
        self.segment.close()


@atexit.register
def _close_all() -> None:
    for table in list(_tables.values()):
        table.close()
