"""Handles across processes on one node: what a pickled ``GpuRef`` becomes.

Pickling a ``GpuRef`` (``pickle``, a ``multiprocessing`` queue or pipe) exports it
(:func:`export_ref`): the device's driver names the allocation for other processes (a
shared-memory segment and offset on the host driver, a CUDA IPC memory handle on the GPU, or
for a block of an IPC-capable pool its pool's export data) and
records an interprocess event at the end of the stream of the handle's last write (of its
allocation stream when nothing wrote it yet; on the GPU the event an earlier export of the block
recorded on that same stream, recorded again, see :mod:`..driver.cuda.ipc`), and the device's
:class:`ExportTable` takes one reference count for the pickle. The bytes carry a
:class:`GpuRefExport`; unpickling it anywhere on the node (:func:`import_ref`) gives a
:class:`SharedGpuRef`: the same memory, zero-copy, with no ``DeviceActor`` in the receiving
process.

Invariants:

* ``SharedGpuRef.access()`` compares the owner's generation cell with the word the handle was
  exported under: one aligned 8-byte load. A rebuild, a restart, a poisoning or a stop of the
  device changes the cell under the device state's own lock, so every process's handles go
  stale in the same instant as the owner's (``GpuRefStale``: ``"context rebuilt"``,
  ``"context poisoned"``, ``"device shutting down"``); a released one says ``"released"``.
* Reads are ordered after the exported last write: :meth:`SharedGpuRef.wait_write` (which
  :meth:`SharedGpuRef.view` and the CUDA exports call) waits for the interprocess event.
  ``view(ordered=False)`` skips it, for a caller that orders the read itself (and for the hazard
  test that shows what the event prevents). On the GPU a handle opens the event once and keeps
  the opening (shared with the other handles of the same export slot in the process, which the
  import cache keeps), so a wait on an event already reached is one query.
* The memory lives while any process holds a handle (the count in the table), and only the
  device's process frees it (see :mod:`.export_table`). An imported handle is a reader's: a
  write through it is not recorded as the handle's last write anywhere.

Thread rule: a ``SharedGpuRef`` may be used from any thread; it is immutable but for its
release flag, which flips once (under the GIL).

The module runs past 400 lines because a ``SharedGpuRef`` is one handle with every face a
``GpuRef`` has (validation, ordering, host bytes, the CUDA Array Interface and DLPack, lifetime,
forwarding), each with its contract written out.
"""

from __future__ import annotations

import os
import weakref
from array import array
from typing import Any, Final, NamedTuple, Protocol

import numpy as np

from ..driver.host.ipc import HostIpcEvent, HostMemoryExport, open_memory
from ..driver.shared_memory import mapped, mapped_if_open
from ..errors import DeviceUnavailable, GpuRefStale, InvalidRequest, XlogError
from .export_table import (
    COUNTS_RANGE,
    HEADER_CELLS,
    SLOTS,
    STATUS_POISONED,
    STATUS_RUNNING,
    ExportTable,
    notify,
    state_word,
)
from .interop import consumer_stream_handle


class _Exportable(Protocol):
    """What an export needs of a handle (``GpuRef`` has it; a protocol, so that this module does
    not import the handle whose pickling calls it)."""

    @property
    def context(self) -> Any: ...

    @property
    def generation(self) -> int: ...

    @property
    def last_write_stream(self) -> Any: ...

    @property
    def alloc_stream(self) -> Any: ...

    def access(self) -> Any: ...

__all__ = ["WAIT_TIMEOUT_S", "GpuRefExport", "SharedGpuRef", "adopt", "export_ref", "import_ref"]

#: How long a read waits for the exported last write by default, in seconds.
WAIT_TIMEOUT_S: Final = 30.0

_BYTES = np.dtype(np.uint8)


class GpuRefExport(NamedTuple):
    """What a pickled ``GpuRef`` carries: a picklable descriptor of one exported allocation.

    Fields: ``driver`` (the owner's driver kind), ``owner_pid`` (of the process holding the
    memory), ``ordinal``, ``generation`` (the one the handle is valid in, as ``cell`` counts),
    ``nbytes``, ``tag``, ``cell`` (the table segment whose generation cell validates it: the
    owner's, or for an isolated device the parent's), ``table`` (the table segment holding its
    count: the memory owner's), ``slot`` and ``serial`` (the count this descriptor holds),
    ``memory`` (the driver's export of the bytes), ``event`` (the interprocess event of the last
    write; None: nothing to wait for).

    Thread rule: immutable; any thread.
    """

    driver: str
    owner_pid: int
    ordinal: int
    generation: int
    nbytes: int
    tag: str
    cell: str
    table: str
    slot: int
    serial: int
    memory: Any
    event: Any

    def where(self) -> str:
        """Context for an error message. Thread rule: any thread."""
        return (
            f"device {self.ordinal} of process {self.owner_pid}, export slot {self.slot}, "
            f"generation {self.generation}"
        )


def _table_cells(name: str) -> memoryview:
    """The int64 cells of export table ``name``, mapped once per process."""
    return mapped(name).int64s(0, HEADER_CELLS + 2 * SLOTS)


def export_ref(ref: _Exportable) -> GpuRefExport:
    """Export ``ref`` for another process (``GpuRef.__reduce__`` calls it): name its memory,
    record its last write as an interprocess event, take one count for the descriptor.

    Args:
        ref: a valid handle of a device that can export (the CUDA driver, or a host driver made
            with ``shared=True``) living in this process.
    Returns:
        The descriptor; each call takes a count that its one import adopts.
    Raises:
        GpuRefStale: the handle cannot be used.
        InvalidRequest: the device cannot export (a host driver without ``shared=True``), or
            too many exports are held.
        DeviceUnavailable: a parent-side handle of an isolated device whose child did not answer.
        DriverError, ContextLost, ContextPoisoned: from the driver.
    Thread rule: any thread.
    """
    context = ref.context
    runtime = getattr(context, "runtime", None)
    block = ref.access()
    state = context.state_ref()
    if state is None:  # pragma: no cover - access() just found it alive
        raise GpuRefStale("device state dropped", f"device {block.device_ordinal}")
    if runtime is None:
        # A parent-side handle of an isolated device: its child exports the memory (and holds
        # the count); the parent's generation cell is the one that says when it is stale.
        exported: GpuRefExport = context.export(ref)
        return exported._replace(cell=ExportTable.of(state).name, generation=ref.generation)
    driver = runtime.driver
    stream = runtime.stream_pool.resolve(ref.last_write_stream or ref.alloc_stream)
    if driver.kind == "host":
        memory: Any = driver.export_memory(context.ordinal, block.ptr, block.nbytes)
        event: Any = None if stream is None else driver.export_event(stream)
        keep: tuple[object, ...] = ()
    else:
        from ..driver.cuda import ipc as cuda_ipc

        try:
            memory = cuda_ipc.export_memory(driver, context.ordinal, block.ptr, block.nbytes)
            raw_event = None
            if stream is not None:
                # The event an earlier export of the block recorded on this stream, recorded again.
                earlier = [k for k in ExportTable.of(state).kept(ref)
                           if isinstance(k, cuda_ipc.RecordedEvent) and k.recorded_on(stream)]
                raw_event = cuda_ipc.record_event(driver, stream, earlier[-1] if earlier else None)
        except XlogError:
            # A rebuild that ran meanwhile retired the stream (or freed the memory): the handle
            # is stale, and that is the answer, as for a library actor's work.
            ref.access()
            raise
        event = None if raw_event is None else raw_event.handle
        keep = () if raw_event is None else (raw_event,)
    table = ExportTable.of(state)
    slot, serial = table.pin(ref, keep)
    return GpuRefExport(
        driver.kind, os.getpid(), context.ordinal, ref.generation, block.nbytes, str(block.tag), table.name,
        table.name, slot, serial, memory, event,
    )


def import_ref(export: GpuRefExport) -> SharedGpuRef:
    """Open an exported handle (unpickling a ``GpuRef`` calls it): it adopts the descriptor's count.

    Returns:
        The handle. Opening never fails for staleness: ``access()`` reports it, as for any handle.
        A descriptor whose owner's export table is gone (its process ended: an isolated device
        that restarted while the message carrying the handle was on its way) still opens, as a
        handle that was never live here: every ``access()`` raises ``GpuRefStale("context
        rebuilt")``, so the message that carried it arrives whole.
    Thread rule: any thread.
    """
    return SharedGpuRef(export)


def adopt(export: GpuRefExport) -> SharedGpuRef:
    """A handle of ``export`` holding a count of its own, taken here: what forwarding a handle
    takes (``SharedGpuRef.__reduce__``), for a descriptor that crossed without a count (a kept
    source of an isolated device's copy actor, ``isolated._sources``), sent while its sender held
    a count of the same slot.

    Args:
        export: the descriptor (its ``slot`` and ``serial`` name the count to take one of).
    Returns:
        The handle. One that could take no count (the owner freed the slot or moved to a new
        generation, or its table is gone with its process) holds none and is stale: ``access()``
        raises ``GpuRefStale`` as for any handle (``"context rebuilt"`` for a generation gone,
        ``"released"`` otherwise), so the caller meets it where it validates.
    Thread rule: any thread.
    """
    try:
        cells = _table_cells(export.table)
    except DeviceUnavailable:
        return SharedGpuRef(export)  # opens stale: the owner ended (see import_ref)
    base = HEADER_CELLS + 2 * export.slot
    with mapped(export.table).locked(*COUNTS_RANGE):
        counted = cells[base + 1] == export.serial and cells[base] > 0
        if counted:
            cells[base] += 1
    return SharedGpuRef(export, counted=counted)


def _give_back(table: str, slot: int, serial: int, opened: list[Any], events: list[Any]) -> None:
    """Give back one count of ``slot`` (a handle released or collected); tell the owner at zero.
    The handle's CUDA mapping (``opened``) and its opened event (``events``) are dropped first:
    CUDA wants a pool block freed in every importer before its owner frees it, and an opening
    found later under the slot's key must be of an event the owner still keeps. Runs from a
    finalizer: it never raises."""
    try:
        opened.clear()
        events.clear()
        segment = mapped_if_open(table)
        if segment is None:
            return
        cells = _table_cells(table)
        base = HEADER_CELLS + 2 * slot
        with segment.locked(*COUNTS_RANGE):
            if cells[base + 1] != serial or cells[base] <= 0:
                return  # the owner dropped the slot already (a new generation)
            cells[base] -= 1
            zero = cells[base] == 0
        if zero:
            notify(table)
    except Exception:  # noqa: BLE001 - a finalizer at interpreter exit: the owner sweeps on its own then
        return


class SharedGpuRef:
    """A handle to memory of a device in another process of this node; see the module docstring.

    Thread rule: any thread.
    """

    __slots__ = (
        "__weakref__", "_cell", "_events", "_export", "_finalizer", "_gone", "_memory", "_opened", "_released",
        "_word",
    )

    def __init__(self, export: GpuRefExport, counted: bool = True) -> None:
        """Open ``export`` (use :func:`import_ref` or :func:`adopt`); a descriptor whose owner's
        table is gone opens as a stale handle (see :func:`import_ref`).

        Args:
            export: the descriptor.
            counted: whether a count of its slot is held for this handle to adopt (False: a
                handle that holds none, released from birth; :func:`adopt`'s refusal).
        """
        self._export = export
        self._gone: str | None = None
        self._word = state_word(export.generation, STATUS_RUNNING)
        self._memory: Any = None
        # The CUDA mapping lives in a list the finalizer holds too, so that it is dropped before
        # the count goes back even when the handle is collected (a slot would be cleared after).
        self._opened: list[Any] = []
        self._events: list[Any] = []  # the opened CUDA event, dropped before the count as the mapping is
        self._released = False
        try:
            cells = _table_cells(export.table)
        except DeviceUnavailable as exc:
            # The owner ended after the pickle: nothing to adopt and no count to give back. A
            # one-cell word that never matches sends every access to ``_stale``.
            self._gone = str(exc)
            self._cell = memoryview(array("q", [-1]))
            self._released = True
            self._finalizer = weakref.finalize(self, _give_back, export.table, export.slot, export.serial, [], [])
            self._finalizer.detach()
            return
        self._cell = _table_cells(export.cell)[0:1]
        self._finalizer = weakref.finalize(
            self, _give_back, export.table, export.slot, export.serial, self._opened, self._events
        )
        if not counted or cells[HEADER_CELLS + 2 * export.slot + 1] != export.serial:
            # The owner freed the slot before this import (a late pickle), or no count is held
            # for this handle: never adopt a stranger's, never give back one not taken.
            self._finalizer.detach()
            self._released = True

    # -- validation -----------------------------------------------------------------------------
    def access(self) -> SharedGpuRef:
        """Validate the handle against the owner's generation cell.

        Returns:
            ``self``.
        Raises:
            GpuRefStale: ``"context rebuilt"``, ``"context poisoned"``, ``"device shutting
                down"`` or ``"released"``.
        Thread rule: any thread.
        """
        if self._cell[0] == self._word and not self._released:
            return self
        raise self._stale()

    def _stale(self) -> GpuRefStale:
        where = self._export.where()
        if self._gone is not None:
            return GpuRefStale("context rebuilt", f"{where}; its owner ended before the handle arrived ({self._gone})")
        word = int(self._cell[0])
        if word >> 2 != self._export.generation:
            return GpuRefStale("context rebuilt", f"{where}; the device is at generation {word >> 2}")
        if word & 3 == STATUS_POISONED:
            return GpuRefStale("context poisoned", where)
        if word & 3 != STATUS_RUNNING:
            return GpuRefStale("device shutting down", where)
        return GpuRefStale("released", where)

    def wait_write(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Block until the exported last write has landed.

        Args:
            timeout_s: how long to wait at most.
        Raises:
            GpuRefStale: the handle is (or goes) stale meanwhile.
            DeviceUnavailable: the write did not land in ``timeout_s``, or its owner ended.
        Thread rule: any thread.
        """
        self.access()
        event = self._export.event
        if event is None:
            return
        if isinstance(event, HostIpcEvent):
            event.wait(timeout_s, self.access)
        else:
            if not self._events:
                from ..driver.cuda import ipc as cuda_ipc

                e = self._export
                opened = cuda_ipc.open_event(e.ordinal, event, (e.table, e.slot, e.serial, e.generation, event))
                if self._released:  # released meanwhile: the finalizer has run, keep nothing
                    raise GpuRefStale("released", e.where())
                self._events.append(opened)
            self._events[0].wait(timeout_s, self.access)
        self.access()

    # -- the bytes ------------------------------------------------------------------------------
    def view(self, ordered: bool = True, timeout_s: float = WAIT_TIMEOUT_S) -> memoryview:
        """The bytes, zero-copy (host driver): a writable ``memoryview`` of the owner's memory.

        Args:
            ordered: wait for the exported last write first (False: the caller orders the read).
            timeout_s: how long that wait may take.
        Returns:
            ``nbytes`` bytes; valid while the handle is (check ``access()`` after reading).
        Raises:
            GpuRefStale, DeviceUnavailable: as :meth:`wait_write`.
            InvalidRequest: the owner runs the CUDA driver (use the CUDA exports).
        Thread rule: any thread.
        """
        if not isinstance(self._export.memory, HostMemoryExport):
            raise InvalidRequest(f"view() is for host driver memory; {self._export.where()} runs {self._export.driver}")
        if ordered:
            self.wait_write(timeout_s)
        else:
            self.access()
        if self._memory is None:
            self._memory = open_memory(self._export.memory)
        view: memoryview = self._memory
        return view

    def raw_device_ptr(self) -> int:
        """The device address of the memory in this process (CUDA driver), after validating. The
        first call opens the memory: legacy IPC, or a block of an IPC-capable pool (its pool
        imported once per process, through the owner's fd server).

        Raises:
            GpuRefStale: the handle cannot be used.
            InvalidRequest: the owner runs the host driver (use :meth:`view`).
            DriverError: the CUDA driver could not open the memory.
            DeviceUnavailable: a pool block whose owner's fd server is gone, refused or mute.
        Thread rule: any thread.
        """
        self.access()
        if isinstance(self._export.memory, HostMemoryExport):
            raise InvalidRequest(f"{self._export.where()} runs the host driver: use view()")
        if not self._opened:
            from ..driver.cuda import ipc as cuda_ipc

            opened = cuda_ipc.open_memory(self._export.ordinal, self._export.memory)
            if self._released:  # released meanwhile: the finalizer has run, keep nothing
                raise GpuRefStale("released", self._export.where())
            self._opened.append(opened)
        ptr: int = self._opened[0].ptr(self._export.memory)
        return ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 (CUDA driver only): a 1-D ``uint8`` view, the last write
        already waited for (``stream`` None)."""
        if isinstance(self._export.memory, HostMemoryExport):
            raise AttributeError("__cuda_array_interface__ is only offered on the CUDA driver (the owner runs host)")
        ptr = self.raw_device_ptr()
        self.wait_write()
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack export (CUDA driver only): a 1-D ``uint8`` tensor over the imported memory,
        kept alive by this handle; the exported last write is waited for first (on the host, so
        any consumer stream is ordered after it).

        Raises:
            AttributeError: the owner runs the host driver.
            InvalidRequest: a bad ``stream``.
            GpuRefStale, DeviceUnavailable: as :meth:`wait_write`.
        Thread rule: any thread.
        """
        if isinstance(self._export.memory, HostMemoryExport):
            raise AttributeError("__dlpack__ is only offered on the CUDA driver (the owner runs host)")
        from cuda.core import Buffer
        from cuda.core.utils import StridedMemoryView

        consumer_stream_handle(stream)  # refuses what the DLPack rules refuse
        ptr = self.raw_device_ptr()
        self.wait_write()
        buffer = Buffer.from_handle(ptr, self.nbytes, owner=self)
        view = StridedMemoryView.from_buffer(buffer, (self.nbytes,), dtype=_BYTES)
        return view.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``; ``AttributeError`` when the owner runs the host driver."""
        if isinstance(self._export.memory, HostMemoryExport):
            raise AttributeError("__dlpack_device__ is only offered on the CUDA driver (the owner runs host)")
        return (2, self._export.ordinal)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def export(self) -> GpuRefExport:
        """The descriptor the handle was opened from. Thread rule: any thread."""
        return self._export

    @property
    def generation(self) -> int:
        """The owner's generation at export. Thread rule: any thread."""
        return self._export.generation

    @property
    def nbytes(self) -> int:
        """The allocation's size in bytes. Thread rule: any thread."""
        return self._export.nbytes

    def __len__(self) -> int:
        return self._export.nbytes

    @property
    def tag(self) -> str:
        """The allocation's tag. Thread rule: any thread."""
        return self._export.tag

    @property
    def device_id(self) -> int:
        """The owner's device ordinal. Thread rule: any thread."""
        return self._export.ordinal

    @property
    def released(self) -> bool:
        """True once released (or never holding a count). Thread rule: any thread."""
        return self._released

    # -- lifetime -------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the handle's count back now (the owner frees the memory once no process holds
        it); every later ``access()`` raises ``GpuRefStale("released")``. Idempotent.

        Thread rule: any thread.
        """
        self._released = True
        self._memory = None
        self._finalizer()

    def __reduce__(self) -> tuple[Any, tuple[GpuRefExport]]:
        """Forward the handle to a further process: the pickle takes a count of its own.

        Raises:
            GpuRefStale: the handle cannot be used.
            DeviceUnavailable: the owner's table is gone.
        """
        self.access()
        export = self._export
        cells = _table_cells(export.table)
        base = HEADER_CELLS + 2 * export.slot
        with mapped(export.table).locked(*COUNTS_RANGE):
            if cells[base + 1] != export.serial or cells[base] <= 0:
                raise GpuRefStale("released", export.where())
            cells[base] += 1
        return import_ref, (export,)

    def __repr__(self) -> str:
        e = self._export
        return (
            f"SharedGpuRef(device={e.ordinal}, owner_pid={e.owner_pid}, nbytes={e.nbytes}, tag={e.tag!r}, "
            f"generation={e.generation}{', released' if self.released else ''})"
        )
