"""The demo's job written raw, with no actors: the yardstick the demo and its bench row compare with.

Three streams, one per stage: copy in (host to device), ``SCALE_ADD_F32``, copy out (device to
host), over a ring of ``depth`` device buffer pairs, ordered by events only: a stage waits for the
stage before it of the same batch and for the last reader of the buffer it overwrites. No stream is
synchronized until the last batch.

The timed part is the tightest loop of the raw calls one can write in Python, so that the figure
is what the hardware and the driver allow, not what a layer of ours costs: everything (streams,
events, device and pinned buffers, the kernel's ``CUfunction`` and one prebuilt argument array per
ring slot, every bound function) is made before the clock starts, each batch's handles come from
a list built beforehand (one tuple unpack per batch, no indexing, no method dispatch), and the
loop body is the calls themselves, each one's ``CUresult`` checked by one truth test of what it
returned (an unchecked error would make the yardstick lie).

On the CUDA driver the calls are ``cuMemcpyHtoDAsync``/``cuMemcpyDtoHAsync`` from pinned host
buffers (``cuMemHostAlloc``), ``cuEventRecord``/``cuStreamWaitEvent`` and ``cuLaunchKernel`` (on
the ``CUfunction`` the driver's own ``launch`` loaded), in one of two spellings of the same
driver entry points:

* ``"bindings"`` (the one :func:`raw_pipeline` uses): ``cuda.bindings.driver`` itself, on handles
  wrapped once (``CUstream``/``CUevent``/``CUdeviceptr``, so no call converts an int), each result
  tested by its first item (``CUresult`` is an int enum, false only for ``CUDA_SUCCESS``). It is
  the tightest by design: its wrappers are compiled (Cython), so converting the arguments and
  building the result tuple are a few C operations, and letting the GIL go around the call costs
  little while no other thread wants it (the raw run runs alone: the demo and its bench row stop
  the pipeline's actors first).
* ``"held"``: the driver's ``ctypes`` prototypes that keep the GIL
  (:class:`~xlog_actors.driver.cuda.held.HeldCalls`), ints in, the ``CUresult`` int out. Keeping
  the GIL pays where threads contend for it (the actors' case, see :mod:`.held`), but a
  ``ctypes`` call converts each argument through its type's ``from_param`` and sets up the
  foreign call anew each time: on an H100, single-threaded, a ``cuStreamWaitEvent`` took about
  1.4 us this way against 0.95 us through ``cuda.bindings``, ``cuMemcpyHtoDAsync`` 4.4 against
  3.3 us and ``cuLaunchKernel`` 7.9 against 6.1 us, and the whole loop at 64 KiB batches moved
  2.4 GB/s against 2.8 GB/s. Kept so that the two spellings can be compared on the same device.

On the host driver, which is the lowest layer there, the same calls are ``HostDriver``'s (its
methods and its streams' bound once, the loop inlined the same way).

Verification, after the timed part: the last batch of every ring slot by checksum, the very last
byte for byte.

Past 400 lines because both spellings, both drivers' setup and the verification belong to one
yardstick and are read together: a change to one that the others did not follow would make the
twins differ in what they time.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np

from ..driver.kernel_library import SCALE_ADD_F32, checksum_u32, launch_shape
from ..driver.protocol import Driver
from .batches import ALPHA, BETA, BatchData

__all__ = ["RawResult", "raw_pipeline"]


@dataclass(frozen=True)
class RawResult:
    """One raw run: its shape, the seconds from the first enqueue to the last byte home, and the
    process's CPU seconds (all threads) over the same part.

    Thread rule: immutable; any thread.
    """

    batches: int
    batch_bytes: int
    seconds: float
    cpu_seconds: float = 0.0

    @property
    def throughput_bytes_s(self) -> float:
        """Input bytes through the whole pipeline per second."""
        return self.batches * self.batch_bytes / self.seconds if self.seconds > 0 else 0.0


def raw_pipeline(
    driver: Driver,
    data: BatchData,
    batches: int,
    depth: int,
    *,
    ordinal: int = 0,
    start_gate: Callable[[], None] | None = None,
) -> RawResult:
    """Run the demo's job raw: ``batches`` batches of ``data``'s inputs through three streams.

    Args:
        driver: the driver of the device.
        data: the distinct inputs and their checksums (copied into pinned buffers on CUDA).
        batches: how many batches, at least 1.
        depth: device buffer pairs in the ring (batches in flight), at least 1.
        ordinal: the device to run on.
        start_gate: called once everything is made and loaded, just before the clock starts (a
            run on several devices at once waits there until every device is ready).
    Returns:
        The run's seconds (buffers, streams, events and the kernel are made before timing starts).
    Raises:
        ValueError: ``batches`` or ``depth`` below 1.
        RuntimeError: a raw call failed, or a verified batch differs from its host reference.
        XlogError: a ``Driver`` call of the setup failed (an allocation that does not fit, say).
    Thread rule: any thread but a driver stream's own; it blocks until the run ends.
    """
    if batches < 1 or depth < 1:
        raise ValueError(f"raw pipeline: batches and depth must be at least 1, got {batches} and {depth}")
    gate = start_gate if start_gate is not None else _no_gate
    if driver.kind == "cuda":
        seconds, cpu = _cuda_run(driver, data, batches, depth, _CUDA_CALLS, ordinal, gate)
    else:
        seconds, cpu = _host_run(driver, data, batches, depth, ordinal, gate)
    return RawResult(batches, data.nbytes, seconds, cpu)


def _no_gate() -> None:
    """The start gate of a run that waits for nobody."""


def _verify(host_out: Sequence[Any], data: BatchData, batches: int, depth: int) -> None:
    last = batches - 1
    for i in range(max(0, batches - depth), batches):
        out = host_out[i % depth]
        if checksum_u32(out) != data.checksum(i) or (i == last and not data.matches(i, out)):
            raise RuntimeError(f"raw pipeline: batch {i} differs from its host reference")


def _schedule(batches: int, depth: int, sources: Sequence[Any], slots: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One tuple per batch, built before the clock: ``(later, source, *slot)`` where ``later``
    says the slot was used before (its buffers then have readers to wait for)."""
    return [(i >= depth, sources[i % len(sources)], *slots[i % depth]) for i in range(batches)]


@contextlib.contextmanager
def _ring(driver: Driver, ordinal: int, depth: int,
          nbytes: int) -> Iterator[tuple[list[Any], list[int], list[int]]]:
    """A run's three streams and ``depth`` device buffer pairs, ``(streams, d_in, d_out)``, on
    either driver; on the way out, whatever failed, the streams are synchronized (nothing below
    frees what a stream still uses), the buffers freed and the streams closed."""
    streams: list[Any] = []
    buffers: list[int] = []
    try:
        streams += (driver.create_stream(ordinal) for _ in range(3))
        d_in = [driver.alloc(ordinal, nbytes) for _ in range(depth)]
        buffers += d_in
        d_out = [driver.alloc(ordinal, nbytes) for _ in range(depth)]
        buffers += d_out
        yield streams, d_in, d_out
    finally:
        for s in streams:
            s.synchronize()
        for ptr in buffers:
            driver.free(ordinal, ptr)
        for s in streams:
            s.close()


# -- the host driver ------------------------------------------------------------------------------

def _host_run(driver: Driver, data: BatchData, batches: int, depth: int, ordinal: int,
              gate: Callable[[], None]) -> tuple[float, float]:
    nbytes, n = data.nbytes, data.nbytes // 4
    grid, block = launch_shape(n)
    with _ring(driver, ordinal, depth, nbytes) as (streams, d_in, d_out):
        host_out = [np.empty(nbytes, np.uint8) for _ in range(depth)]
        event = driver.create_event
        slots = [
            (d_in[s], d_out[s], host_out[s], event(ordinal), event(ordinal), event(ordinal),
             [d_out[s], d_in[s], ALPHA, BETA, n])
            for s in range(depth)
        ]
        driver.launch(SCALE_ADD_F32, grid, block, slots[0][6], streams[1])  # the CUDA path's warm-up, kept alike
        for s in streams:
            s.synchronize()
        schedule = _schedule(batches, depth, data.inputs, slots)
        gate()
        timing = _host_loop(driver, streams, schedule, grid, block)
        _verify(host_out, data, batches, depth)
        return timing


def _host_loop(driver: Driver, streams: list[Any], schedule: list[Any], grid: int, block: int) -> tuple[float, float]:
    h2d, launch, d2h, kernel = driver.copy_to_device, driver.launch, driver.copy_to_host_into, SCALE_ADD_F32
    s_in, s_k, s_out = streams
    record_in, record_k, record_out = s_in.record, s_k.record, s_out.record
    wait_in, wait_k, wait_out = s_in.wait, s_k.wait, s_out.wait
    clock = time.perf_counter
    t0, c0 = clock(), time.process_time()
    for later, src, d_in, d_out, h_out, e_in, e_k, e_out, args in schedule:
        if later:
            wait_in(e_k)  # the kernel of batch i - depth has read d_in
        h2d(d_in, src, s_in)
        record_in(e_in)
        wait_k(e_in)
        if later:
            wait_k(e_out)  # the copy out of batch i - depth has read d_out
        launch(kernel, grid, block, args, s_k)
        record_k(e_k)
        wait_out(e_k)
        d2h(d_out, h_out, s_out)
        record_out(e_out)
    s_in.synchronize()
    s_k.synchronize()
    s_out.synchronize()
    return clock() - t0, time.process_time() - c0


# -- the CUDA driver ------------------------------------------------------------------------------

_CudaCalls = Literal["held", "bindings"]

#: The spelling :func:`raw_pipeline` uses on CUDA (the module docstring says why).
_CUDA_CALLS: _CudaCalls = "bindings"

_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING, as the CUDA driver creates its events

#: ``SCALE_ADD_F32``'s parameters, each in its own 8-byte slot as the CUDA driver packs them
#: (``driver.cuda.driver._SLOT_CODES``), then the ``void*[]`` of their addresses cuLaunchKernel reads.
_PARAM_KINDS = ("ptr", "ptr", "f32", "f32", "u64")
_PARAM_VALUES = struct.Struct("<QQf4xf4xQ")
_PARAM_COUNT = len(_PARAM_KINDS)


def _kernel_params(out: int, x: int, n: int) -> ctypes.Array[ctypes.c_uint64]:
    """One launch's arguments of ``SCALE_ADD_F32`` and the pointers to them, in one array; the
    pointers start at ``addressof(array) + 8 * _PARAM_COUNT``. cuLaunchKernel copies the values
    before it returns, so one array serves every launch of a slot."""
    if SCALE_ADD_F32.params != _PARAM_KINDS:  # the packing below would silently launch garbage
        raise RuntimeError(f"raw pipeline: SCALE_ADD_F32 takes {SCALE_ADD_F32.params}, not {_PARAM_KINDS}")
    array = (ctypes.c_uint64 * (2 * _PARAM_COUNT))()
    _PARAM_VALUES.pack_into(array, 0, out, x, ALPHA, BETA, n)  # read now: a test patches BETA
    base = ctypes.addressof(array)
    struct.pack_into(f"<{_PARAM_COUNT}Q", array, 8 * _PARAM_COUNT, *range(base, base + 8 * _PARAM_COUNT, 8))
    return array


def _failed(call: str, err: object) -> RuntimeError:
    """The error of a raw call that returned ``err`` (a ``CUresult`` member or its int)."""
    from cuda.bindings import driver as cu

    with contextlib.suppress(ValueError):
        err = cu.CUresult(err)
    return RuntimeError(f"raw pipeline: {call} failed: {getattr(err, 'name', err)}")


def _ok(result: tuple[Any, ...], call: str) -> Any:
    """The value of a setup call's ``cuda.bindings`` result, raising on its error."""
    if result[0]:
        raise _failed(call, result[0])
    return result[1] if len(result) > 1 else None


def _cuda_run(driver: Driver, data: BatchData, batches: int, depth: int, calls: _CudaCalls, ordinal: int = 0,
              gate: Callable[[], None] = _no_gate) -> tuple[float, float]:
    """The CUDA run through ``calls``' spelling (see the module docstring) on device ``ordinal``:
    the setup, ``gate``, the timed loop, the verification and the teardown, which runs whatever
    failed."""
    from cuda.bindings import driver as cu

    nbytes, n = data.nbytes, data.nbytes // 4
    grid, block = launch_shape(n)
    driver.make_current(ordinal)  # the raw calls below run in this thread's current context
    device: Any = cast(Any, driver).fast_path(ordinal)[1]  # CudaDriver's CudaDevice: its kernels and HeldCalls
    events: list[Any] = []
    pinned: list[int] = []

    def host_buffer(size: int) -> np.ndarray:
        ptr = int(_ok(cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc"))
        pinned.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))

    def event() -> Any:
        ev = _ok(cu.cuEventCreate(_EVENT_DISABLE_TIMING), "cuEventCreate")
        events.append(ev)
        return ev

    with _ring(driver, ordinal, depth, nbytes) as (streams, d_in, d_out), _released(streams, events, pinned, cu):
        sources = []
        for src in data.inputs:
            buf = host_buffer(nbytes)
            buf[:] = src.view(np.uint8)
            sources.append(int(buf.ctypes.data))
        host_out = [host_buffer(nbytes) for _ in range(depth)]
        params = [_kernel_params(d_out[s], d_in[s], n) for s in range(depth)]
        # Compiled (NVRTC, the first time) and loaded by the driver's own launch, then read back:
        # the loop launches the very CUfunction Driver.launch would.
        driver.launch(SCALE_ADD_F32, grid, block, [d_out[0], d_in[0], ALPHA, BETA, n], streams[1])
        fn = device.function(SCALE_ADD_F32)
        for s in streams:
            s.synchronize()
        slot_events = [(event(), event(), event()) for _ in range(depth)]
        stream_handles = [s.handle for s in streams]
        if calls == "held":
            slots = [
                (d_in[s], d_out[s], int(host_out[s].ctypes.data), *(int(e) for e in slot_events[s]),
                 ctypes.addressof(params[s]) + 8 * _PARAM_COUNT)
                for s in range(depth)
            ]
            schedule = _schedule(batches, depth, sources, slots)
            gate()
            timing = _held_loop(device.held, cu, stream_handles, int(fn), grid, block, nbytes, schedule)
        else:
            slots = [
                (cu.CUdeviceptr(d_in[s]), cu.CUdeviceptr(d_out[s]), int(host_out[s].ctypes.data), *slot_events[s],
                 ctypes.addressof(params[s]) + 8 * _PARAM_COUNT)
                for s in range(depth)
            ]
            bound = [cu.CUstream(h) for h in stream_handles]
            schedule = _schedule(batches, depth, sources, slots)
            gate()
            timing = _bindings_loop(cu, bound, fn, grid, block, nbytes, schedule)
        _verify(host_out, data, batches, depth)
        return timing


@contextlib.contextmanager
def _released(streams: list[Any], events: list[Any], pinned: list[int], cu: Any) -> Iterator[None]:
    """On the way out of a CUDA run, whatever failed: its events destroyed and its pinned host
    memory freed, once the streams that may use them ran (before ``_ring`` frees the ring)."""
    try:
        yield
    finally:
        for s in streams:
            s.synchronize()
        for ev in events:
            cu.cuEventDestroy(ev)
        for ptr in pinned:
            cu.cuMemFreeHost(ptr)


def _held_loop(held: Any, cu: Any, streams: list[int], fn: int, grid: int, block: int, nbytes: int,
               schedule: list[Any]) -> tuple[float, float]:
    """The timed part through ``HeldCalls``: ints in, the ``CUresult`` int out (0 is success)."""
    h2d, d2h, launch = held.memcpy_htod, held.memcpy_dtoh, held.launch
    record, wait = held.event_record, held.stream_wait
    sync = cu.cuStreamSynchronize  # the one blocking call: through cuda.bindings, which lets the GIL go
    s_in, s_k, s_out = streams
    clock = time.perf_counter
    t0, c0 = clock(), time.process_time()
    for later, src, d_in, d_out, h_out, e_in, e_k, e_out, params in schedule:
        if later and (err := wait(s_in, e_k, 0)):  # the kernel of batch i - depth has read d_in
            raise _failed("cuStreamWaitEvent", err)
        if err := h2d(d_in, src, nbytes, s_in):
            raise _failed("cuMemcpyHtoDAsync", err)
        if err := record(e_in, s_in):
            raise _failed("cuEventRecord", err)
        if err := wait(s_k, e_in, 0):
            raise _failed("cuStreamWaitEvent", err)
        if later and (err := wait(s_k, e_out, 0)):  # the copy out of batch i - depth has read d_out
            raise _failed("cuStreamWaitEvent", err)
        if err := launch(fn, grid, 1, 1, block, 1, 1, 0, s_k, params, None):
            raise _failed("cuLaunchKernel", err)
        if err := record(e_k, s_k):
            raise _failed("cuEventRecord", err)
        if err := wait(s_out, e_k, 0):
            raise _failed("cuStreamWaitEvent", err)
        if err := d2h(h_out, d_out, nbytes, s_out):
            raise _failed("cuMemcpyDtoHAsync", err)
        if err := record(e_out, s_out):
            raise _failed("cuEventRecord", err)
    for s in streams:
        if (result := sync(s))[0]:
            raise _failed("cuStreamSynchronize", result[0])
    return clock() - t0, time.process_time() - c0


def _bindings_loop(cu: Any, streams: list[Any], fn: Any, grid: int, block: int, nbytes: int,
                   schedule: list[Any]) -> tuple[float, float]:
    """The timed part through ``cuda.bindings.driver``: each call returns a tuple whose first item
    is the ``CUresult`` (an int enum, false only for ``CUDA_SUCCESS``)."""
    h2d, d2h, record, wait = cu.cuMemcpyHtoDAsync, cu.cuMemcpyDtoHAsync, cu.cuEventRecord, cu.cuStreamWaitEvent
    launch, sync = cu.cuLaunchKernel, cu.cuStreamSynchronize
    s_in, s_k, s_out = streams
    clock = time.perf_counter
    t0, c0 = clock(), time.process_time()
    for later, src, d_in, d_out, h_out, e_in, e_k, e_out, params in schedule:
        if later and (r := wait(s_in, e_k, 0))[0]:  # the kernel of batch i - depth has read d_in
            raise _failed("cuStreamWaitEvent", r[0])
        if (r := h2d(d_in, src, nbytes, s_in))[0]:
            raise _failed("cuMemcpyHtoDAsync", r[0])
        if (r := record(e_in, s_in))[0]:
            raise _failed("cuEventRecord", r[0])
        if (r := wait(s_k, e_in, 0))[0]:
            raise _failed("cuStreamWaitEvent", r[0])
        if later and (r := wait(s_k, e_out, 0))[0]:  # the copy out of batch i - depth has read d_out
            raise _failed("cuStreamWaitEvent", r[0])
        if (r := launch(fn, grid, 1, 1, block, 1, 1, 0, s_k, params, 0))[0]:
            raise _failed("cuLaunchKernel", r[0])
        if (r := record(e_k, s_k))[0]:
            raise _failed("cuEventRecord", r[0])
        if (r := wait(s_out, e_k, 0))[0]:
            raise _failed("cuStreamWaitEvent", r[0])
        if (r := d2h(h_out, d_out, nbytes, s_out))[0]:
            raise _failed("cuMemcpyDtoHAsync", r[0])
        if (r := record(e_out, s_out))[0]:
            raise _failed("cuEventRecord", r[0])
    for s in streams:
        if (r := sync(s))[0]:
            raise _failed("cuStreamSynchronize", r[0])
    return clock() - t0, time.process_time() - c0
