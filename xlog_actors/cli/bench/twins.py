"""The raw twins rows share, and the raw CUDA calls they are made of.

Raw twins go as low as this machine allows: on the CUDA driver they call ``cuda.bindings.driver``
directly on the same ``CUstream`` handle, not through the driver's ``CudaDriver``; on the host
driver (which *is* the lowest layer there) they call ``HostDriver`` directly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ...driver.protocol import Driver, Stream
from .harness import Op
from .plan import SIZE

__all__ = [
    "HostBuffer",
    "PeerTwin",
    "alloc_free_loop",
    "check",
    "cu",
    "raise_unless_success",
    "stream_ordered_twin",
]


def alloc_free_loop(alloc: Callable[[int], Any], free: Callable[[Any], Any]) -> Op:
    """The operation of every allocator row: ``free(alloc(4 KiB))``, ``n`` times.

    Args:
        alloc: an allocate method taking a size (bound once, outside the timed loop).
        free: its free method.
    Returns:
        The timed operation.
    Thread rule: call the operation on the bench's thread.
    """

    def ours(n: int) -> None:
        for _ in range(n):
            free(alloc(SIZE))

    return ours


def cu() -> Any:
    """The ``cuda.bindings.driver`` module (imported on first use: CUDA runs only).

    Returns:
        The module.
    Raises:
        ImportError: cuda-python is not installed.
    Thread rule: any thread.
    """
    from cuda.bindings import driver

    return driver


def check(cu: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-bindings result tuple, raising on an error.

    Args:
        cu: the ``cuda.bindings.driver`` module.
        result: the tuple a call returned (its error first).
        what: the call's name, for the message.
    Returns:
        The call's value (or values).
    Raises:
        RuntimeError: the call failed; the message names it and its error.
    Thread rule: any thread.
    """
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else result[1:]


def raise_unless_success(cuda: Any, what: str, *errors: Any) -> None:
    """Raise when any of a raw twin's last results is an error (checked once per sample, after
    its loop, so the loop itself stays the bare calls).

    Args:
        cuda: the ``cuda.bindings.driver`` module.
        what: the raw calls, for the message.
        errors: the ``CUresult`` of each call's last run.
    Raises:
        RuntimeError: naming the calls and their results.
    Thread rule: any thread.
    """
    ok = cuda.CUresult.CUDA_SUCCESS
    for err in errors:
        if err != ok:
            raise RuntimeError(f"raw {what} failed: {' '.join(map(str, errors))}")


def stream_ordered_twin(driver: Driver, stream: Stream) -> tuple[Op, str]:
    """The raw twin of a stream-ordered 4 KiB allocate + free on ``stream``, and its name.

    Args:
        driver: the run's driver.
        stream: the stream both sides use.
    Returns:
        ``(op, name)``.
    Raises:
        RuntimeError: the raw calls fail (checked once up front, then after each batch).
    Thread rule: the bench's thread.
    """
    if driver.kind == "cuda":
        cuda = cu()
        h = cuda.CUstream(stream.handle)
        alloc, free = cuda.cuMemAllocAsync, cuda.cuMemFreeAsync
        check(cuda, free(check(cuda, alloc(SIZE, h), "cuMemAllocAsync"), h), "cuMemFreeAsync")

        def raw(n: int) -> None:
            for _ in range(n):
                err, ptr = alloc(SIZE, h)
                (err2,) = free(ptr, h)
            raise_unless_success(cuda, "cuMemAllocAsync/cuMemFreeAsync", err, err2)

        return raw, "raw cuMemAllocAsync+cuMemFreeAsync (cuda.bindings)"

    alloc_async, free_async = driver.alloc_async, driver.free_async

    def raw_host(n: int) -> None:
        for _ in range(n):
            free_async(alloc_async(SIZE, stream), stream)

    return raw_host, "HostDriver.alloc_async+free_async"


class HostBuffer:
    """Pinned (page-locked) host memory on CUDA (``cuMemHostAlloc``), plain memory on the host
    driver; ``array`` is a numpy view over it, filled with a repeating 0..255 pattern.

    Thread rule: the bench's thread; ``close`` once.
    """

    def __init__(self, cuda: bool, nbytes: int) -> None:
        """Allocate ``nbytes`` (a multiple of 256) and fill them.

        Args:
            cuda: pinned memory through the CUDA driver API, else plain numpy memory.
            nbytes: the size.
        Raises:
            RuntimeError: ``cuMemHostAlloc`` failed.
        """
        self.cuda = cuda
        self.nbytes = nbytes
        if cuda:
            cuda_mod = cu()
            self.ptr = int(check(cuda_mod, cuda_mod.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
            raw = (ctypes.c_uint8 * nbytes).from_address(self.ptr)
            self.array = np.ctypeslib.as_array(raw)
        else:
            self.array = np.empty(nbytes, dtype=np.uint8)
            self.ptr = int(self.array.ctypes.data)
        pattern = np.arange(256, dtype=np.uint8)
        self.array.reshape(-1, 256)[:] = pattern  # nbytes is a multiple of 256: MiB sizes

    def close(self) -> None:
        """Free the memory (the ``array`` view goes first)."""
        del self.array
        if self.cuda:
            cu().cuMemFreeHost(self.ptr)


class PeerTwin:
    """The raw twin of a peer copy: ``k`` copies of ``nbytes`` from ``src`` (device
    ``src_ordinal``) to ``dst`` (device ``dst_ordinal``) on ``stream``, then one synchronize.

    On CUDA it calls ``cuMemcpyPeerAsync`` with both devices' primary contexts (retained here, as
    any user of the driver API would, and released by ``close``) and ``cuStreamSynchronize`` on
    the same ``CUstream``; on the host driver ``copy_peer`` and ``synchronize``.

    Thread rule: the bench's thread; ``close`` once.
    """

    def __init__(
        self, driver: Driver, stream: Stream, dst: tuple[int, int], src: tuple[int, int], nbytes: int, k: int
    ) -> None:
        """Args:
            driver: the run's driver.
            stream: the stream the copies go on (of either device).
            dst: ``(ordinal, pointer)`` of the destination.
            src: ``(ordinal, pointer)`` of the source.
            nbytes: bytes per copy.
            k: copies per synchronize.
        Raises:
            RuntimeError: a context could not be retained.
        """
        self._retained: list[Any] = []
        (dst_ordinal, d_dst), (src_ordinal, d_src) = dst, src
        if driver.kind != "cuda":
            copy_peer = driver.copy_peer

            def via_driver(n: int) -> None:
                for _ in range(n):
                    for _ in range(k):
                        copy_peer(dst_ordinal, d_dst, src_ordinal, d_src, nbytes, stream)
                    stream.synchronize()

            self.op: Op = via_driver
            self.name = f"HostDriver.copy_peer x{k} + synchronize"
            return
        cuda = cu()
        contexts = []
        for ordinal in (dst_ordinal, src_ordinal):
            dev = check(cuda, cuda.cuDeviceGet(ordinal), "cuDeviceGet")
            contexts.append(check(cuda, cuda.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain"))
            self._retained.append(dev)
        dst_ctx, src_ctx = contexts
        h = cuda.CUstream(stream.handle)
        memcpy, stream_sync = cuda.cuMemcpyPeerAsync, cuda.cuStreamSynchronize
        make_current, ordinal = driver.make_current, stream.ordinal

        def raw(n: int) -> None:
            # The stream's context must be current, and setting up two devices may have left the
            # other one current in this thread; through the driver, which keeps its cache right.
            make_current(ordinal)
            for _ in range(n):
                for _ in range(k):
                    (err,) = memcpy(d_dst, dst_ctx, d_src, src_ctx, nbytes, h)
                (err2,) = stream_sync(h)
            raise_unless_success(cuda, "cuMemcpyPeerAsync/cuStreamSynchronize", err, err2)

        self.op = raw
        self.name = f"raw cuMemcpyPeerAsync x{k} + cuStreamSynchronize"

    def close(self) -> None:
        """Release the contexts retained for the twin."""
        if self._retained:
            cuda = cu()
            for dev in self._retained:
                cuda.cuDevicePrimaryCtxRelease(dev)
            self._retained.clear()
