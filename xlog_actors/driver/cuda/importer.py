"""What every CUDA IPC import needs, in a process that has no ``CudaDriver`` of its own: the
device's primary context, and the 64-byte handles copied in and out of the bindings' structs.

Shared by the legacy IPC path (:mod:`.ipc`) and the IPC-capable pool (:mod:`.pool_ipc`).

Invariants: the primary context of an ordinal is retained at most once per process, and never
released (an importer's mappings live in it until the process ends or they are closed); a handle
is exactly :data:`HANDLE_BYTES` bytes; a mapping (:class:`ImportedMapping`) is released once, when
its last user drops it, and never in the owner's own process. A cross-process copy keeps its
source's handle (and so its mapping) open after the copy, in a bounded LRU of the importing
process (:mod:`xlog_actors.actors.import_cache`, which states the rule): the handle's count keeps
the owner from freeing the memory while the mapping stays open.

Thread rule: any thread. :data:`lock` guards the tables of opened mappings of both IPC modules
(an open maps at most once per process); the retain table has a lock of its own, because an
open holding :data:`lock` retains the context (one lock for both deadlocked the first open of a
process that had not waited for an event before).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Final

from .call import check, cu
from .current import set_thread_token

__all__ = ["HANDLE_BYTES", "ImportedMapping", "bytes_of", "lock", "make_current", "struct_of"]

#: The size of a CUDA IPC memory or event handle, and of a pool pointer's export data.
HANDLE_BYTES: Final = 64
#: Guards the importers' tables (see the module docstring).
lock = threading.Lock()
_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def bytes_of(struct: Any) -> bytes:
    """The :data:`HANDLE_BYTES` bytes of a bindings handle struct. Thread rule: any thread."""
    return ctypes.string_at(struct.getPtr(), HANDLE_BYTES)


def struct_of(kind: Any, data: bytes) -> Any:
    """A new bindings struct of type ``kind`` holding ``data``. Thread rule: any thread.

    Raises:
        InvalidRequest: ``data`` is not :data:`HANDLE_BYTES` bytes long.
    """
    if not isinstance(data, bytes) or len(data) != HANDLE_BYTES:
        from ...errors import InvalidRequest

        raise InvalidRequest(f"a CUDA IPC handle is {HANDLE_BYTES} bytes, not {data!r:.40}")
    struct = kind()
    ctypes.memmove(struct.getPtr(), data, HANDLE_BYTES)
    return struct


def make_current(ordinal: int) -> None:
    """Make ``ordinal``'s primary context current on the calling thread, retaining it once per
    process. The thread's mark of our current context is cleared (:mod:`.current`).

    Raises:
        DriverError: ``cuInit``, ``cuDeviceGet`` or the retain failed (no GPU, a bad ordinal).
    Thread rule: any thread; acts on the calling thread.
    """
    ctx = _contexts.get(ordinal)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(ordinal)
            if ctx is None:
                (err,) = cu.cuInit(0)
                check(err, "cuInit")
                err, dev = cu.cuDeviceGet(ordinal)
                check(err, f"cuDeviceGet({ordinal})")
                err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
                check(err, f"cuDevicePrimaryCtxRetain({ordinal})")
                _contexts[ordinal] = ctx
    # No context of ours is known current here any more: the next call of a CudaDriver in this
    # thread makes its own current again instead of trusting the one this replaced.
    set_thread_token(None)
    (err,) = cu.cuCtxSetCurrent(ctx)
    check(err, f"cuCtxSetCurrent (device {ordinal})")


class ImportedMapping:
    """One process's mapping of another process's device memory, shared by the handles of its
    blocks (the importers' tables hold it weakly) and released when the last one drops it:
    :class:`.ipc.OpenedMemory` (legacy IPC) and :class:`.pool_ipc.ImportedPointer` (a pool
    block) say how. ``base`` is its address here; 0 in the owner's own process, where the owner's
    address needs no mapping and nothing is released.

    Thread rule: any thread.
    """

    __slots__ = ("__weakref__", "_ordinal", "base")

    def __init__(self, ordinal: int, base: int) -> None:
        """A mapping of device ``ordinal``'s memory at ``base`` (0: in the owner's process)."""
        self._ordinal = ordinal
        self.base = base

    def _release(self, base: int) -> None:
        """Give the mapping at ``base`` back to CUDA (the device's context is current)."""
        raise NotImplementedError

    def __del__(self) -> None:
        if self.base == 0:
            return
        try:
            make_current(self._ordinal)
            self._release(self.base)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone with the process
            return
