"""Handles across processes on the GPU: CUDA IPC memory and event handles.

The owner side (:func:`export_memory`, :func:`record_event`) runs in the device's process with
its context; the importer side (:func:`open_memory`, :func:`wait_event`) in any process of the
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
  event (a :class:`RecordedEvent`) while the export is held; the importer opens it with
  ``cuIpcOpenEventHandle`` and polls ``cuEventQuery`` with a deadline and an abort check (a
  ``cuEventSynchronize`` could not be interrupted by a restart).

Handles are 64 opaque bytes: they travel as ``bytes`` and are copied in and out of the bindings'
structs through their addresses (:mod:`.importer`, which also retains an importer's context).

Invariants: an opened mapping is closed only once no ``SharedGpuRef`` of it is left in the
process (the table holds mappings weakly); nothing here frees the owner's memory.

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
    "OpenedMemory",
    "RecordedEvent",
    "export_memory",
    "open_memory",
    "record_event",
    "wait_event",
]

_POLL_MAX_S = 0.001
_opened: weakref.WeakValueDictionary[tuple[int, bytes], OpenedMemory] = weakref.WeakValueDictionary()


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
    keeps the object while the export is held; dropping it destroys the event.

    Thread rule: any thread.
    """

    __slots__ = ("_event", "handle")

    def __init__(self, event: Any, handle: bytes) -> None:
        """Made by :func:`record_event`."""
        self._event = event
        self.handle = handle

    def __del__(self) -> None:
        try:
            cu.cuEventDestroy(self._event)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone with the process
            return


def record_event(driver: Any, stream: Any) -> RecordedEvent:
    """Record an interprocess event at the current end of ``stream`` (a ``CudaStream``).

    Raises:
        DriverError, ContextPoisoned: from the driver.
    Thread rule: any thread.
    """
    driver.make_current(stream.ordinal)
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
    return RecordedEvent(event, bytes_of(handle))


def wait_event(ordinal: int, handle: bytes, timeout_s: float, abort: Callable[[], object]) -> None:
    """Block until the owner's recorded event completed.

    Args:
        ordinal: the owner's device.
        handle: the event's IPC handle.
        timeout_s: how long to wait at most.
        abort: called between polls; it raises to end the wait.
    Raises:
        DeviceUnavailable: not complete within ``timeout_s``.
        DriverError, ContextPoisoned: from the driver.
    Thread rule: any thread.
    """
    make_current(ordinal)
    err, event = cu.cuIpcOpenEventHandle(struct_of(cu.CUipcEventHandle, handle))
    check(err, "cuIpcOpenEventHandle")
    try:
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
    finally:
        cu.cuEventDestroy(event)
