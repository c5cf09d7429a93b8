"""Pinned host memory of the CUDA driver: ``cuMemHostAlloc`` (portable) and ``cuMemFreeHost``.

* **Owner and lifetime.** Pinned memory is allocated in a device's primary context with
  ``CU_MEMHOSTALLOC_PORTABLE``, so every context of the process may copy to and from it. The
  driver keeps every live allocation in one table (address -> device ordinal, size). A context
  rebuild keeps the primary context, so it leaves pinned memory alone: what a caller still holds
  stays valid across rebuilds. ``free_pinned_leftovers`` (the driver's close) frees what is left.
  A reset of the primary context from outside frees it behind the driver's back, as it frees
  ``cuMemAlloc`` memory; a view used after that touches unmapped memory.
* **Frees from any thread.** ``free_pinned`` is called by finalizers, on whatever thread drops the
  last reference (a stream pruning its finished copies inside its gate, the garbage collector).
  So it takes no lock of the driver's and does not touch the thread-local current-context cache:
  it pushes the device's context for the one call and pops it again. A free claims its pointer
  from the table first (one atomic ``dict.pop``), so of two racing frees exactly one reaches CUDA.

Thread rule: every method may be called from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

from ...errors import DriverError, OutOfMemory
from ..checks import check_nbytes
from .call import SUCCESS, cu, result_name
from .gates import CudaGates

__all__ = ["CudaHostMemory"]


class CudaHostMemory(CudaGates):
    """The pinned-memory part of :class:`~xlog_actors.driver.cuda.CudaDriver`.

    Invariant: the table holds exactly the pointers ``cuMemHostAlloc`` gave this driver that no
    free has claimed yet.

    Thread rule: any thread (see the module docstring).
    """

    def _pinned_table(self) -> dict[int, tuple[int, int]]:
        """address -> (ordinal, size) of the live pinned allocations, made on first use
        (``dict.setdefault`` is atomic, so racing first uses share one table)."""
        table: dict[int, tuple[int, int]] | None = self.__dict__.get("_pinned_live")
        if table is None:
            table = self.__dict__.setdefault("_pinned_live", {})
        return table

    def _is_pinned(self, address: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``address`` lie inside one live pinned allocation of this driver.

        An address met before is looked up in ``_pinned_hits`` (address -> the base it lay in)
        and checked against the live table in one step (a freed base is gone from the table,
        so a stale hit only sends the look-up to the scan); a new address scans the table (a
        program holds a few dozen pinned buffers: the demo's copies met a 30-entry scan twice
        a batch)."""
        table = self._pinned_table()
        hits: dict[int, int] | None = self.__dict__.get("_pinned_hits")
        if hits is None:
            hits = self.__dict__.setdefault("_pinned_hits", {})
        base = hits.get(address)
        if base is not None:
            entry = table.get(base)
            if entry is not None and address + nbytes <= base + entry[1]:
                return True
        for base, (_ordinal, size) in list(table.items()):
            if base <= address and address + nbytes <= base + size:
                if len(hits) >= 4096:  # bounded: a program copying from ever new addresses
                    hits.clear()
                hits[address] = base
                return True
        return False

    def alloc_pinned(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` of portable page-locked host memory (``cuMemHostAlloc``) with
        device ``ordinal``'s context.

        Arguments and result: as ``Driver.alloc_pinned``.
        Raises:
            InvalidRequest: bad ``ordinal`` or ``nbytes``.
            OutOfMemory: the host cannot lock ``nbytes`` more bytes.
            DriverError: the driver is closed.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned allocation size")
        dev = self._device(ordinal)
        dev.enter()
        err, ptr = cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE)
        if err != SUCCESS:
            what = f"cuMemHostAlloc({nbytes} bytes, portable)"
            if result_name(err) == "CUDA_ERROR_INVALID_VALUE":
                # The size was checked above: CUDA refusing a positive size is the host unable
                # to map and lock that much.
                raise OutOfMemory(
                    f"device {ordinal}: {what} failed: CUDA_ERROR_INVALID_VALUE (the host cannot lock that much)",
                    requested=nbytes,
                )
            dev.fail(err, what, nbytes)
        ptr = int(ptr)
        self._pinned_table()[ptr] = (ordinal, nbytes)
        return ptr

    def free_pinned(self, ordinal: int, ptr: int) -> None:
        """Free an ``alloc_pinned`` pointer with ``cuMemFreeHost``, the device's context pushed for
        the call only.

        Arguments and result: as ``Driver.free_pinned``.
        Raises:
            InvalidRequest: bad ``ordinal``.
            DriverError: ``ptr`` is no live pinned allocation of device ``ordinal`` (nothing is
                freed), the driver is closed, or CUDA refused the free.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread, finalizers included (see the module docstring).
        """
        dev = self._device(ordinal)
        table = self._pinned_table()
        entry = table.get(ptr) if type(ptr) is int else None
        if entry is None or entry[0] != ordinal or table.pop(ptr, None) is None:
            owner = "" if entry is None else f" (it is device {entry[0]}'s)"
            raise DriverError(
                f"device {ordinal}: free of pinned {ptr!r}, which is not a live cuMemHostAlloc allocation of "
                f"this driver and device{owner}",
                code="CUDA_ERROR_INVALID_VALUE",
            )
        ctx = dev.ctx
        if ctx is None:
            return  # the context went (a reset from outside): the memory went with it
        (err,) = cu.cuCtxPushCurrent(ctx)
        if err != SUCCESS:
            table[ptr] = entry  # nothing was freed: the pointer stays live
            dev.fail(err, f"cuCtxPushCurrent for cuMemFreeHost({ptr:#x})")
        try:
            (err,) = cu.cuMemFreeHost(ptr)
        finally:
            cu.cuCtxPopCurrent()
        if err != SUCCESS:
            dev.fail(err, f"cuMemFreeHost({ptr:#x})")

    def pinned_view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of the first ``nbytes`` of a live pinned allocation (through
        ``ctypes``; it does not keep the allocation alive).

        Arguments and result: as ``Driver.pinned_view``.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            DriverError: ``ptr`` is no live pinned allocation, or ``nbytes`` exceeds it.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "pinned view size")
        entry = self._pinned_table().get(ptr) if type(ptr) is int else None
        if entry is None or nbytes > entry[1]:
            what = "is not a live pinned allocation" if entry is None else f"holds {entry[1]} bytes"
            raise DriverError(
                f"pinned view of {nbytes} bytes at {ptr!r}: it {what}", code="CUDA_ERROR_INVALID_VALUE"
            )
        return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")

    def free_pinned_leftovers(self) -> None:
        """Free every pinned allocation still live (the driver closes). Call it before the devices
        release their contexts: a context destroyed first takes its pinned memory with it, behind
        the table's back. Each device's context is synchronized first, so no copy still in flight
        writes into memory freed here. Best effort: a call CUDA refuses is skipped.

        Thread rule: any thread; a view used after this touches freed memory.
        """
        table = self._pinned_table()
        if not table:
            return
        for dev in self._devices:
            if dev.ctx is not None:
                self._in_context(dev.ctx, cu.cuCtxSynchronize)
        while table:
            try:
                ptr, (ordinal, _nbytes) = table.popitem()
            except KeyError:
                break  # a racing free took the last one
            ctx = self._devices[ordinal].ctx
            if ctx is not None:
                self._in_context(ctx, cu.cuMemFreeHost, ptr)

    @staticmethod
    def _in_context(ctx: object, call: Callable[..., object], *args: object) -> None:
        """``call(*args)`` with ``ctx`` pushed on the calling thread, ignoring failures (close is
        best effort)."""
        with contextlib.suppress(Exception):
            (err,) = cu.cuCtxPushCurrent(ctx)
            if err != SUCCESS:
                return
            try:
                call(*args)
            finally:
                cu.cuCtxPopCurrent()
