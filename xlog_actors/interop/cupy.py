"""CuPy allocates through a device: ``use_device(device)`` installs, with
``cupy.cuda.set_allocator``, a function that returns a ``cupy.cuda.MemoryPointer`` over an
``UnownedMemory`` whose owner holds the block's ``GpuRef`` (through a
:class:`DeviceAllocator`). Every array's memory is a block of the device, counted under the tag
(``"cupy"`` by default) in its budget, statistics, report and history; when the array's memory
is dropped, the block is freed after the work queued on CuPy's stream of the allocation.

A refusal raises the device's own error in CuPy's call (``OutOfMemory``/``BudgetExceeded``, a
``MemoryError`` like CuPy's ``OutOfMemoryError``, with the report in its message).
``restore()`` (or leaving the ``with`` block) puts CuPy's previous allocator back; arrays made
meanwhile stay valid, and their blocks are freed when they go.

Thread rule: ``use_device`` and ``restore`` from any thread but a device actor's; CuPy's
allocator is process-wide (``set_allocator``), so the route serves every thread.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, final

from ..errors import InvalidRequest
from .allocator import DeviceAllocator, as_client, driver_kind

__all__ = ["CupyRoute", "use_device"]

logger = logging.getLogger("xlog_actors.interop")


class _Lease:
    """The owner CuPy's ``UnownedMemory`` keeps: frees the block when CuPy drops it."""

    __slots__ = ("allocator", "nbytes", "ptr", "stream")

    def __init__(self, allocator: DeviceAllocator, ptr: int, nbytes: int, stream: int) -> None:
        self.allocator = allocator
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream = stream

    def __del__(self) -> None:
        try:
            self.allocator.free(self.ptr, self.nbytes, self.stream)
        except Exception as exc:  # noqa: BLE001 - a finalizer cannot raise: logged
            logger.error("device %d: freeing a cupy block at %#x failed: %r", self.allocator.device_id, self.ptr, exc)


@final
class CupyRoute:
    """CuPy's allocations routed through one device until :meth:`restore`; a context manager.

    Thread rule: any thread but the device actor's own.
    """

    def __init__(self, allocator: DeviceAllocator, previous: Any) -> None:
        """Args:
            allocator: the device allocator the route uses.
            previous: CuPy's allocator before the route (put back by :meth:`restore`).
        Thread rule: any thread.
        """
        self.allocator = allocator
        self._previous = previous
        self._restored = False

    def malloc(self, nbytes: int) -> Any:
        """CuPy's allocator function: ``nbytes`` on the device, for CuPy's current stream.

        Returns:
            a ``cupy.cuda.MemoryPointer`` whose memory's owner frees the block.
        Raises:
            OutOfMemory, BudgetExceeded: the device refused (with its report).
            InvalidRequest: the route was restored.
        Thread rule: any thread but the device actor's own.
        """
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
        size = max(int(nbytes), 1)  # CuPy asks 0 bytes for an empty array; the device wants >= 1
        ptr = self.allocator.allocate(size, stream)
        memory = cupy.cuda.UnownedMemory(ptr, size, _Lease(self.allocator, ptr, size, stream), self.allocator.device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    def restore(self) -> None:
        """Put CuPy's previous allocator back (if this route is still CuPy's) and refuse later
        allocations through the route. Idempotent.

        Thread rule: any thread but the device actor's own.
        """
        if self._restored:
            return
        import cupy

        self._restored = True
        if getattr(cupy.cuda.get_allocator(), "__self__", None) is self:
            cupy.cuda.set_allocator(self._previous)
        self.allocator.close()

    def __enter__(self) -> CupyRoute:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"CupyRoute({self.allocator!r}{', restored' if self._restored else ''})"


def use_device(ref_or_client: Any, tag: str = "cupy") -> CupyRoute:
    """Route CuPy's allocations through the device until the route's ``restore()``.

    Args:
        ref_or_client: a ``DeviceActor``'s ref or its ``DeviceClient``, on the CUDA driver.
        tag: the tag CuPy's blocks are counted under.
    Returns:
        the route (a context manager).
    Raises:
        ImportError: CuPy is not installed.
        InvalidRequest: the device is not on the CUDA driver, or ``tag`` is bad; nothing changed.
    Thread rule: any thread but the device actor's own.
    """
    import cupy

    client = as_client(ref_or_client)
    kind = driver_kind(client)
    if kind != "cuda":
        raise InvalidRequest(f"device {client.device_id}: CuPy can allocate only on the CUDA driver, not on {kind}")
    route = CupyRoute(DeviceAllocator(client, tag), cupy.cuda.get_allocator())
    cupy.cuda.set_allocator(route.malloc)
    return route
