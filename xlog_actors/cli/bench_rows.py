"""The rows of ``xlog-actors bench``: each measures one of our operations beside its raw twin.

Every row follows one recipe (see ``docs/performance.md``):

* the measured operation and its reference are callables ``fn(n)`` that run the operation ``n``
  times; a *sample* times one call with ``time.perf_counter_ns`` and divides by the operations it
  ran;
* both are warmed up, then sampled alternately (ABBA order: ours, ref, ref, ours, ...), so the
  machine's noise lands on both;
* the garbage collector is off while samples are taken (``gc.disable`` in ``try/finally``, after a
  ``gc.collect``), so neither side pays for a collection the other triggered;
* a sample run stops at its sample count or its time budget, whichever comes first (never below
  a minimum).

Raw twins go as low as this machine allows: on the CUDA driver they call ``cuda.bindings.driver``
directly on the same ``CUstream`` handle, not through :class:`~xlog_actors.driver.cuda.CudaDriver`;
on the host driver (which *is* the lowest layer there) they call ``HostDriver`` directly.
"""

from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pykka

from ..actors import (
    Allocate,
    AllocateMany,
    CopyActor,
    CopyDeviceToDevice,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    Fill,
    GetClient,
)
from ..driver.kernel_library import SCALE_ADD_F32, launch_shape
from ..driver.protocol import Driver, Stream
from ..memory.async_resource import AsyncCudaResource
from ..memory.block import Access, BlockId, StreamId
from ..memory.direct import DirectCudaResource
from ..memory.stream_pool import StreamPool
from .pipeline import ALPHA, BETA, PipelineConfig, expected, make_batch, run_pipeline

__all__ = [
    "GROUPS",
    "Context",
    "Plan",
    "RowResult",
    "Skipped",
    "Target",
    "interleave",
    "percentile",
    "sample",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
SIZE = 4 * KIB  # the allocation size of every allocator row

Op = Callable[[int], Any]


# -- plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Sample counts, batch sizes and data sizes of one run (see :func:`make_plan`)."""

    budget_s: float  # per measured pair: stop sampling after this long (at least min_samples)
    min_samples: int
    alloc: tuple[int, int]  # (samples, ops per sample) for the stream-ordered allocator rows
    direct: tuple[int, int]
    ask: tuple[int, int]
    many: tuple[int, int]  # AllocateMany(64): calls per sample
    client: tuple[int, int]
    access: tuple[int, int]
    event: tuple[int, int]
    h2d_bytes: int
    h2d_samples: int
    d2d_bytes: int
    d2d_samples: int
    d2d_per_sync: int  # copies enqueued before each synchronize (both sides)
    pipe_batches: int
    pipe_batch_bytes: int
    pipe_rounds: int
    scale_low: int
    scale_high: int
    scale_rounds: int
    scale: tuple[int, int]  # (samples per phase, ops per sample)
    many_count: int = 64


def make_plan(kind: str, quick: bool) -> Plan:
    if kind == "cuda":
        if quick:
            return Plan(
                budget_s=1.0, min_samples=10,
                alloc=(300, 10), direct=(60, 2), ask=(150, 2), many=(30, 1), client=(300, 10),
                access=(100, 1000), event=(300, 10),
                h2d_bytes=64 * MIB, h2d_samples=6, d2d_bytes=256 * MIB, d2d_samples=8, d2d_per_sync=8,
                pipe_batches=16, pipe_batch_bytes=16 * MIB, pipe_rounds=1,
                scale_low=1_000, scale_high=100_000, scale_rounds=2, scale=(50, 10),
            )
        return Plan(
            budget_s=4.0, min_samples=20,
            alloc=(3000, 10), direct=(400, 2), ask=(1500, 4), many=(300, 1), client=(3000, 10),
            access=(600, 1000), event=(3000, 10),
            h2d_bytes=256 * MIB, h2d_samples=20, d2d_bytes=GIB, d2d_samples=40, d2d_per_sync=8,
            pipe_batches=64, pipe_batch_bytes=16 * MIB, pipe_rounds=3,
            scale_low=1_000, scale_high=100_000, scale_rounds=4, scale=(300, 10),
        )
    if quick:
        return Plan(
            budget_s=0.6, min_samples=5,
            alloc=(200, 10), direct=(100, 4), ask=(100, 2), many=(15, 1), client=(200, 10),
            access=(100, 1000), event=(200, 10),
            h2d_bytes=4 * MIB, h2d_samples=5, d2d_bytes=16 * MIB, d2d_samples=5, d2d_per_sync=2,
            pipe_batches=6, pipe_batch_bytes=1 * MIB, pipe_rounds=1,
            scale_low=100, scale_high=5_000, scale_rounds=2, scale=(20, 10),
        )
    return Plan(
        budget_s=2.5, min_samples=10,
        alloc=(1500, 10), direct=(400, 4), ask=(400, 2), many=(60, 1), client=(1500, 10),
        access=(400, 1000), event=(1500, 10),
        h2d_bytes=16 * MIB, h2d_samples=12, d2d_bytes=64 * MIB, d2d_samples=12, d2d_per_sync=2,
        pipe_batches=32, pipe_batch_bytes=1 * MIB, pipe_rounds=3,
        scale_low=1_000, scale_high=100_000, scale_rounds=2, scale=(100, 10),
    )


# -- results ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What the issue asks of a row: ``metric`` (``"ratio"`` or ``"median"``, the latter in the
    row's unit) ``op`` (``"<="``, ``"<"``, ``">="``) ``value``."""

    metric: str
    op: str
    value: float

    @property
    def text(self) -> str:
        if self.metric == "ratio":
            return f"{self.op} {self.value:g}x"
        return f"median {self.op} {self.value:g}"

    def check(self, ratio: float, median: float) -> bool:
        x = ratio if self.metric == "ratio" else median
        if self.op == "<=":
            return x <= self.value
        if self.op == "<":
            return x < self.value
        if self.op == ">=":
            return x >= self.value
        raise ValueError(self.op)

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "op": self.op, "value": self.value, "text": self.text}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class RowResult:
    """One row. ``ours``/``ref`` hold nanoseconds per operation, one entry per sample.

    ``kind="time"``: figures are µs per op and ``ratio = ours / reference`` (lower is better).
    ``kind="rate"``: figures are GB/s (``bytes_per_op`` / time) and ``ratio = ours / reference``
    *of the rates*, i.e. reference time / our time (higher is better); the "p99" of a rate row
    is the rate at the 99th-percentile time, the slow tail.
    """

    name: str
    measures: str
    reference_name: str
    ours: list[float]
    ref: list[float]
    ops_per_sample: int
    kind: str = "time"
    bytes_per_op: int = 0
    target: Target | None = None
    informational: bool = False
    note: str = ""
    ref_ops_per_sample: int | None = None

    @property
    def unit(self) -> str:
        return "us" if self.kind == "time" else "GB/s"

    def _fig(self, ns: float) -> float:
        if self.kind == "time":
            return ns / 1e3
        return self.bytes_per_op / ns  # bytes per ns == GB/s

    @property
    def median(self) -> float:
        return self._fig(statistics.median(self.ours))

    @property
    def p99(self) -> float:
        return self._fig(percentile(self.ours, 99))

    @property
    def ref_median(self) -> float:
        return self._fig(statistics.median(self.ref))

    @property
    def ref_p99(self) -> float:
        return self._fig(percentile(self.ref, 99))

    @property
    def ratio(self) -> float:
        ours, ref = statistics.median(self.ours), statistics.median(self.ref)
        return ours / ref if self.kind == "time" else ref / ours

    @property
    def direction(self) -> str:
        return "lower_is_better" if self.kind == "time" else "higher_is_better"

    @property
    def ratio_definition(self) -> str:
        if self.kind == "time":
            return "ours / reference, median time per op (lower is better)"
        return "ours / reference, median bandwidth (higher is better)"

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.target.check(self.ratio, self.median)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measures": self.measures,
            "unit": self.unit,
            "median": self.median,
            "p99": self.p99,
            "reference": {
                "name": self.reference_name,
                "median": self.ref_median,
                "p99": self.ref_p99,
                "samples": len(self.ref),
                "ops_per_sample": self.ref_ops_per_sample or self.ops_per_sample,
            },
            "ratio": self.ratio,
            "ratio_definition": self.ratio_definition,
            "direction": self.direction,
            "target": None if self.target is None else self.target.to_json(),
            "pass": self.passed,
            "informational": self.informational,
            "samples": len(self.ours),
            "ops_per_sample": self.ops_per_sample,
            "bytes_per_op": self.bytes_per_op or None,
            "note": self.note,
        }


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


# -- sampling ---------------------------------------------------------------------------------
class _NoGC:
    """``gc.collect`` then ``gc.disable`` for the block; restores the previous state."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


def interleave(
    ours: Op,
    ref: Op,
    samples: int,
    batch: int,
    *,
    budget_s: float,
    min_samples: int,
    ours_ops: int = 1,
    ref_batch: int | None = None,
    ref_ops: int = 1,
    warmup: int = 3,
) -> tuple[list[float], list[float]]:
    """Alternate samples of ``ours(batch)`` and ``ref(ref_batch)`` (ABBA); nanoseconds per op.
    ``ours_ops``/``ref_ops``: operations one call of ``fn(1)`` runs (AllocateMany: 64)."""
    rb = batch if ref_batch is None else ref_batch
    for _ in range(warmup):
        ours(batch)
        ref(rb)
    clock = time.perf_counter_ns
    a: list[float] = []
    b: list[float] = []
    da = batch * ours_ops
    db = rb * ref_ops
    deadline = clock() + int(budget_s * 1e9)
    with _NoGC():
        for i in range(samples):
            if i & 1:
                t0 = clock()
                ref(rb)
                t1 = clock()
                ours(batch)
                t2 = clock()
                b.append((t1 - t0) / db)
                a.append((t2 - t1) / da)
            else:
                t0 = clock()
                ours(batch)
                t1 = clock()
                ref(rb)
                t2 = clock()
                a.append((t1 - t0) / da)
                b.append((t2 - t1) / db)
            if i + 1 >= min_samples and t2 > deadline:
                break
    return a, b


def sample(fn: Op, samples: int, batch: int, *, budget_s: float, min_samples: int) -> list[float]:
    """Samples of ``fn(batch)`` alone, nanoseconds per op (GC off)."""
    clock = time.perf_counter_ns
    out: list[float] = []
    deadline = clock() + int(budget_s * 1e9)
    with _NoGC():
        for i in range(samples):
            t0 = clock()
            fn(batch)
            t1 = clock()
            out.append((t1 - t0) / batch)
            if i + 1 >= min_samples and t1 > deadline:
                break
    return out


def timer_overhead_ns() -> float:
    """Median cost of one ``perf_counter_ns`` pair, for the JSON header."""
    clock = time.perf_counter_ns
    values = []
    for _ in range(2000):
        t0 = clock()
        t1 = clock()
        values.append(t1 - t0)
    return float(statistics.median(values))


# -- context ----------------------------------------------------------------------------------
@dataclass
class Context:
    driver: Driver
    plan: Plan
    wants: Callable[[str], bool]
    progress: Callable[[str], None]
    results: list[RowResult | Skipped] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.driver.kind == "cuda"

    def pair(self, ours: Op, ref: Op, spec: tuple[int, int], **kw: Any) -> tuple[list[float], list[float]]:
        samples, batch = spec
        return interleave(
            ours, ref, samples, batch, budget_s=self.plan.budget_s, min_samples=self.plan.min_samples, **kw
        )

    def add(self, row: RowResult) -> None:
        self.results.append(row)
        self.progress(_progress_text(row))

    def skip(self, name: str, reason: str) -> None:
        self.results.append(Skipped(name, reason))
        self.progress(f"{name}: skipped ({reason})")


def _progress_text(row: RowResult) -> str:
    verdict = ""
    if row.target is not None:
        verdict = f", target {row.target.text}: {'pass' if row.passed else 'FAIL'}"
    return f"{row.name}: {row.median:.4g} {row.unit}, {row.ratio:.3g}x{verdict}"


def _cu() -> Any:
    from cuda.bindings import driver as cu

    return cu


def _check(cu: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-bindings result tuple, raising on an error."""
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else result[1:]


def _raw_stream_ordered_pair(ctx: Context, stream: Stream) -> tuple[Op, str]:
    """The raw twin of a stream-ordered 4 KiB allocate + free on ``stream``."""
    driver = ctx.driver
    if ctx.cuda:
        cu = _cu()
        h = cu.CUstream(stream.handle)
        alloc, free = cu.cuMemAllocAsync, cu.cuMemFreeAsync
        _check(cu, free(_check(cu, alloc(SIZE, h), "cuMemAllocAsync"), h), "cuMemFreeAsync")

        def raw(n: int) -> None:
            for _ in range(n):
                err, ptr = alloc(SIZE, h)
                (err2,) = free(ptr, h)
            if err != cu.CUresult.CUDA_SUCCESS or err2 != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"raw cuMemAllocAsync/cuMemFreeAsync failed: {err} {err2}")

        return raw, "raw cuMemAllocAsync+cuMemFreeAsync (cuda.bindings)"

    alloc_async, free_async = driver.alloc_async, driver.free_async

    def raw_host(n: int) -> None:
        for _ in range(n):
            free_async(alloc_async(SIZE, stream), stream)

    return raw_host, "HostDriver.alloc_async+free_async"


# -- 1. stream-ordered allocation ---------------------------------------------------------------
ASYNC = "AsyncCudaResource alloc+free"
DRIVER_ASYNC = "driver alloc_async+free_async"
CUDA_CORE = "cuda.core Device.allocate+close"
CUPY = "CuPy pool empty+del"
TORCH = "PyTorch caching empty+del"


def group_async(ctx: Context) -> None:
    driver, plan = ctx.driver, ctx.plan
    pool = StreamPool(driver, 0)
    try:
        res = AsyncCudaResource(driver, 0, pool)
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        raw, raw_name = _raw_stream_ordered_pair(ctx, stream)
        alloc, dealloc = res.allocate, res.deallocate

        def ours(n: int) -> None:
            for _ in range(n):
                dealloc(alloc(SIZE))

        if ctx.wants(ASYNC):
            a, b = ctx.pair(ours, raw, plan.alloc)
            ctx.add(RowResult(
                ASYNC, "AsyncCudaResource.allocate(4 KiB) + deallocate on its default stream", raw_name,
                a, b, plan.alloc[1], target=Target("ratio", "<=", 1.5),
                note="raw twin on the same stream handle; PyTorch's caching allocator is about 1.37x of raw on an H200",
            ))
        if ctx.wants(DRIVER_ASYNC):
            if not ctx.cuda:
                ctx.skip(DRIVER_ASYNC, "on the host driver this is the reference itself")
            else:
                d_alloc, d_free = driver.alloc_async, driver.free_async

                def via_driver(n: int) -> None:
                    for _ in range(n):
                        d_free(d_alloc(SIZE, stream), stream)

                a, b = ctx.pair(via_driver, raw, plan.alloc)
                ctx.add(RowResult(
                    DRIVER_ASYNC, "CudaDriver.alloc_async(4 KiB) + free_async: the driver layer alone",
                    raw_name, a, b, plan.alloc[1], informational=True,
                    note="informational: the driver wrapper's share of the AsyncCudaResource row",
                ))
        res.reap_pending()
    finally:
        pool.close()


def group_peers(ctx: Context) -> None:
    """The peers' allocators beside the same raw twin. Run last: importing CuPy or PyTorch
    initializes their runtimes in this process, which was seen to change what other rows cost
    (raw ``cuMemAlloc``+``cuMemFree`` fell from about 57 µs to about 2.6 µs on an H200 once
    they were loaded), and our rows are meant to be measured in a process without them."""
    names = (CUDA_CORE, CUPY, TORCH)
    if not any(ctx.wants(n) for n in names):
        return
    if not ctx.cuda:
        for name in names:
            if ctx.wants(name):
                ctx.skip(name, "CUDA driver only")
        return
    driver, plan = ctx.driver, ctx.plan
    pool = StreamPool(driver, 0)
    try:
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        raw, raw_name = _raw_stream_ordered_pair(ctx, stream)
        for name, maker in ((CUDA_CORE, _cuda_core_op), (CUPY, _cupy_op), (TORCH, _torch_op)):
            if not ctx.wants(name):
                continue
            try:
                op, what = maker(stream)
            except Exception as exc:  # noqa: BLE001 - not a dependency: absent or unusable
                first = str(exc).splitlines()[0] if str(exc) else ""
                ctx.skip(name, f"not usable here: {type(exc).__name__}: {first}")
                continue
            a, b = ctx.pair(op, raw, plan.alloc)
            ctx.add(RowResult(name, what, raw_name, a, b, plan.alloc[1], informational=True,
                              note="informational: a peer's allocator beside the same raw twin"))
        stream.synchronize()
    finally:
        pool.close()


def _cuda_core_op(stream: Stream) -> tuple[Op, str]:
    try:
        from cuda.core import Device
    except ImportError:  # older cuda.core
        from cuda.core.experimental import Device  # type: ignore[no-redef]
    dev = Device(0)
    dev.set_current()
    cstream = dev.create_stream(stream)  # wraps our stream through __cuda_stream__
    allocate = dev.allocate
    allocate(SIZE, stream=cstream).close(cstream)

    def op(n: int) -> None:
        for _ in range(n):
            allocate(SIZE, stream=cstream).close(cstream)

    return op, "cuda.core Device().allocate(4 KiB, stream=s) + Buffer.close(s), on our stream"


def _cupy_op(_stream: Stream) -> tuple[Op, str]:
    import cupy

    cupy.cuda.Device(0).use()
    empty, u8 = cupy.empty, cupy.uint8
    empty(SIZE, dtype=u8)

    def op(n: int) -> None:
        for _ in range(n):
            a = empty(SIZE, dtype=u8)
            del a

    return op, f"cupy.empty(4096, uint8) + del (CuPy {cupy.__version__} default memory pool, its current stream)"


def _torch_op(_stream: Stream) -> tuple[Op, str]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    dev = torch.device("cuda", 0)
    empty, u8 = torch.empty, torch.uint8
    empty(SIZE, dtype=u8, device=dev)

    def op(n: int) -> None:
        for _ in range(n):
            a = empty(SIZE, dtype=u8, device=dev)
            del a

    return op, f"torch.empty(4096, uint8, device='cuda') + del (PyTorch {torch.__version__} caching allocator)"


# -- 2. synchronous allocation ----------------------------------------------------------------
DIRECT = "DirectCudaResource alloc+free"
DRIVER_DIRECT = "driver alloc+free"


def group_direct(ctx: Context) -> None:
    if not (ctx.wants(DIRECT) or ctx.wants(DRIVER_DIRECT)):
        return
    driver, plan = ctx.driver, ctx.plan
    res = DirectCudaResource(driver, 0)
    alloc, dealloc = res.allocate, res.deallocate

    def ours(n: int) -> None:
        for _ in range(n):
            dealloc(alloc(SIZE))

    if ctx.cuda:
        cu = _cu()
        mem_alloc, mem_free = cu.cuMemAlloc, cu.cuMemFree
        _check(cu, mem_free(_check(cu, mem_alloc(SIZE), "cuMemAlloc")), "cuMemFree")

        def raw(n: int) -> None:
            for _ in range(n):
                err, ptr = mem_alloc(SIZE)
                (err2,) = mem_free(ptr)
            if err != cu.CUresult.CUDA_SUCCESS or err2 != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"raw cuMemAlloc/cuMemFree failed: {err} {err2}")

        raw_name = "raw cuMemAlloc+cuMemFree (cuda.bindings)"
    else:
        host_alloc, host_free = driver.alloc, driver.free

        def raw(n: int) -> None:
            for _ in range(n):
                host_free(0, host_alloc(0, SIZE))

        raw_name = "HostDriver.alloc+free"
    if ctx.wants(DIRECT):
        a, b = ctx.pair(ours, raw, plan.direct)
        ctx.add(RowResult(DIRECT, "DirectCudaResource.allocate(4 KiB) + deallocate", raw_name, a, b,
                          plan.direct[1], target=Target("ratio", "<=", 1.1)))
    if ctx.wants(DRIVER_DIRECT):
        if not ctx.cuda:
            ctx.skip(DRIVER_DIRECT, "on the host driver this is the reference itself")
            return
        d_alloc, d_free = driver.alloc, driver.free

        def via_driver(n: int) -> None:
            for _ in range(n):
                d_free(0, d_alloc(0, SIZE))

        a, b = ctx.pair(via_driver, raw, plan.direct)
        ctx.add(RowResult(DRIVER_DIRECT, "CudaDriver.alloc(0, 4 KiB) + free: the driver layer alone", raw_name,
                          a, b, plan.direct[1], informational=True,
                          note="informational: the driver wrapper's share of the DirectCudaResource row"))


# -- 3, 4. the DeviceActor, DeviceClient and GpuRef ---------------------------------------------
ACTOR = "DeviceActor Allocate"
MANY = "DeviceActor AllocateMany(64)"
CLIENT = "DeviceClient allocate+free"
ACCESS = "GpuRef.access"


class _Echo(pykka.ThreadingActor):
    """The reference actor: answers every message with None."""

    def on_receive(self, message: Any) -> None:
        return None


class _Plain:
    __slots__ = ("_x",)

    def __init__(self) -> None:
        self._x = 1

    def get(self) -> int:
        return self._x


def group_actor(ctx: Context) -> None:
    if not any(ctx.wants(n) for n in (ACTOR, MANY, CLIENT, ACCESS)):
        return
    driver, plan = ctx.driver, ctx.plan
    device = DeviceActor.start(0, driver)
    echo = _Echo.start()
    stream = driver.create_stream(0)
    try:
        raw, raw_name = _raw_stream_ordered_pair(ctx, stream)
        if ctx.wants(ACTOR):
            msg = Allocate(SIZE)
            ask, echo_ask = device.ask, echo.ask

            held: list[Any] = [None]

            def ours(n: int) -> None:
                # Each new handle replaces the previous one in ``held``: that drop tells its
                # free to the device, which handles it before the next Allocate (its inbox is
                # FIFO). So a sample pays for n allocations and n frees, and no free is left
                # running while the reference is timed.
                for _ in range(n):
                    held[0] = None  # told ahead of the next Allocate, not after its reply
                    held[0] = ask(msg)

            def bare(n: int) -> None:
                for _ in range(n):
                    echo_ask(msg)

            a, b = ctx.pair(ours, bare, plan.ask)
            held[0] = None
            ctx.add(RowResult(
                ACTOR, "device.ask(Allocate(4 KiB)); dropping the GpuRef tells its free back to the device",
                "bare pykka ask round trip to a trivial actor", a, b, plan.ask[1],
                target=Target("ratio", "<=", 1.2),
            ))
        if ctx.wants(MANY):
            count = plan.many_count
            many = AllocateMany((SIZE,) * count)
            ask = device.ask

            held_many: list[Any] = [None]

            def ours_many(n: int) -> None:
                for _ in range(n):
                    held_many[0] = None  # the previous 64 frees are told ahead of this ask
                    held_many[0] = ask(many)

            samples, calls = plan.many
            a, b = interleave(
                ours_many, raw, samples, calls, budget_s=plan.budget_s, min_samples=plan.min_samples,
                ours_ops=count, ref_batch=count * calls,
            )
            held_many[0] = None
            ctx.add(RowResult(
                MANY, "device.ask(AllocateMany(64 x 4 KiB)), drop the refs; per allocation", raw_name,
                a, b, calls * count, target=Target("ratio", "<=", 3.0), ref_ops_per_sample=count * calls,
                note="includes the 64 frees told back to the device (handled before the next ask)",
            ))
        if ctx.wants(CLIENT) or ctx.wants(ACCESS):
            client: Any = device.ask(GetClient())
            if ctx.wants(CLIENT):
                c_alloc, c_free = client.allocate, client.free

                def ours_client(n: int) -> None:
                    for _ in range(n):
                        c_free(c_alloc(SIZE))

                a, b = ctx.pair(ours_client, raw, plan.client)
                ctx.add(RowResult(
                    CLIENT, "DeviceClient.allocate(4 KiB) + DeviceClient.free, in the calling thread",
                    raw_name, a, b, plan.client[1], informational=True,
                    note="informational: the direct path for code that allocates in a loop",
                ))
            if ctx.wants(ACCESS):
                ref = client.allocate(SIZE)
                access = ref.access
                plain = _Plain().get

                def ours_access(n: int) -> None:
                    for _ in range(n):
                        access()

                def noop(n: int) -> None:
                    for _ in range(n):
                        plain()

                a, b = ctx.pair(ours_access, noop, plan.access)
                ctx.add(RowResult(
                    ACCESS, "GpuRef.access() of a live handle (validation fast path)",
                    "a no-op method call returning a slot attribute (context only)", a, b, plan.access[1],
                    target=Target("median", "<", 0.5),
                    note="absolute target on the median (µs); the ratio is for context",
                ))
                client.free(ref)
    finally:
        echo.stop()
        device.stop()
        stream.close()


# -- 5. cross-stream tracking --------------------------------------------------------------------
TRACK = "cross-stream read prepare+finish"
DRIVER_TRACK = "driver record+wait"


def group_tracking(ctx: Context) -> None:
    if not (ctx.wants(TRACK) or ctx.wants(DRIVER_TRACK)):
        return
    driver, plan = ctx.driver, ctx.plan
    pool = StreamPool(driver, 0)
    try:
        res = AsyncCudaResource(driver, 0, pool)
        s1 = StreamId.DEFAULT
        s2 = pool.acquire()
        st1, st2 = pool.resolve(s1), pool.resolve(s2)
        assert st1 is not None and st2 is not None
        block = res.allocate(SIZE, s1)
        bid = BlockId.from_block(block)
        driver.fill(block.ptr, 7, SIZE, st1)  # written on the first stream
        res.finish_block_use(bid, s1, Access.WRITE)
        prepare, finish, read = res.prepare_block_use, res.finish_block_use, Access.READ

        def ours(n: int) -> None:
            for _ in range(n):
                prepare(bid, s2, read)  # waits on the write's (lazy) fence
                finish(bid, s2, read)  # re-records this stream's read event in place

        if ctx.cuda:
            cu = _cu()
            h1, h2 = cu.CUstream(st1.handle), cu.CUstream(st2.handle)
            flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            event = _check(cu, cu.cuEventCreate(flags), "cuEventCreate")
            record, wait = cu.cuEventRecord, cu.cuStreamWaitEvent

            def raw(n: int) -> None:
                for _ in range(n):
                    (err,) = record(event, h1)
                    (err2,) = wait(h2, event, 0)
                if err != cu.CUresult.CUDA_SUCCESS or err2 != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"raw cuEventRecord/cuStreamWaitEvent failed: {err} {err2}")

            raw_name = "raw cuEventRecord+cuStreamWaitEvent (cuda.bindings)"
        else:
            event = driver.create_event(0)
            rec, wt = st1.record, st2.wait

            def raw(n: int) -> None:
                for _ in range(n):
                    rec(event)
                    wt(event)

            raw_name = "HostStream.record(event) + other.wait(event)"
        try:
            if ctx.wants(TRACK):
                a, b = ctx.pair(ours, raw, plan.event)
                ctx.add(RowResult(
                    TRACK, "AsyncCudaResource.prepare_block_use + finish_block_use, READ on a second stream "
                    "of a block written on the first", raw_name, a, b, plan.event[1],
                    target=Target("ratio", "<=", 2.0),
                    note="steady state: one wait on the write's fence and one in-place re-record of "
                    "the stream's read event per op",
                ))
            if ctx.wants(DRIVER_TRACK):
                if not ctx.cuda:
                    ctx.skip(DRIVER_TRACK, "on the host driver this is the reference itself")
                else:
                    d_event = driver.create_event(0)
                    d_record, d_wait = st1.record, st2.wait

                    def via_driver(n: int) -> None:
                        for _ in range(n):
                            d_record(d_event)
                            d_wait(d_event)

                    a, b = ctx.pair(via_driver, raw, plan.event)
                    ctx.add(RowResult(
                        DRIVER_TRACK, "CudaStream.record(event) + other.wait(event): the driver layer alone",
                        raw_name, a, b, plan.event[1], informational=True,
                        note="informational: the driver wrapper's share of the tracking row",
                    ))
        finally:
            st1.synchronize()
            st2.synchronize()
            if ctx.cuda:
                cu.cuEventDestroy(event)
        res.deallocate(block)
        res.reap_pending()
    finally:
        pool.close()


# -- 6. copies -----------------------------------------------------------------------------------
H2D = "CopyActor H2D pinned"
H2D_DRIVER = "driver copy_to_device H2D pinned"
D2D = "CopyActor D2D"
D2D_DRIVER = "driver copy_device_to_device D2D"
D2D_UNTRACKED = "CopyActor D2D, tracking off"


class _HostBuffer:
    """Pinned (page-locked) host memory on CUDA (``cuMemHostAlloc``), plain memory on the host
    driver; ``array`` is a numpy view over it."""

    def __init__(self, cuda: bool, nbytes: int) -> None:
        self.cuda = cuda
        self.nbytes = nbytes
        if cuda:
            cu = _cu()
            self.ptr = int(_check(cu, cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
            raw = (ctypes.c_uint8 * nbytes).from_address(self.ptr)
            self.array = np.ctypeslib.as_array(raw)
        else:
            self.array = np.empty(nbytes, dtype=np.uint8)
            self.ptr = int(self.array.ctypes.data)
        pattern = np.arange(256, dtype=np.uint8)
        self.array.reshape(-1, 256)[:] = pattern  # nbytes is a multiple of 256: MiB sizes

    def close(self) -> None:
        del self.array
        if self.cuda:
            cu = _cu()
            cu.cuMemFreeHost(self.ptr)


def group_copy(ctx: Context) -> None:
    if not any(ctx.wants(n) for n in (H2D, H2D_DRIVER, D2D, D2D_DRIVER, D2D_UNTRACKED)):
        return
    driver, plan = ctx.driver, ctx.plan
    device = DeviceActor.start(0, driver)
    copy = CopyActor.start(device)
    stream = driver.create_stream(0)
    cu = _cu() if ctx.cuda else None
    # The raw twins copy into (and between) the very device buffers the actor uses, so memory
    # placement is the same on both sides; the two never overlap in time (each sample ends
    # with its stream synchronized).
    host: _HostBuffer | None = None
    try:
        ask = copy.ask
        if ctx.wants(H2D) or ctx.wants(H2D_DRIVER):
            nbytes = plan.h2d_bytes
            host = _HostBuffer(ctx.cuda, nbytes)
            arr = host.array
            ref: Any = device.ask(Allocate(nbytes))
            dptr = ref.raw_device_ptr()
            to_device = CopyToDevice(ref, arr)
            sync = CopyToHost(ref, nbytes=1)

            def ours(n: int) -> None:
                for _ in range(n):
                    ask(to_device)
                    ask(sync)  # synchronizes the copy actor's stream

            if cu is not None:
                h = cu.CUstream(stream.handle)
                memcpy, stream_sync, hptr = cu.cuMemcpyHtoDAsync, cu.cuStreamSynchronize, host.ptr

                def raw(n: int) -> None:
                    for _ in range(n):
                        memcpy(dptr, hptr, nbytes, h)
                        (err,) = stream_sync(h)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        raise RuntimeError(f"raw cuMemcpyHtoDAsync/cuStreamSynchronize failed: {err}")

                raw_name = "raw cuMemcpyHtoDAsync + cuStreamSynchronize, same pinned buffer and destination"
            else:
                def raw(n: int) -> None:
                    for _ in range(n):
                        driver.copy_to_device(dptr, arr, stream)
                        stream.synchronize()

                raw_name = "HostDriver.copy_to_device + synchronize"
            samples = (plan.h2d_samples, 1)
            if ctx.wants(H2D):
                a, b = ctx.pair(ours, raw, samples)
                got = ask(CopyToHost(ref, nbytes=64))
                if got != arr[:64].tobytes():
                    raise RuntimeError("CopyActor H2D: the device holds other bytes than were copied")
                ctx.add(RowResult(
                    H2D, f"copy.ask(CopyToDevice(ref, {_size(nbytes)} pinned)) + ask(CopyToHost(ref, nbytes=1)) "
                    "to synchronize", raw_name, a, b, 1, kind="rate", bytes_per_op=nbytes,
                    target=Target("ratio", ">=", 0.95),
                ))
            if ctx.wants(H2D_DRIVER):
                def via_driver(n: int) -> None:
                    for _ in range(n):
                        driver.copy_to_device(dptr, arr, stream)
                        stream.synchronize()

                a, b = ctx.pair(via_driver, raw, samples)
                ctx.add(RowResult(
                    H2D_DRIVER, f"driver.copy_to_device({_size(nbytes)} pinned) + stream.synchronize(), no actor",
                    raw_name, a, b, 1, kind="rate", bytes_per_op=nbytes, informational=True,
                    note="informational: separates the driver's share (its snapshot of the source) from the actor's",
                ))
            del ref, to_device, sync, arr
            host.close()
            host = None
        if ctx.wants(D2D) or ctx.wants(D2D_DRIVER) or ctx.wants(D2D_UNTRACKED):
            nbytes, k = plan.d2d_bytes, plan.d2d_per_sync
            src: Any = device.ask(Allocate(nbytes))
            dst: Any = device.ask(Allocate(nbytes))
            ask(Fill(src, 7))
            d_src, d_dst = src.raw_device_ptr(), dst.raw_device_ptr()
            d2d = CopyDeviceToDevice(src, dst)
            sync = CopyToHost(dst, nbytes=1)

            def ours_d2d(n: int) -> None:
                for _ in range(n):
                    for _ in range(k):
                        ask(d2d)
                    ask(sync)

            if cu is not None:
                h = cu.CUstream(stream.handle)
                memcpy, stream_sync = cu.cuMemcpyDtoDAsync, cu.cuStreamSynchronize

                def raw_d2d(n: int) -> None:
                    for _ in range(n):
                        for _ in range(k):
                            memcpy(d_dst, d_src, nbytes, h)
                        (err,) = stream_sync(h)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        raise RuntimeError(f"raw cuMemcpyDtoDAsync/cuStreamSynchronize failed: {err}")

                raw_name = f"raw cuMemcpyDtoDAsync x{k} + cuStreamSynchronize"
            else:
                def raw_d2d(n: int) -> None:
                    for _ in range(n):
                        for _ in range(k):
                            driver.copy_device_to_device(d_dst, d_src, nbytes, stream)
                        stream.synchronize()

                raw_name = f"HostDriver.copy_device_to_device x{k} + synchronize"
            if ctx.wants(D2D):
                a, b = ctx.pair(ours_d2d, raw_d2d, (plan.d2d_samples, 1), ours_ops=k, ref_ops=k)
                if ask(CopyToHost(dst, nbytes=16)) != bytes([7]) * 16:
                    raise RuntimeError("CopyActor D2D: the destination does not hold the source's bytes")
                ctx.add(RowResult(
                    D2D, f"{k} x copy.ask(CopyDeviceToDevice({_size(nbytes)})) + ask(CopyToHost(dst, nbytes=1)); "
                    "per copy", raw_name, a, b, k, kind="rate", bytes_per_op=nbytes,
                    target=Target("ratio", ">=", 0.95),
                    note=f"bandwidth counts the bytes copied once (read + write traffic is twice that); "
                    f"{k} copies per synchronize on both sides",
                ))
            if ctx.wants(D2D_UNTRACKED):
                untracked = CopyActor.start(device, track=False)
                try:
                    u_ask = untracked.ask
                    u_sync = CopyToHost(dst, nbytes=1)

                    def untracked_d2d(n: int) -> None:
                        for _ in range(n):
                            for _ in range(k):
                                u_ask(d2d)
                            u_ask(u_sync)

                    a, b = ctx.pair(untracked_d2d, raw_d2d, (plan.d2d_samples, 1), ours_ops=k, ref_ops=k)
                finally:
                    untracked.stop()
                ctx.add(RowResult(
                    D2D_UNTRACKED, "as CopyActor D2D, on a CopyActor started with track=False (no "
                    "prepare/finish, no events); per copy", raw_name, a, b, k, kind="rate", bytes_per_op=nbytes,
                    informational=True, note="informational: the tracking's share of the CopyActor D2D row",
                ))
            if ctx.wants(D2D_DRIVER) and not ctx.cuda:
                ctx.skip(D2D_DRIVER, "on the host driver this is the reference itself")
            elif ctx.wants(D2D_DRIVER):
                d2d_copy = driver.copy_device_to_device

                def via_driver_d2d(n: int) -> None:
                    for _ in range(n):
                        for _ in range(k):
                            d2d_copy(d_dst, d_src, nbytes, stream)
                        stream.synchronize()

                a, b = ctx.pair(via_driver_d2d, raw_d2d, (plan.d2d_samples, 1), ours_ops=k, ref_ops=k)
                ctx.add(RowResult(
                    D2D_DRIVER, f"{k} x driver.copy_device_to_device({_size(nbytes)}) + stream.synchronize(), "
                    "no actor; per copy", raw_name, a, b, k, kind="rate", bytes_per_op=nbytes, informational=True,
                    note="informational: the driver's share of the CopyActor D2D row",
                ))
            del src, dst, d2d, sync
    finally:
        if host is not None:
            host.close()
        copy.stop()
        device.stop()
        stream.synchronize()
        stream.close()


def _size(nbytes: int) -> str:
    if nbytes >= GIB and nbytes % GIB == 0:
        return f"{nbytes // GIB} GiB"
    if nbytes >= MIB:
        return f"{nbytes / MIB:g} MiB"
    return f"{nbytes / KIB:g} KiB"


# -- 7. the demo pipeline --------------------------------------------------------------------------
PIPELINE = "demo pipeline"


def _one_thread_pipeline(driver: Driver, batches: int, batch_bytes: int) -> float:
    """The demo's copies and kernels from one thread on one stream through the driver; seconds
    from the first batch to the last verification (setup excluded, as in ``run_pipeline``)."""
    n = batch_bytes // 4
    stream = driver.create_stream(0)
    d_in = driver.alloc(0, batch_bytes)
    d_out = driver.alloc(0, batch_bytes)
    out = bytearray(batch_bytes)
    grid, block = launch_shape(n)
    bad: list[int] = []
    try:
        t0 = time.perf_counter()
        for i in range(batches):
            driver.copy_to_device(d_in, make_batch(i, n), stream)
            driver.launch(SCALE_ADD_F32, grid, block, [d_out, d_in, ALPHA, BETA, n], stream)
            driver.copy_to_host_into(d_out, out, stream)
            stream.synchronize()
            if out != expected(i, n).tobytes():
                bad.append(i)
        seconds = time.perf_counter() - t0
    finally:
        stream.synchronize()
        driver.free(0, d_in)
        driver.free(0, d_out)
        stream.close()
    if bad:
        raise RuntimeError(f"one-thread pipeline: batches {bad[:10]} differ from the host reference")
    return seconds


def group_pipeline(ctx: Context) -> None:
    if not ctx.wants(PIPELINE):
        return
    driver, plan = ctx.driver, ctx.plan
    batches, nbytes = plan.pipe_batches, plan.pipe_batch_bytes
    cfg = PipelineConfig(batches=batches, batch_bytes=nbytes)

    def ours() -> float:
        result = run_pipeline(driver, cfg)
        if not result.ok:
            raise RuntimeError(
                f"demo pipeline failed: verified {result.verified}/{result.batches}, "
                f"mismatched {result.mismatched[:10]}, errors {result.errors[:3]}"
            )
        return result.seconds

    def ref() -> float:
        return _one_thread_pipeline(driver, batches, nbytes)

    # warm up: NVRTC compile and module load, pool growth, numpy
    warm = PipelineConfig(batches=min(4, batches), batch_bytes=nbytes)
    if not run_pipeline(driver, warm).ok:
        raise RuntimeError("demo pipeline warm-up failed verification")
    _one_thread_pipeline(driver, min(4, batches), nbytes)
    a: list[float] = []
    b: list[float] = []
    with _NoGC():
        for r in range(max(1, plan.pipe_rounds)):
            if r & 1:
                b.append(ref() * 1e9)
                a.append(ours() * 1e9)
            else:
                a.append(ours() * 1e9)
                b.append(ref() * 1e9)
    ctx.add(RowResult(
        PIPELINE, f"run_pipeline: {batches} batches of {_size(nbytes)} through producer -> transformer -> "
        "consumer actors on 3 streams, verified", "the same copies, kernels and verification from one thread "
        "on one stream through the driver", a, b, 1, kind="rate", bytes_per_op=batches * nbytes,
        target=Target("ratio", ">=", 0.9),
        note="throughput counts input bytes per second; one sample is one whole run",
    ))


# -- 8. scaling with live blocks --------------------------------------------------------------------
SCALING = "AsyncCudaResource scaling (live blocks)"
SCALING_RAW = "raw pair scaling (live blocks)"


def group_scaling(ctx: Context) -> None:
    if not (ctx.wants(SCALING) or ctx.wants(SCALING_RAW)):
        return
    driver, plan = ctx.driver, ctx.plan
    low, high = plan.scale_low, plan.scale_high
    pool = StreamPool(driver, 0)
    try:
        res = AsyncCudaResource(driver, 0, pool)
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        alloc, dealloc = res.allocate, res.deallocate
        raw, raw_name = _raw_stream_ordered_pair(ctx, stream)

        def op(n: int) -> None:
            for _ in range(n):
                dealloc(alloc(SIZE))

        def measure() -> tuple[list[float], list[float]]:
            samples, batch = plan.scale
            return interleave(op, raw, samples, batch, budget_s=plan.budget_s / 2, min_samples=plan.min_samples)

        def grow() -> list[Any]:
            return [alloc(SIZE) for _ in range(high - low)]

        def shrink(blocks: list[Any]) -> None:
            for i, block in enumerate(blocks):
                dealloc(block)
                if not ctx.cuda and i % 256 == 255:
                    stream.synchronize()  # keep the host driver's deferred-free list short
            blocks.clear()
            res.reap_pending()

        base = [alloc(SIZE) for _ in range(low)]
        ours_low: list[float] = []
        ours_high: list[float] = []
        raw_low: list[float] = []
        raw_high: list[float] = []

        def at_low() -> None:
            a, b = measure()
            ours_low.extend(a)
            raw_low.extend(b)

        def at_high() -> None:
            a, b = measure()
            ours_high.extend(a)
            raw_high.extend(b)

        for r in range(max(1, plan.scale_rounds)):
            if r & 1:
                extra = grow()
                at_high()
                shrink(extra)
                at_low()
            else:
                at_low()
                extra = grow()
                at_high()
                shrink(extra)
        for block in base:
            dealloc(block)
        res.reap_pending()
        note = (f"phases alternate per round (the live set is grown to {high:,} and shrunk back to "
                f"{low:,} between them); within a phase ours and the raw pair alternate")
        if ctx.wants(SCALING):
            ctx.add(RowResult(
                SCALING, f"AsyncCudaResource.allocate(4 KiB) + deallocate with {high:,} live blocks",
                f"the same with {low:,} live blocks", ours_high, ours_low, plan.scale[1],
                target=Target("ratio", "<=", 1.2), note=note,
            ))
        if ctx.wants(SCALING_RAW):
            ctx.add(RowResult(
                SCALING_RAW, f"{raw_name} with {high:,} live blocks in the pool",
                f"the same with {low:,} live blocks", raw_high, raw_low, plan.scale[1], informational=True,
                note="informational: how the driver's own pool scales, measured in the same phases; " + note,
            ))
    finally:
        pool.close()


GROUPS: list[tuple[str, Callable[[Context], None], tuple[str, ...]]] = [
    ("stream-ordered allocation", group_async, (ASYNC, DRIVER_ASYNC)),
    ("synchronous allocation", group_direct, (DIRECT, DRIVER_DIRECT)),
    ("device actor", group_actor, (ACTOR, MANY, CLIENT, ACCESS)),
    ("cross-stream tracking", group_tracking, (TRACK, DRIVER_TRACK)),
    ("copies", group_copy, (H2D, H2D_DRIVER, D2D, D2D_UNTRACKED, D2D_DRIVER)),
    ("pipeline", group_pipeline, (PIPELINE,)),
    ("scaling", group_scaling, (SCALING, SCALING_RAW)),
    ("peers' allocators", group_peers, (CUDA_CORE, CUPY, TORCH)),
]


def row_names() -> Iterator[str]:
    for _, _, names in GROUPS:
        yield from names
