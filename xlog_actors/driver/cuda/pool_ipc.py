"""The IPC-capable stream-ordered pool: blocks of the ``async`` stack, zero-copy in
other processes of the node.

* **The pool.** A device of a ``CudaDriver(ipc_pool=True)`` allocates from a pool of its own,
  :func:`create_pool`: ``cuMemPoolCreate`` with ``handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``,
  pinned device memory located on the device (the device sets its release threshold as for the
  default pool). One per context epoch: the device makes it when it activates a context and
  :func:`retire_pool`\\ s it when that context's objects go (rebuild, close). CUDA allows destroying
  a pool with live blocks: it is released once the last one is freed.
* **Export** (:func:`export_pointer`, in the owner's process). The first export of a pool exports
  it as a POSIX fd (``cuMemPoolExportToShareableHandle``) and offers the fd to this process's fd
  server (:mod:`xlog_actors.driver.fd_passing`) under the key ``pool-<ordinal>-<serial>``; the fd
  is closed when the pool retires. Each block: ``cuMemPoolExportPointer``, 64 bytes that are no
  handle, carried in the picklable :class:`CudaPoolExport` with the server's address and the key.
* **Import** (:func:`open_pointer`, in any process). Once per pool and process: the fd is fetched
  over the server's socket (``SCM_RIGHTS``), imported with ``cuMemPoolImportFromShareableHandle``,
  and the received fd closed. An imported pool holds device memory of its owner's pool (a 32 MiB
  chunk on an H100) even after its owner destroyed it: it is destroyed here when a pool of the
  same device is first imported (the owner's next context, or another owner) and no block of it
  is imported in this process any more (one that still is goes at the next such import), so a
  process keeps at most one pool per device that it no longer uses. Each block: ``cuMemPoolImportPointer``,
  one :class:`ImportedPointer` shared by the handles of the block in the process, freed with
  ``cuMemFree`` when the last one drops it. CUDA requires importers to free before the exporter:
  ``SharedGpuRef`` drops its pointer *before* it gives its reference count back, and the owner
  frees only once every count is back (:mod:`xlog_actors.actors.export_table`). In the owner's own
  process the owner's address is used as is (CUDA refuses imports into the exporting process).

Invariants: only pools made here are exported (the default pool is refused by the caller); a
retired pool's key is withdrawn, so a late first import of it is refused (``DeviceUnavailable``)
instead of reaching a destroyed pool.

Thread rule: any thread. The owner's registry of pools is guarded by its own lock; the
importer's tables by :data:`.importer.lock`, which a first import of a pool holds while it
fetches the fd (bounded by :data:`FETCH_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from typing import Any, Final, NamedTuple

from ...errors import InvalidRequest
from ..fd_passing import fetch_fd, served
from .call import SUCCESS, check, cu
from .importer import ImportedMapping, bytes_of, lock, make_current, struct_of

__all__ = [
    "FETCH_TIMEOUT_S",
    "CudaPoolExport",
    "ImportedPointer",
    "create_pool",
    "export_pointer",
    "is_shareable",
    "open_pointer",
    "retire_pool",
]

#: How long a first import of a pool waits for the owner's fd server, in seconds.
FETCH_TIMEOUT_S: Final = 5.0


class _Owned:
    """The owner's record of one pool made here: its fd server key, and its fd once exported."""

    __slots__ = ("fd", "key")

    def __init__(self, key: str) -> None:
        self.key = key
        self.fd: int | None = None


_owned: dict[int, _Owned] = {}
_owned_lock = threading.Lock()
_serials = itertools.count()
#: (server, key) -> (the imported pool, the device's ordinal); see the module docstring.
_imported_pools: dict[tuple[str, str], tuple[Any, int]] = {}
_pointers: weakref.WeakValueDictionary[tuple[str, str, bytes], ImportedPointer] = weakref.WeakValueDictionary()


def _handle_type() -> Any:
    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaPoolExport(NamedTuple):
    """A block of an IPC-capable pool named across processes: the owner's fd ``server`` address
    and the pool's ``key`` there, the block's export ``data`` (64 bytes), ``nbytes``, and
    ``owner_pid`` and ``ptr`` (the owner's address, used as is in the owner's own process).

    Thread rule: immutable; any thread.
    """

    server: str
    key: str
    data: bytes
    nbytes: int
    owner_pid: int
    ptr: int


def create_pool(ordinal: int) -> tuple[Any, Any]:
    """Make an IPC-capable pool on device ``ordinal`` (its context current on this thread).

    Args:
        ordinal: the device.
    Returns:
        ``(CUresult, pool)``; on success the pool is registered for :func:`export_pointer`.
    Thread rule: any thread (the device calls it under its lock).
    """
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = _handle_type()
    props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = ordinal
    err, pool = cu.cuMemPoolCreate(props)
    if err == SUCCESS:
        with _owned_lock:
            _owned[int(pool)] = _Owned(f"pool-{ordinal}-{next(_serials)}")
    return err, pool


def is_shareable(pool: Any) -> bool:
    """Whether ``pool`` is a live pool made by :func:`create_pool` in this process. Thread rule: any thread."""
    return int(pool) in _owned


def retire_pool(pool: Any, *, destroy: bool = True) -> None:
    """Withdraw ``pool``'s fd and close it, then destroy the pool (``destroy=False``: the context
    is unusable, leave CUDA alone). A no-op for a pool not made here. Never raises.

    Thread rule: any thread (the device calls it under its lock).
    """
    with _owned_lock:
        owned = _owned.pop(int(pool), None)
    if owned is None:
        return
    if owned.fd is not None:
        with contextlib.suppress(Exception):
            served().withdraw(owned.key)
        os.close(owned.fd)
    if destroy:
        with contextlib.suppress(Exception):  # best effort: a lost context may refuse it
            cu.cuMemPoolDestroy(pool)


def export_pointer(ordinal: int, ptr: int, nbytes: int, pool: Any) -> CudaPoolExport:
    """Name the block at ``ptr`` of ``pool`` (one of :func:`create_pool`'s) for other processes.

    Args:
        ordinal: the device, its context current on this thread.
        ptr: a live block of ``pool``.
        nbytes: its size.
        pool: the pool it came from.
    Returns:
        The picklable export.
    Raises:
        InvalidRequest: ``pool`` is not (or no longer: its device rebuilt) one made here.
        DeviceUnavailable: this process's fd server cannot start.
        DriverError, ContextPoisoned: from the driver.
    Thread rule: any thread.
    """
    with _owned_lock:
        owned = _owned.get(int(pool))
        if owned is None:
            raise InvalidRequest(
                f"device {ordinal}: block {ptr:#x} is in a pool not made IPC-capable here (or retired since)"
            )
        if owned.fd is None:
            err, fd = cu.cuMemPoolExportToShareableHandle(pool, _handle_type(), 0)
            check(err, f"cuMemPoolExportToShareableHandle (device {ordinal})")
            try:
                served().offer(owned.key, int(fd))
            except BaseException:
                os.close(int(fd))
                raise
            owned.fd = int(fd)
        key = owned.key
    err, data = cu.cuMemPoolExportPointer(ptr)
    check(err, f"cuMemPoolExportPointer({ptr:#x}, device {ordinal})")
    return CudaPoolExport(served().address, key, bytes_of(data), nbytes, os.getpid(), ptr)


class ImportedPointer(ImportedMapping):
    """One process's import of a pool block (made by :func:`open_pointer`), shared by the handles
    of the block (freed with ``cuMemFree`` when the last one drops it); ``base`` is its address
    here, 0 in the owner's own process, where the owner's address needs no import.

    Thread rule: any thread.
    """

    __slots__ = ()

    def ptr(self, export: CudaPoolExport) -> int:
        """The address of ``export``'s block in this process. Thread rule: any thread."""
        return export.ptr if self.base == 0 else self.base

    def _release(self, base: int) -> None:
        cu.cuMemFree(base)


def _drop_unused_pools(ordinal: int) -> None:
    """Destroy the imported pools of device ``ordinal`` that no block imported in this process
    uses (a block's entry leaves :data:`_pointers` only after its ``cuMemFree``). The caller holds
    :data:`.importer.lock` and made the device's context current."""
    used = {key[:2] for key in list(_pointers.keys())}
    for name, (pool, of) in list(_imported_pools.items()):
        if of == ordinal and name not in used:
            del _imported_pools[name]
            with contextlib.suppress(Exception):  # best effort: its owner's memory goes either way at exit
                cu.cuMemPoolDestroy(pool)


def open_pointer(ordinal: int, export: CudaPoolExport) -> ImportedPointer:
    """Import ``export``'s block in this process (the pool once per process, the block once while
    any handle of it here holds the result).

    Args:
        ordinal: the owner's device ordinal (the same numbering in this process).
        export: what the owner exported.
    Returns:
        The import; the caller keeps it as long as it uses the address, and drops it before it
        gives its reference count back.
    Raises:
        DeviceUnavailable: the owner's fd server is gone (its process ended) or no longer offers
            the pool (its device rebuilt), or did not answer in :data:`FETCH_TIMEOUT_S`.
        DriverError: CUDA refused the import, or no GPU.
    Thread rule: any thread.
    """
    if export.owner_pid == os.getpid():
        return ImportedPointer(ordinal, 0)
    key = (export.server, export.key, export.data)
    with lock:
        imported = _pointers.get(key)
        if imported is not None:
            return imported
        found = _imported_pools.get(key[:2])
        if found is None:
            fd = fetch_fd(export.server, export.key, FETCH_TIMEOUT_S)
            try:
                make_current(ordinal)
                err, pool = cu.cuMemPoolImportFromShareableHandle(fd, _handle_type(), 0)
            finally:
                os.close(fd)  # the imported pool holds what it needs
            check(err, f"cuMemPoolImportFromShareableHandle (device {ordinal}, {export.key})")
            _drop_unused_pools(ordinal)
            _imported_pools[key[:2]] = (pool, ordinal)
        else:
            pool = found[0]
            make_current(ordinal)
        err, base = cu.cuMemPoolImportPointer(pool, struct_of(cu.CUmemPoolPtrExportData, export.data))
        check(err, f"cuMemPoolImportPointer (device {ordinal}, {export.key})")
        imported = ImportedPointer(ordinal, int(base))
        _pointers[key] = imported
        return imported
