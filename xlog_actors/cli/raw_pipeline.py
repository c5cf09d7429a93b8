"""The demo's job written raw, with no actors: the yardstick the demo and its bench row compare with.

Three streams, one per stage: copy in (host to device), ``SCALE_ADD_F32``, copy out (device to
host), over a ring of ``depth`` device buffer pairs, ordered by events only: a stage waits for the
stage before it of the same batch and for the last reader of the buffer it overwrites. No stream is
synchronized until the last batch. Host buffers are pinned (``cuMemHostAlloc``), the copies are
``cuMemcpyHtoDAsync``/``cuMemcpyDtoHAsync`` and the events ``cuEventRecord``/``cuStreamWaitEvent``
on the CUDA driver; the kernel goes through ``Driver.launch`` (``cuLaunchKernel``). On the host
driver, which is the lowest layer there, the same calls are ``HostDriver``'s.

Verification, after the timed part: the last batch of every ring slot by checksum, the very last
byte for byte.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..driver.kernel_library import SCALE_ADD_F32, checksum_u32, launch_shape
from ..driver.protocol import Driver
from .batches import ALPHA, BETA, BatchData

__all__ = ["RawResult", "raw_pipeline"]


@dataclass(frozen=True)
class RawResult:
    """One raw run: its shape and the seconds from the first enqueue to the last byte home.

    Thread rule: immutable; any thread.
    """

    batches: int
    batch_bytes: int
    seconds: float

    @property
    def throughput_bytes_s(self) -> float:
        """Input bytes through the whole pipeline per second."""
        return self.batches * self.batch_bytes / self.seconds if self.seconds > 0 else 0.0


class _Stages:
    """The three stages' calls and events of one run: the part that differs between drivers."""

    def __init__(self, driver: Driver, depth: int, nbytes: int) -> None:
        self.driver, self.depth, self.nbytes = driver, depth, nbytes
        self.streams = [driver.create_stream(0) for _ in range(3)]
        self.d_in = [driver.alloc(0, nbytes) for _ in range(depth)]
        self.d_out = [driver.alloc(0, nbytes) for _ in range(depth)]
        self.grid, self.block = launch_shape(nbytes // 4)
        self.host_out: list[np.ndarray] = []

    def h2d(self, slot: int, src: np.ndarray) -> None:
        raise NotImplementedError

    def kernel(self, slot: int) -> None:
        n = self.nbytes // 4
        self.driver.launch(SCALE_ADD_F32, self.grid, self.block, [self.d_out[slot], self.d_in[slot], ALPHA, BETA, n],
                           self.streams[1])

    def d2h(self, slot: int) -> None:
        raise NotImplementedError

    def record(self, stage: int, slot: int) -> None:
        """Record stage ``stage``'s event of ``slot`` on that stage's stream."""
        raise NotImplementedError

    def wait(self, stage: int, on: int, slot: int) -> None:
        """Make stage ``stage``'s stream wait for stage ``on``'s last event of ``slot``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for everything enqueued (the end of the timed part)."""
        for s in self.streams:
            s.synchronize()

    def close(self) -> None:
        for s in self.streams:
            s.synchronize()
        for ptr in self.d_in + self.d_out:
            self.driver.free(0, ptr)
        for s in self.streams:
            s.close()


class _HostStages(_Stages):
    """Through ``Driver`` calls: the host driver's lowest layer."""

    def __init__(self, driver: Driver, depth: int, nbytes: int) -> None:
        super().__init__(driver, depth, nbytes)
        self.host_out = [np.empty(nbytes, np.uint8) for _ in range(depth)]
        self.events = [[driver.create_event(0) for _ in range(depth)] for _ in range(3)]

    def h2d(self, slot: int, src: np.ndarray) -> None:
        self.driver.copy_to_device(self.d_in[slot], src, self.streams[0])

    def d2h(self, slot: int) -> None:
        self.driver.copy_to_host_into(self.d_out[slot], self.host_out[slot], self.streams[2])

    def record(self, stage: int, slot: int) -> None:
        self.streams[stage].record(self.events[stage][slot])

    def wait(self, stage: int, on: int, slot: int) -> None:
        self.streams[stage].wait(self.events[on][slot])


_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING, as the CUDA driver creates its events


class _CudaStages(_Stages):
    """Raw ``cuda.bindings`` copies and events on the driver's streams, pinned host buffers."""

    def __init__(self, driver: Driver, depth: int, nbytes: int, inputs: list[np.ndarray]) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        driver.make_current(0)
        super().__init__(driver, depth, nbytes)
        self.pinned: list[int] = []
        self.handles = [cu.CUstream(s.handle) for s in self.streams]
        self.events = [[self._event() for _ in range(depth)] for _ in range(3)]
        self.host_in = [self._pinned_copy(a) for a in inputs]
        self.host_out = [self._pinned(nbytes) for _ in range(depth)]
        self.src_ptr = {id(a): int(p.ctypes.data) for a, p in zip(inputs, self.host_in, strict=True)}

    def _ok(self, result: tuple[Any, ...], what: str) -> Any:
        if result[0] != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"raw pipeline: {what} failed: {getattr(result[0], 'name', result[0])}")
        return result[1] if len(result) > 1 else None

    def _event(self) -> Any:
        return self._ok(self.cu.cuEventCreate(_EVENT_DISABLE_TIMING), "cuEventCreate")

    def _pinned(self, nbytes: int) -> np.ndarray:
        ptr = int(self._ok(self.cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        self.pinned.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def _pinned_copy(self, src: np.ndarray) -> np.ndarray:
        dst = self._pinned(src.nbytes)
        dst[:] = src.view(np.uint8)
        return dst

    def h2d(self, slot: int, src: np.ndarray) -> None:
        self._ok(self.cu.cuMemcpyHtoDAsync(self.d_in[slot], self.src_ptr[id(src)], self.nbytes, self.handles[0]),
                 "cuMemcpyHtoDAsync")

    def d2h(self, slot: int) -> None:
        dst = int(self.host_out[slot].ctypes.data)
        self._ok(self.cu.cuMemcpyDtoHAsync(dst, self.d_out[slot], self.nbytes, self.handles[2]), "cuMemcpyDtoHAsync")

    def record(self, stage: int, slot: int) -> None:
        self._ok(self.cu.cuEventRecord(self.events[stage][slot], self.handles[stage]), "cuEventRecord")

    def wait(self, stage: int, on: int, slot: int) -> None:
        self._ok(self.cu.cuStreamWaitEvent(self.handles[stage], self.events[on][slot], 0), "cuStreamWaitEvent")

    def close(self) -> None:
        super().close()  # synchronizes every stream first: nothing uses the buffers below after
        for row in self.events:
            for event in row:
                self.cu.cuEventDestroy(event)
        self.host_out = []
        self.host_in = []
        for ptr in self.pinned:
            self.cu.cuMemFreeHost(ptr)


def raw_pipeline(driver: Driver, data: BatchData, batches: int, depth: int) -> RawResult:
    """Run the demo's job raw: ``batches`` batches of ``data``'s inputs through three streams.

    Args:
        driver: the driver of device 0.
        data: the distinct inputs and their checksums (copied into pinned buffers on CUDA).
        batches: how many batches, at least 1.
        depth: device buffer pairs in the ring (batches in flight), at least 1.
    Returns:
        The run's seconds (buffers, streams and events are made before timing starts).
    Raises:
        ValueError: ``batches`` or ``depth`` below 1.
        RuntimeError: a raw call failed, or a verified batch differs from its host reference.
    Thread rule: any thread but a driver stream's own; it blocks until the run ends.
    """
    if batches < 1 or depth < 1:
        raise ValueError(f"raw pipeline: batches and depth must be at least 1, got {batches} and {depth}")
    stages: _Stages = (
        _CudaStages(driver, depth, data.nbytes, data.inputs) if driver.kind == "cuda"
        else _HostStages(driver, depth, data.nbytes)
    )
    try:
        stages.kernel(0)  # load the kernel (NVRTC compiles it the first time) before timing
        stages.finish()
        seconds = _timed(stages, data.input, batches, depth)
        _verify(stages, data, batches, depth)
    finally:
        stages.close()
    return RawResult(batches, data.nbytes, seconds)


_IN, _KERNEL, _OUT = 0, 1, 2


def _timed(stages: _Stages, source: Callable[[int], np.ndarray], batches: int, depth: int) -> float:
    t0 = time.perf_counter()
    for i in range(batches):
        slot = i % depth
        if i >= depth:
            stages.wait(_IN, _KERNEL, slot)  # the kernel of batch i - depth has read d_in[slot]
        stages.h2d(slot, source(i))
        stages.record(_IN, slot)
        stages.wait(_KERNEL, _IN, slot)
        if i >= depth:
            stages.wait(_KERNEL, _OUT, slot)  # the copy out of batch i - depth has read d_out[slot]
        stages.kernel(slot)
        stages.record(_KERNEL, slot)
        stages.wait(_OUT, _KERNEL, slot)
        stages.d2h(slot)
        stages.record(_OUT, slot)
    stages.finish()
    return time.perf_counter() - t0


def _verify(stages: _Stages, data: BatchData, batches: int, depth: int) -> None:
    last = batches - 1
    for i in range(max(0, batches - depth), batches):
        out = stages.host_out[i % depth]
        if checksum_u32(out) != data.checksum(i) or (i == last and not data.matches(i, out)):
            raise RuntimeError(f"raw pipeline: batch {i} differs from its host reference")
