"""Memory: synchronous and pool allocation, copies and fills, and the live sets.

* ``alloc``/``free`` are the raw synchronous ``cuMemAlloc``/``cuMemFree`` (the sanitizer
  backend). Each device keeps the pointers they handed out in its live set (``direct_live``),
  which a rebuild or close frees; a ``free`` claims its pointer from that set first, so it and a
  rebuild's sweep never both free it. A synchronous ``alloc`` racing a rebuild is the caller's
  race to avoid (it may leak that block).
* ``alloc_async``/``free_async`` are stream-ordered on the device's default memory pool, whose
  release threshold keeps freed memory cached (set up by the device on every retain). The
  allocation names that pool explicitly (``cuMemAllocFromPoolAsync``): the same as
  ``cuMemAllocAsync`` while the device's current pool is the default one, and still right if
  another library in the process switches the device's current pool. Live pool blocks are kept in
  ``pool_live``: even a primary-context reset does not free them.
* **Host buffers of async copies.** ``copy_to_device`` does not copy its source: from pageable
  memory ``cuMemcpyHtoDAsync`` returns once the bytes are staged (the caller may reuse its buffer
  at once), from page-locked memory it is truly asynchronous and the caller leaves the bytes alone
  until the copy ran, as with ``cudaMemcpyAsync``. Either way the stream keeps the buffer
  referenced until the copy ran. Device-to-host copies into pageable memory may return only once
  the copy ran (CUDA's documented behaviour); pass a pinned buffer to ``copy_to_host_into`` for a
  truly asynchronous copy.

Thread rule: every method may be called from any thread. None takes a device lock: each holds
only the stream's gate around its liveness check and its CUDA call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ...errors import DriverError, InvalidRequest
from ..checks import check_nbytes, writable_bytes
from ..protocol import Buffer
from .call import SUCCESS, cu
from .current import tls
from .gates import check_ptr
from .held import as_result
from .host_memory import CudaHostMemory
from .streams import CudaStream

__all__ = ["CudaMemory"]


def _address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (``buf`` must stay referenced)."""
    try:
        # A writable buffer: 0.3 us, against 2 us through numpy's ctypes attribute (every copy
        # between host and device takes this path).
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only or empty
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class CudaMemory(CudaHostMemory):
    """The memory half of :class:`~xlog_actors.driver.cuda.CudaDriver`: allocation, copies and
    fills (pinned host memory: its base, :class:`~.host_memory.CudaHostMemory`). Pointers are
    plain ints (device virtual addresses).

    Every method taking a stream raises ``InvalidRequest`` when it is no ``CudaStream`` of this
    driver, ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) when it was closed or its context
    rebuilt, and ``ContextPoisoned`` once the device saw a sticky error; each holds only the
    stream's gate around its CUDA call.

    Thread rule: any thread (see the module docstring).
    """

    # -- synchronous allocation -------------------------------------------------------------
    def alloc(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` with ``cuMemAlloc`` on device ``ordinal`` and add the pointer to the
        device's live set.

        Arguments and result: as ``Driver.alloc``.
        Raises:
            InvalidRequest: bad ``ordinal`` or ``nbytes``.
            OutOfMemory: the device cannot give ``nbytes``.
            DriverError: the driver is closed.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; a call racing ``rebuild_context`` may leak its block.
        """
        nbytes = check_nbytes(nbytes)
        dev = self._device(ordinal)
        dev.enter()
        err, ptr = cu.cuMemAlloc(nbytes)
        if err != SUCCESS:
            dev.fail(err, f"cuMemAlloc({nbytes} bytes)", nbytes)
        dev.direct_live.add(int(ptr))
        return int(ptr)

    def free(self, ordinal: int, ptr: int) -> None:
        """Free an ``alloc`` pointer with ``cuMemFree`` (device-synchronizing, as CUDA's is).

        Arguments and result: as ``Driver.free``.
        Raises:
            InvalidRequest: bad ``ordinal``.
            DriverError: ``ptr`` is no live ``alloc`` pointer of this driver (``CUDA_ERROR_INVALID_VALUE``),
                or the driver is closed.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; it claims ``ptr`` from the live set first, so of two racing frees
        (or a free and a rebuild) exactly one frees it.
        """
        dev = self._device(ordinal)
        check_ptr(ptr, f"device {ordinal}: free")
        dev.enter()
        # Claim the pointer first (set.remove is atomic): of a free racing a rebuild's sweep, or
        # a second free, exactly one reaches cuMemFree. A pointer this driver did not allocate
        # (or already freed) is refused: cuMemFree would free whatever lives there now.
        try:
            dev.direct_live.remove(ptr)
        except KeyError:
            raise DriverError(
                f"device {ordinal}: free of {ptr:#x}, which is not a live cuMemAlloc allocation of this driver",
                code="CUDA_ERROR_INVALID_VALUE",
            ) from None
        (err,) = cu.cuMemFree(ptr)
        if err != SUCCESS:
            dev.fail(err, f"cuMemFree({ptr:#x})")

    # -- stream-ordered allocation ----------------------------------------------------------
    def alloc_async(self, nbytes: int, stream: CudaStream) -> int:
        """Allocate ``nbytes`` from the device's default pool, ordered on ``stream``
        (``cuMemAllocFromPoolAsync``), and add the pointer to the pool's live set.

        Arguments and result: as ``Driver.alloc_async``.
        Raises:
            InvalidRequest: a bad ``nbytes``.
            OutOfMemory: the pool cannot give ``nbytes``.
            DriverError: the device has no pools (``CUDA_ERROR_NOT_SUPPORTED``).
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        s = stream if type(stream) is CudaStream else self._stream(stream)
        # Inlined for speed, as in free_async: this is the hottest path (a Python call costs
        # about 0.15 us here), so the stream-work preamble (CudaGates._stream_work) and the context
        # check (CudaStream._enter) are written out in one expression, and the gate is taken with
        # acquire/release, which is cheaper than ``with``.
        gate = s._gate
        gate.acquire()
        try:
            dev = s._dev
            token = dev.token
            if not (dev.owner is self and s._epoch == dev.epoch and s._closed is None and dev.poisoned is None
                    and token is not None and getattr(tls, "token", None) is token):
                dev = self._stream(s)._enter()  # the precise error, or a context to make current
            pool = dev.pool
            if pool is None:
                raise DriverError(
                    f"device {dev.ordinal} does not support stream-ordered memory pools",
                    code="CUDA_ERROR_NOT_SUPPORTED",
                )
            err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, pool, s._cu)
        finally:
            gate.release()
        if err != SUCCESS:
            dev.fail(err, f"cuMemAllocFromPoolAsync({nbytes} bytes, stream {s._id})", nbytes)
        ptr = int(ptr)
        dev.pool_live.add(ptr)
        return ptr

    def free_async(self, ptr: int, stream: CudaStream) -> None:
        """Give ``ptr`` back to the pool once the work enqueued on ``stream`` so far ran
        (``cuMemFreeAsync``).

        Arguments and result: as ``Driver.free_async``.
        Raises:
            DriverError: ``ptr`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        s = stream if type(stream) is CudaStream else self._stream(stream)
        if type(ptr) is not int or ptr <= 0:
            check_ptr(ptr, f"device {s.ordinal}: stream-ordered free")
        # Inlined for speed, as in alloc_async (see there). ``_dev`` is fixed at construction:
        # reading it before the gate is the same as reading it inside.
        gate = s._gate
        dev = s._dev
        gate.acquire()
        try:
            token = dev.token
            if not (dev.owner is self and s._epoch == dev.epoch and s._closed is None and dev.poisoned is None
                    and token is not None and getattr(tls, "token", None) is token):
                dev = self._stream(s)._enter()
            (err,) = cu.cuMemFreeAsync(ptr, s._cu)
        finally:
            gate.release()
        if err != SUCCESS:
            dev.fail(err, f"cuMemFreeAsync({ptr:#x}, stream {s._id})")
        dev.pool_live.discard(ptr)

    # -- copies and work --------------------------------------------------------------------
    def copy_to_device(self, ptr: int, data: Buffer, stream: CudaStream) -> None:
        """Enqueue ``cuMemcpyHtoDAsync`` of ``data`` to ``ptr``; the stream keeps ``data``
        referenced until the copy ran.

        Arguments and result: as ``Driver.copy_to_device``.
        Raises:
            DriverError: ``ptr`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        # No snapshot: from pageable memory cuMemcpyHtoDAsync returns only once the bytes are
        # staged, so the caller may reuse its buffer at once; from page-locked memory the copy is
        # truly asynchronous and, as with cudaMemcpyAsync, the caller leaves the bytes alone until
        # the copy ran. Either way the buffer stays referenced until then.
        view = memoryview(data).cast("B")
        s = self._stream_work(stream, (ptr, "copy to device"))
        self._copy_host(s, ptr, view, (view, data), to_device=True)

    def copy_to_host(self, ptr: int, nbytes: int, stream: CudaStream) -> bytearray:
        """Enqueue ``cuMemcpyDtoHAsync`` of ``nbytes`` from ``ptr`` into a new buffer.

        Arguments and result: as ``Driver.copy_to_host``.
        Raises:
            InvalidRequest: a bad ``nbytes``.
            DriverError: ``ptr`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "copy size")
        out = bytearray(nbytes)
        self.copy_to_host_into(ptr, out, stream)
        return out

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: CudaStream) -> None:
        """Enqueue ``cuMemcpyDtoHAsync`` from ``ptr`` into ``out``; the stream keeps ``out``
        referenced until the copy ran. Pageable memory may make the call wait for the copy (CUDA's
        behaviour); pinned memory makes it truly asynchronous.

        Arguments and result: as ``Driver.copy_to_host_into``.
        Raises:
            InvalidRequest: ``out`` is read-only.
            DriverError: ``ptr`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        target = writable_bytes(out)
        s = self._stream_work(stream, (ptr, "copy to host"))
        # The view pins the buffer (a bytearray cannot be resized under it) until the copy ran.
        self._copy_host(s, ptr, target, target, to_device=False)

    def _copy_host(self, s: CudaStream, ptr: int, host: memoryview, keep: object, *, to_device: bool) -> None:
        """Enqueue a copy between device ``ptr`` and the byte view ``host`` on ``s`` (resolved and
        checked), and keep ``keep`` referenced by the stream until the copy ran."""
        nbytes = len(host)
        address = _address(host)
        # Page-locked host memory makes the copy a pure enqueue: the GIL is kept (see .held).
        # From pageable memory CUDA stages the bytes before it returns: the GIL must go.
        pinned = self._is_pinned(address, nbytes)
        with s._gate:
            dev = s._enter()
            if nbytes == 0:
                return
            if to_device:
                if pinned:
                    err = as_result(dev.held.memcpy_htod(ptr, address, nbytes, s._handle))
                else:
                    (err,) = cu.cuMemcpyHtoDAsync(ptr, address, nbytes, s._cu)
                if err != SUCCESS:
                    dev.fail(err, f"cuMemcpyHtoDAsync({nbytes} bytes to {ptr:#x}, stream {s._id})")
            else:
                if pinned:
                    err = as_result(dev.held.memcpy_dtoh(address, ptr, nbytes, s._handle))
                else:
                    (err,) = cu.cuMemcpyDtoHAsync(address, ptr, nbytes, s._cu)
                if err != SUCCESS:
                    dev.fail(err, f"cuMemcpyDtoHAsync({nbytes} bytes from {ptr:#x}, stream {s._id})")
            s._keep_until_done(keep)

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: CudaStream) -> None:
        """Enqueue ``cuMemcpyDtoDAsync`` of ``nbytes`` from ``src`` to ``dst``.

        Arguments and result: as ``Driver.copy_device_to_device``.
        Raises:
            InvalidRequest: a bad ``nbytes``.
            DriverError: ``dst`` or ``src`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "copy size")
        s = self._stream_work(
            stream, (dst, "device-to-device copy destination"), (src, "device-to-device copy source")
        )
        with s._gate:
            dev = s._enter()
            # Device to device only enqueues: the GIL is kept (see .held).
            err = as_result(dev.held.memcpy_dtod(dst, src, nbytes, s._handle))
        if err != SUCCESS:
            dev.fail(err, f"cuMemcpyDtoDAsync({nbytes} bytes {src:#x} -> {dst:#x}, stream {s._id})")

    def fill(self, ptr: int, byte: int, nbytes: int, stream: CudaStream) -> None:
        """Enqueue ``cuMemsetD8Async``: ``nbytes`` at ``ptr`` set to ``byte``.

        Arguments and result: as ``Driver.fill``.
        Raises:
            InvalidRequest: ``byte`` out of range, or bad ``nbytes``.
            DriverError: ``ptr`` is no device pointer.
            ContextPoisoned, and the stream's errors: see the class docstring.
        Thread rule: any thread.
        """
        if type(byte) is not int or not 0 <= byte <= 255:
            raise InvalidRequest(f"fill byte must be an int in 0..255, got {byte!r}")
        nbytes = check_nbytes(nbytes, "fill size")
        s = self._stream_work(stream, (ptr, "fill"))
        with s._gate:
            dev = s._enter()
            err = as_result(dev.held.memset_d8(ptr, byte, nbytes, s._handle))  # only enqueues: see .held
        if err != SUCCESS:
            dev.fail(err, f"cuMemsetD8Async({nbytes} bytes at {ptr:#x}, stream {s._id})")

