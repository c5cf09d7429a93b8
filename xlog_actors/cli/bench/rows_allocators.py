"""The allocator rows: stream-ordered and synchronous allocation, the block cache (its rows and the
peers' share one measurement recipe, :func:`.rows_peers.ours_beside_raw`), cross-stream tracking
and scaling with live blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...driver.protocol import Driver, Event, Stream
from ...memory.async_resource import AsyncCudaResource
from ...memory.block import Access, BlockId, StreamId
from ...memory.direct import DirectCudaResource
from ...memory.history import MemoryHistory
from ...memory.stream_pool import StreamPool
from .harness import Context, Group, Op, Row, Setup, interleave
from .plan import SIZE, Plan
from .result import Target
from .rows_peers import ours_beside_raw, round_robin
from .twins import alloc_free_loop, check, cu, raise_unless_success, stream_ordered_twin

__all__ = ["ASYNC", "CACHE", "DIRECT", "SCALING", "TRACKING"]

REFERENCE_ITSELF = "on the host driver this is the reference itself"


# -- stream-ordered allocation ------------------------------------------------------------------
@dataclass
class _Async:
    driver: Driver
    res: AsyncCudaResource
    stream: Stream
    raw: Op
    raw_name: str


@contextlib.contextmanager
def _async(ctx: Context) -> Iterator[_Async]:
    pool = StreamPool(ctx.driver, 0)
    try:
        res = AsyncCudaResource(ctx.driver, 0, pool)
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        yield _Async(ctx.driver, res, stream, *stream_ordered_twin(ctx.driver, stream))
        res.reap_pending()
    finally:
        pool.close()


def _resource_pair(f: _Async | _Direct) -> Op:
    return alloc_free_loop(f.res.allocate, f.res.deallocate)


def _driver_share(name: str, measures: str, setup: Setup, op: Callable[[Any], Op], spec: Callable[[Plan], Any],
                  of_row: str) -> Row:
    """An informational row: the driver layer alone beside the same raw twin as ``of_row``.
    On the host driver the driver layer is the twin itself, so the row is skipped there."""
    return Row(name, measures, setup, op, lambda f: f.raw, spec, host_skip=REFERENCE_ITSELF,
               note=f"informational: the driver wrapper's share of the {of_row} row")


def _driver_async_pair(f: _Async) -> Op:
    d_alloc, d_free, stream = f.driver.alloc_async, f.driver.free_async, f.stream

    def via_driver(n: int) -> None:
        for _ in range(n):
            d_free(d_alloc(SIZE, stream), stream)

    return via_driver


@dataclass
class _History:
    on: AsyncCudaResource
    off: AsyncCudaResource
    history: MemoryHistory


@contextlib.contextmanager
def _history(ctx: Context) -> Iterator[_History]:
    """Two resources on one stream pool: one records into a memory history, one does not."""
    pool = StreamPool(ctx.driver, 0)
    try:
        on, off = AsyncCudaResource(ctx.driver, 0, pool), AsyncCudaResource(ctx.driver, 0, pool)
        history = MemoryHistory()
        on.set_history(history)
        yield _History(on, off, history)
        on.set_history(None)
        on.reap_pending()
        off.reap_pending()
    finally:
        pool.close()


def _history_on(f: _History) -> Op:
    return alloc_free_loop(f.on.allocate, f.on.deallocate)


def _history_off(f: _History) -> Op:
    return alloc_free_loop(f.off.allocate, f.off.deallocate)


def _history_check(f: _History) -> None:
    if f.history.recorded == 0:
        raise RuntimeError("the memory history recorded nothing")


ASYNC = Group("stream-ordered allocation", (
    Row("AsyncCudaResource alloc+free", "AsyncCudaResource.allocate(4 KiB) + deallocate on its default stream",
        _async, _resource_pair, lambda f: f.raw, lambda p: p.alloc, target=Target("ratio", "<=", 1.0),
        note="raw twin on the same stream handle; PyTorch's caching allocator is about 1.37x of raw on an H200"),
    _driver_share("driver alloc_async+free_async", "CudaDriver.alloc_async(4 KiB) + free_async: the driver layer "
                  "alone", _async, _driver_async_pair, lambda p: p.alloc, "AsyncCudaResource"),
    Row("AsyncCudaResource alloc+free, history on", "AsyncCudaResource.allocate(4 KiB) + deallocate recording into "
        "a MemoryHistory (time, stream, tag, size, address and the caller's stack, for both events)", _history,
        _history_on, _history_off, lambda p: p.alloc, reference="the same with the history off",
        target=Target("ratio", "<=", 2.0), check=_history_check,
        note="two resources on one stream pool, sampled alternately; the history's ring keeps 100,000 events (once "
        "full, each new one drops the oldest); the stack walked is the bench's own, a few frames deep"),
))


# -- the block cache -----------------------------------------------------------------------------
@dataclass
class _Cached:
    samples: dict[str, list[float]]
    raw_name: str


@contextlib.contextmanager
def _cached(ctx: Context) -> Iterator[_Cached]:
    """Every row of the group from one measurement, against one measurement of the raw twin."""
    with ours_beside_raw(ctx) as (ops, raw_name):
        samples, batch = ctx.plan.alloc
        yield _Cached(round_robin(ops, samples, batch, budget_s=2 * ctx.plan.budget_s,
                                  min_samples=ctx.plan.min_samples), raw_name)


def _from(name: str) -> Callable[[_Cached, Context], tuple[list[float], list[float]]]:
    return lambda f, ctx: (f.samples[name], f.samples["raw"])


_ONE_MEASUREMENT = ("one measurement of every row of the group and the raw twin: each round samples all of them once, "
                    "in a rotated order")

CACHE = Group("block cache", (
    Row("AsyncCudaResource through the cache alloc+free", "BlockCacheResource over AsyncCudaResource: allocate(4 KiB)"
        " + deallocate on its default stream, a cached size", _cached, None, None, lambda p: p.alloc,
        target=Target("ratio", "<=", 0.15), measure=_from("cache"), note=_ONE_MEASUREMENT),
    Row("DeviceClient through the cache allocate+free", "DeviceClient.allocate(4 KiB) + free of an async+cache "
        "device, a cached size", _cached, None, None, lambda p: p.alloc, target=Target("ratio", "<=", 0.2),
        measure=_from("client"), note=_ONE_MEASUREMENT),
    Row("AsyncCudaResource alloc+free, same measurement", "AsyncCudaResource.allocate(4 KiB) + deallocate without a "
        "cache, in the cache rows' measurement", _cached, None, None, lambda p: p.alloc, measure=_from("async"),
        note="informational: the uncached pair beside the cached ones; " + _ONE_MEASUREMENT),
))


# -- synchronous allocation ---------------------------------------------------------------------
@dataclass
class _Direct:
    driver: Driver
    res: DirectCudaResource
    raw: Op
    raw_name: str


def _raw_sync_pair(driver: Driver) -> tuple[Op, str]:
    if driver.kind == "cuda":
        cuda = cu()
        mem_alloc, mem_free = cuda.cuMemAlloc, cuda.cuMemFree
        check(cuda, mem_free(check(cuda, mem_alloc(SIZE), "cuMemAlloc")), "cuMemFree")

        def raw(n: int) -> None:
            for _ in range(n):
                err, ptr = mem_alloc(SIZE)
                (err2,) = mem_free(ptr)
            raise_unless_success(cuda, "cuMemAlloc/cuMemFree", err, err2)

        return raw, "raw cuMemAlloc+cuMemFree (cuda.bindings)"
    host_alloc, host_free = driver.alloc, driver.free

    def raw_host(n: int) -> None:
        for _ in range(n):
            host_free(0, host_alloc(0, SIZE))

    return raw_host, "HostDriver.alloc+free"


@contextlib.contextmanager
def _direct(ctx: Context) -> Iterator[_Direct]:
    yield _Direct(ctx.driver, DirectCudaResource(ctx.driver, 0), *_raw_sync_pair(ctx.driver))


def _driver_sync_pair(f: _Direct) -> Op:
    d_alloc, d_free = f.driver.alloc, f.driver.free

    def via_driver(n: int) -> None:
        for _ in range(n):
            d_free(0, d_alloc(0, SIZE))

    return via_driver


DIRECT = Group("synchronous allocation", (
    Row("DirectCudaResource alloc+free", "DirectCudaResource.allocate(4 KiB) + deallocate", _direct,
        _resource_pair, lambda f: f.raw, lambda p: p.direct, target=Target("ratio", "<=", 1.02)),
    _driver_share("driver alloc+free", "CudaDriver.alloc(0, 4 KiB) + free: the driver layer alone", _direct,
                  _driver_sync_pair, lambda p: p.direct, "DirectCudaResource"),
))


# -- cross-stream tracking ----------------------------------------------------------------------
@dataclass
class _Tracking:
    res: AsyncCudaResource
    bid: BlockId
    s2: StreamId
    st1: Stream
    st2: Stream
    raw: Op
    raw_name: str
    driver: Driver


def _raw_record_wait(driver: Driver, st1: Stream, st2: Stream, events: list[Any]) -> tuple[Op, str]:
    """The raw twin of tracking: record an event on ``st1``, wait for it on ``st2``. The event
    it creates is put in ``events`` (CUDA events are destroyed by the caller)."""
    if driver.kind == "cuda":
        cuda = cu()
        h1, h2 = cuda.CUstream(st1.handle), cuda.CUstream(st2.handle)
        flags = int(cuda.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        event = check(cuda, cuda.cuEventCreate(flags), "cuEventCreate")
        events.append(event)
        record, wait = cuda.cuEventRecord, cuda.cuStreamWaitEvent

        def raw(n: int) -> None:
            for _ in range(n):
                (err,) = record(event, h1)
                (err2,) = wait(h2, event, 0)
            raise_unless_success(cuda, "cuEventRecord/cuStreamWaitEvent", err, err2)

        return raw, "raw cuEventRecord+cuStreamWaitEvent (cuda.bindings)"
    host_event = driver.create_event(0)
    rec, wt = st1.record, st2.wait

    def raw_host(n: int) -> None:
        for _ in range(n):
            rec(host_event)
            wt(host_event)

    return raw_host, "HostStream.record(event) + other.wait(event)"


@contextlib.contextmanager
def _tracking(ctx: Context) -> Iterator[_Tracking]:
    driver = ctx.driver
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
        cuda_events: list[Any] = []
        try:
            yield _Tracking(res, bid, s2, st1, st2, *_raw_record_wait(driver, st1, st2, cuda_events), driver)
        finally:
            st1.synchronize()
            st2.synchronize()
            for event in cuda_events:
                cu().cuEventDestroy(event)
        res.deallocate(block)
        res.reap_pending()
    finally:
        pool.close()


def _prepare_finish(f: _Tracking) -> Op:
    prepare, finish, read, bid, s2 = f.res.prepare_block_use, f.res.finish_block_use, Access.READ, f.bid, f.s2

    def ours(n: int) -> None:
        for _ in range(n):
            prepare(bid, s2, read)  # waits on the write's (lazy) fence
            finish(bid, s2, read)  # re-records this stream's read event in place

    return ours


def _driver_record_wait(f: _Tracking) -> Op:
    d_event: Event = f.driver.create_event(0)
    d_record, d_wait = f.st1.record, f.st2.wait

    def via_driver(n: int) -> None:
        for _ in range(n):
            d_record(d_event)
            d_wait(d_event)

    return via_driver


TRACKING = Group("cross-stream tracking", (
    Row("cross-stream read prepare+finish", "AsyncCudaResource.prepare_block_use + finish_block_use, READ on a "
        "second stream of a block written on the first", _tracking, _prepare_finish, lambda f: f.raw,
        lambda p: p.event, target=Target("ratio", "<=", 1.2),
        note="steady state: one wait on the write's fence and one in-place re-record of the stream's read event "
        "per op"),
    _driver_share("driver record+wait", "CudaStream.record(event) + other.wait(event): the driver layer alone",
                  _tracking, _driver_record_wait, lambda p: p.event, "tracking"),
))


# -- scaling with live blocks -------------------------------------------------------------------
@dataclass
class _Scaling:
    raw_name: str
    ours_low: list[float] = field(default_factory=list)
    ours_high: list[float] = field(default_factory=list)
    raw_low: list[float] = field(default_factory=list)
    raw_high: list[float] = field(default_factory=list)


@contextlib.contextmanager
def _scaling(ctx: Context) -> Iterator[_Scaling]:
    """Both scaling rows come from one measurement: rounds of phases at the low and the high live
    count, alternating per round, ours and the raw pair alternating within a phase."""
    driver, plan = ctx.driver, ctx.plan
    low, high = plan.scale_low, plan.scale_high
    pool = StreamPool(driver, 0)
    try:
        res = AsyncCudaResource(driver, 0, pool)
        stream = pool.resolve(StreamId.DEFAULT)
        assert stream is not None
        alloc, dealloc = res.allocate, res.deallocate
        raw, raw_name = stream_ordered_twin(driver, stream)
        figures = _Scaling(raw_name)

        op = alloc_free_loop(alloc, dealloc)

        def measure(ours: list[float], twin: list[float]) -> None:
            samples, batch = plan.scale
            a, b = interleave(op, raw, samples, batch, budget_s=plan.budget_s / 2, min_samples=plan.min_samples)
            ours.extend(a)
            twin.extend(b)

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
        for r in range(max(1, plan.scale_rounds)):
            if r & 1:
                extra = grow()
                measure(figures.ours_high, figures.raw_high)
                shrink(extra)
                measure(figures.ours_low, figures.raw_low)
            else:
                measure(figures.ours_low, figures.raw_low)
                extra = grow()
                measure(figures.ours_high, figures.raw_high)
                shrink(extra)
        for block in base:
            dealloc(block)
        res.reap_pending()
        yield figures
    finally:
        pool.close()


def _scaling_note(f: Any, p: Any) -> str:
    return (f"phases alternate per round (the live set is grown to {p.scale_high:,} and shrunk back to "
            f"{p.scale_low:,} between them); within a phase ours and the raw pair alternate")


SCALING = Group("scaling", (
    Row("AsyncCudaResource scaling (live blocks)",
        lambda f, p: f"AsyncCudaResource.allocate(4 KiB) + deallocate with {p.scale_high:,} live blocks",
        _scaling, None, None, lambda p: p.scale, reference=lambda f, p: f"the same with {p.scale_low:,} live blocks",
        target=Target("ratio", "<=", 1.2), note=_scaling_note,
        measure=lambda f, ctx: (f.ours_high, f.ours_low)),
    Row("raw pair scaling (live blocks)", lambda f, p: f"{f.raw_name} with {p.scale_high:,} live blocks in the pool",
        _scaling, None, None, lambda p: p.scale, reference=lambda f, p: f"the same with {p.scale_low:,} live blocks",
        note=lambda f, p: "informational: how the driver's own pool scales, measured in the same phases; "
        + _scaling_note(f, p),
        measure=lambda f, ctx: (f.raw_high, f.raw_low)),
))
