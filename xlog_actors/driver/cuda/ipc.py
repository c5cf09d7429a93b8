"""Handles across processes on the GPU: CUDA IPC memory and event handles.

The owner side (:func:`export_memory`, :func:`record_event`) runs in the device's process with
its context; the importer side (:func:`open_memory`, :func:`open_event`) in any process of the
node, which needs no ``CudaDriver`` of its own: it retains the device's primary context itself.

* **Memory**: ``cuIpcGetMemHandle`` on the allocation the block lies in (its base, from
  ``cuMemGetAddressRange``), plus the block's offset in it; the importer maps it once per
  process with ``cuIpcOpenMemHandle`` (an :class:`OpenedMemory`, counted, closed with
  ``cuIpcCloseMemHandle`` when the last handle of it goes). Legacy IPC works on ``cuMemAlloc``
  memory: the ``direct`` stack. A block of a stream-ordered pool (the ``async`` stack) goes
  through :mod:`.pool_ipc` when the pool is one made IPC-capable (``CudaDriver(ipc_pool=True)``);
  one of the device's default pool, which is not IPC-capable, is refused with ``InvalidRequest``.
* **Events**: ``cuEventCreate(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)``, recorded on
  the writer's stream, its ``cuIpcGetEventHandle`` carried in the descriptor. The owner keeps the
  event (a :class:`RecordedEvent`) while the export is held, and a later export of the same block
  whose last write is on the same stream records the same event again rather than making one
  (creating an interprocess event and reading its handle cost the owner far more than a record):
  a later point of one stream covers every earlier one, so an importer of the earlier export
  waits, at worst, for more work, never for less. The importer opens it with
  ``cuIpcOpenEventHandle`` once (an :class:`OpenedEvent`, shared by the handles of one export
  slot that carry it, destroyed when the last one drops it) and polls ``cuEventQuery`` with a
  deadline and an abort check (a ``cuEventSynchronize`` could not be interrupted by a restart,
  and a stream wait on the event of an owner that died could leave the copy's stream waiting for
  ever); an event already reached costs one query.

Handles are 64 opaque bytes: they travel as ``bytes`` and are copied in and out of the bindings'
structs through their addresses (:mod:`.importer`, which also retains an importer's context).

Invariants: an opened mapping is closed only once no ``SharedGpuRef`` of it is left in the
process (the table holds mappings weakly), and so is an opened event (the table holds them weakly
too, keyed by the export slot and serial whose count the handles hold, so the owner's event is
alive while its opening is); nothing here frees the owner's memory.

Thread rule: any thread. The importer's table of opened mappings is guarded by
:data:`.importer.lock`; every
call makes the device's primary context current on the calling thread first.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import DeviceUnavailable, InvalidRequest
from . import pool_ipc
from .call import NOT_READY, SUCCESS, check, cu
from .importer import ImportedMapping, bytes_of, lock, make_current, struct_of

__all__ = [
    "CudaMemoryExport",
    "OpenedEvent",
    "OpenedMemory",
    "RecordedEvent",
    "export_memory",
    "open_event",
    "open_memory",
    "record_event",
]

_POLL_MAX_S = 0.001
_opened: weakref.WeakValueDictionary[tuple[int, bytes], OpenedMemory] = weakref.WeakValueDictionary()
_events: weakref.WeakValueDictionary[tuple[Any, ...], OpenedEvent] = weakref.WeakValueDictionary()


class CudaMemoryExport(NamedTuple):
    """An allocation named across processes: the IPC handle of the allocation it lies in
    (``handle``, 64 bytes), the block's ``offset`` in it, ``nbytes`` long; ``owner_pid`` and
    ``ptr`` (the owner's address), which an import in the owner's own process uses as is (CUDA
    refuses to open a handle in the process that made it).

    Thread rule: immutable; any thread.
    """

    handle: bytes
    offset: int
    nbytes: int
    owner_pid: int
    ptr: int


def export_memory(driver: Any, ordinal: int, ptr: int, nbytes: int) -> CudaMemoryExport | pool_ipc.CudaPoolExport:
    """Name ``nbytes`` bytes at ``ptr`` of device ``ordinal`` for other processes.

    Args:
        driver: the owner's ``CudaDriver``.
        ordinal: the device.
        ptr: a live block's address.
        nbytes: its size.
    Returns:
        The picklable export: a :class:`CudaMemoryExport`, or for a block of an IPC-capable pool
        a :class:`~.pool_ipc.CudaPoolExport`.
    Raises:
        InvalidRequest: the block is in the device's default stream-ordered pool (not IPC-capable;
            see the module docstring).
        DeviceUnavailable: this process's fd server cannot start (a pool block's first export).
        DriverError, ContextPoisoned: from the driver.
    Thread rule: any thread.
    """
    driver.make_current(ordinal)
    err, pool = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr)
    if err == SUCCESS and int(pool) != 0:
        if pool_ipc.is_shareable(pool):
            return pool_ipc.export_pointer(ordinal, ptr, nbytes, pool)
        raise InvalidRequest(
            f"device {ordinal}: block {ptr:#x} is in the device's default stream-ordered pool, which is not "
            "IPC-capable; make the driver with CudaDriver(ipc_pool=True), or export handles of a device on "
            "the 'direct' stack (resource='direct')"
        )
    err, base, _size = cu.cuMemGetAddressRange(ptr)
    check(err, f"cuMemGetAddressRange({ptr:#x})")
    err, handle = cu.cuIpcGetMemHandle(base)
    check(err, f"cuIpcGetMemHandle({int(base):#x})")
    return CudaMemoryExport(bytes_of(handle), ptr - int(base), nbytes, os.getpid(), ptr)


class OpenedMemory(ImportedMapping):
    """One process's mapping of an exported allocation (made by :func:`open_memory`), shared by
    the handles of its blocks (it is unmapped, ``cuIpcCloseMemHandle``, when the last one drops
    it); ``base`` is the allocation's address here, 0 in the owner's own process, where ``ptr``
    needs no mapping.

    Thread rule: any thread.
    """

    __slots__ = ()

    def ptr(self, export: CudaMemoryExport) -> int:
        """The address of ``export``'s block in this process. Thread rule: any thread."""
        return export.ptr if self.base == 0 else self.base + export.offset

    def _release(self, base: int) -> None:
        cu.cuIpcCloseMemHandle(base)


def open_memory(
    ordinal: int, export: CudaMemoryExport | pool_ipc.CudaPoolExport
) -> OpenedMemory | pool_ipc.ImportedPointer:
    """Map ``export`` in this process (once per allocation; later handles share the mapping).

    Args:
        ordinal: the owner's device ordinal (the same numbering in this process).
        export: what the owner exported.
    Returns:
        The mapping (``ptr(export)`` is the block's address here); the caller keeps it as long as
        it uses the address, and drops it before it gives its reference count back.
    Raises:
        DriverError: CUDA refused the open (the owner freed or ended), or no GPU.
        DeviceUnavailable: a pool block whose owner's fd server is gone or refused (see
            :func:`.pool_ipc.open_pointer`).
    Thread rule: any thread.
    """
    if isinstance(export, pool_ipc.CudaPoolExport):
        return pool_ipc.open_pointer(ordinal, export)
    if export.owner_pid == os.getpid():
        return OpenedMemory(ordinal, 0)
    key = (ordinal, export.handle)
    with lock:
        opened = _opened.get(key)
        if opened is not None:
            return opened
        make_current(ordinal)
        # Under the lock: a second cuIpcOpenMemHandle of one handle in a process is refused.
        err, base = cu.cuIpcOpenMemHandle(
            struct_of(cu.CUipcMemHandle, export.handle), cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        )
        check(err, f"cuIpcOpenMemHandle (device {ordinal})")
        opened = OpenedMemory(ordinal, int(base))
        _opened[key] = opened
        return opened


class RecordedEvent:
    """An interprocess event the owner recorded; ``handle`` is its 64-byte IPC handle. The owner
    keeps the object while an export of it is held; dropping it destroys the event. It remembers
    the stream it was recorded on (weakly), so that :func:`record_event` records it again only on
    that very stream.

    Thread rule: any thread.
    """

    __slots__ = ("_event", "_stream", "handle")

    def __init__(self, event: Any, handle: bytes, stream: Any) -> None:
        """Made by :func:`record_event`."""
        self._event = event
        self.handle = handle
        self._stream = weakref.ref(stream)

    def recorded_on(self, stream: Any) -> bool:
        """Whether it was recorded on ``stream`` (the same live stream object). Thread rule: any thread."""
        return self._stream() is stream

    def __del__(self) -> None:
        try:
            cu.cuEventDestroy(self._event)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone with the process
            return


def record_event(driver: Any, stream: Any, again: RecordedEvent | None = None) -> RecordedEvent:
    """Record an interprocess event at the current end of ``stream`` (a ``CudaStream``).

    Args:
        driver: the owner's ``CudaDriver``.
        stream: the stream of the export's last write.
        again: an event an earlier export of the same block recorded: when it was recorded on
            ``stream``, it is recorded again and returned (no new event; see the module
            docstring); otherwise a new event is made.
    Returns:
        The recorded event: ``again`` or a new one.
    Raises:
        DriverError: the stream's context was rebuilt or closed (``CUDA_ERROR_INVALID_HANDLE``),
            or CUDA refused a call.
        ContextPoisoned: from the driver.
    Thread rule: any thread; holds the stream's gate across its calls.
    """
    driver.make_current(stream.ordinal)
    # Under the stream's gate, its liveness checked first (``_enter`` raises ``DriverError`` for a
    # stream of a destroyed context): a rebuild retires the stream through the same gate, so it
    # cannot destroy the stream, or the context of an event recorded on it, between the check
    # and these calls. Without it an export racing a rebuild recorded onto a destroyed stream,
    # which crashed the process (the GPU chaos run found it).
    with stream._gate:
        stream._enter()
        if again is not None and again.recorded_on(stream):
            (err,) = cu.cuEventRecord(again._event, cu.CUstream(stream.handle))
            check(err, "cuEventRecord (interprocess, again)")
            return again
        flags = cu.CUevent_flags.CU_EVENT_INTERPROCESS | cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        err, event = cu.cuEventCreate(flags)
        check(err, "cuEventCreate(INTERPROCESS)")
        try:
            (err,) = cu.cuEventRecord(event, cu.CUstream(stream.handle))
            check(err, "cuEventRecord (interprocess)")
            err, handle = cu.cuIpcGetEventHandle(event)
            check(err, "cuIpcGetEventHandle")
        except BaseException:
            cu.cuEventDestroy(event)
            raise
    return RecordedEvent(event, bytes_of(handle), stream)


class OpenedEvent:
    """One process's opening of an owner's interprocess event (made by :func:`open_event`),
    shared by the handles that carry it; ``cuEventDestroy`` when the last one drops it.

    Thread rule: any thread.
    """

    __slots__ = ("__weakref__", "_event", "_ordinal")

    def __init__(self, ordinal: int, event: Any) -> None:
        """Made by :func:`open_event`."""
        self._ordinal = ordinal
        self._event = event

    def wait(self, timeout_s: float, abort: Callable[[], object]) -> None:
        """Block until the owner's latest record of the event completed.

        Args:
            timeout_s: how long to wait at most.
            abort: called between polls; it raises to end the wait.
        Raises:
            DeviceUnavailable: not complete within ``timeout_s``.
            DriverError, ContextPoisoned: from the driver.
        Thread rule: any thread.
        """
        make_current(self._ordinal)
        _poll(self._ordinal, self._event, timeout_s, abort)

    def __del__(self) -> None:
        try:
            cu.cuEventDestroy(self._event)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone with the process
            return


def open_event(ordinal: int, handle: bytes, key: tuple[Any, ...]) -> OpenedEvent:
    """The owner's interprocess event ``handle``, opened in this process: the opening held under
    ``key`` already, or a new one (``cuIpcOpenEventHandle``).

    Args:
        ordinal: the owner's device.
        handle: the event's IPC handle.
        key: names the export slot, its serial and generation, and ``handle``: while a handle
            holding that slot's count lives, the owner keeps the event, so an opening found under
            the key is of the live event.
    Returns:
        The opening; the caller keeps it as long as it may wait on it, and drops it before it
        gives its count back.
    Raises:
        DriverError: CUDA refused the open (the owner ended), or no GPU.
    Thread rule: any thread.
    """
    with lock:
        opened = _events.get(key)
        if opened is not None:
            return opened
        make_current(ordinal)
        err, event = cu.cuIpcOpenEventHandle(struct_of(cu.CUipcEventHandle, handle))
        check(err, "cuIpcOpenEventHandle")
        opened = OpenedEvent(ordinal, event)
        _events[key] = opened
        return opened


def _poll(ordinal: int, event: Any, timeout_s: float, abort: Callable[[], object]) -> None:
    """Query ``event`` until it is reached: at once when it is, else sleeping between queries
    (doubling from 10 µs up to :data:`_POLL_MAX_S`), ``abort`` called between them."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while True:
        (err,) = cu.cuEventQuery(event)
        if err != NOT_READY:
            check(err, "cuEventQuery (interprocess)")
            return
        abort()
        if time.monotonic() >= deadline:
            raise DeviceUnavailable(f"device {ordinal}: interprocess event not reached in {timeout_s} s")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)
