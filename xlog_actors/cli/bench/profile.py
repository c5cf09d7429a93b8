"""Profiling and decomposition of the hot paths the bench rows measure.

``python -m xlog_actors.cli.bench profile [--driver host]`` runs the allocator, actor and tracking
hot paths under cProfile; ``... decompose`` times their pieces one by one (what
``docs/performance.md`` says the per-op cost is made of). Neither is a bench row: they explain
the rows' figures.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...driver.protocol import Driver
from ..driver_choice import KINDS, NoGpu, choose_driver
from ..options import EXIT_USAGE, OneLineParser, UsageError, at_least
from . import bench_driver

__all__ = ["decompose", "main", "profile"]


def _open(kind: str) -> Driver:
    return bench_driver(choose_driver(kind).driver)


def profile(driver: Driver, ops: int = 20_000, top: int = 18) -> None:
    """cProfile the allocator, actor and tracking hot paths and print the top functions of each
    by own time (cProfile inflates every call, so read the shares, not the absolute times).

    Args:
        driver: the driver to run on; closed when done.
        ops: operations per profiled loop (the actor and allocator loops run a tenth of it).
        top: functions printed per loop.
    Thread rule: the process's main thread.
    """
    import cProfile
    import pstats

    from ...actors import Allocate, DeviceActor, GetClient
    from ...memory.async_resource import AsyncCudaResource
    from ...memory.block import Access, BlockId, StreamId
    from ...memory.direct import DirectCudaResource
    from ...memory.stream_pool import StreamPool

    pool = StreamPool(driver, 0)
    res = AsyncCudaResource(driver, 0, pool)
    direct = DirectCudaResource(driver, 0)
    s2 = pool.acquire()
    block = res.allocate(4096)
    bid = BlockId.from_block(block)
    res.finish_block_use(bid, StreamId.DEFAULT, Access.WRITE)
    device = DeviceActor.start(0, driver)
    client: Any = device.ask(GetClient())
    ref = client.allocate(4096)

    def async_pair() -> None:
        for _ in range(ops):
            res.deallocate(res.allocate(4096))

    def direct_pair() -> None:
        for _ in range(ops // 10):
            direct.deallocate(direct.allocate(4096))

    def tracking() -> None:
        for _ in range(ops):
            res.prepare_block_use(bid, s2, Access.READ)
            res.finish_block_use(bid, s2, Access.READ)

    def actor_allocate() -> None:
        msg = Allocate(4096)
        for _ in range(ops // 10):
            r = device.ask(msg)
            del r

    def access() -> None:
        a = ref.access
        for _ in range(ops * 10):
            a()

    try:
        for name, fn in (("AsyncCudaResource allocate+deallocate", async_pair),
                         ("DirectCudaResource allocate+deallocate", direct_pair),
                         ("prepare+finish (cross-stream READ)", tracking),
                         ("DeviceActor Allocate + drop", actor_allocate),
                         ("GpuRef.access", access)):
            fn()  # warm
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            print(f"\n=== {name} ({driver.kind} driver) ===")
            pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    finally:
        client.free(ref)
        device.stop()
        res.deallocate(block)
        res.reap_pending()
        pool.close()
        driver.close()


def decompose(driver: Driver, number: int = 20_000) -> list[tuple[str, float]]:
    """Time the pieces of the hot paths one by one (``timeit``: GC off, best of 5, the empty
    loop subtracted) and print ns per call. The pieces overlap and interact (caches, the GIL),
    so their sum only approximates the whole; it says where the time goes.

    Args:
        driver: the driver to run on; closed when done.
        number: calls per timing (asks and tells: a tenth of it).
    Returns:
        ``(label, ns per call)`` per piece, in print order.
    Thread rule: the process's main thread.
    """
    import timeit

    from ...actors import Allocate, DeviceActor, GetClient
    from ...actors.messages import Reclaim
    from ...driver.checks import check_device
    from ...memory.async_resource import AsyncCudaResource
    from ...memory.block import Access, AllocTag, BlockId, Generation, StreamId
    from ...memory.stream_pool import StreamPool
    from .rows_actors import Echo, Plain

    pool = StreamPool(driver, 0)
    res = AsyncCudaResource(driver, 0, pool)
    stream: Any = pool.resolve(StreamId.DEFAULT)
    s2 = pool.acquire()
    st2: Any = pool.resolve(s2)
    block = res.allocate(4096)
    bid = BlockId.from_block(block)
    res.finish_block_use(bid, StreamId.DEFAULT, Access.WRITE)
    res.prepare_block_use(bid, s2, Access.READ)
    res.finish_block_use(bid, s2, Access.READ)
    event = driver.create_event(0)
    device = DeviceActor.start(0, driver)
    echo = Echo.start()
    client: Any = device.ask(GetClient())
    ref = client.allocate(4096)
    gctx = ref.context
    sid = StreamId.DEFAULT
    ns: dict[str, object] = dict(  # noqa: C408 - the names of a timeit namespace
        res=res, driver=driver, stream=stream, st2=st2, s2=s2, bid=bid, READ=Access.READ, event=event,
        pool=pool, Generation=Generation, AllocTag=AllocTag, sid=sid, check_device=check_device, block=block,
        device=device, echo=echo, Allocate=Allocate, msg=Allocate(4096), client=client, ref=ref,
        gctx=gctx, Reclaim=Reclaim, plain=Plain(), GpuRef=type(ref),
    )
    rows: list[tuple[str, str]] = []
    if driver.kind == "cuda":
        from cuda.bindings import driver as cu

        ns.update(cu=cu, h=cu.CUstream(stream.handle), h2=cu.CUstream(st2.handle),
                  cuev=cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))[1])
        from ...driver.checks import check_nbytes

        ns.update(check_nbytes=check_nbytes, cupool=stream._dev.pool, custream=stream._cu,
                  dptr=cu.cuMemAllocAsync(4096, cu.CUstream(stream.handle))[1])
        rows += [
            ("raw cuMemAllocAsync+cuMemFreeAsync", "cu.cuMemFreeAsync(cu.cuMemAllocAsync(4096, h)[1], h)"),
            ("raw cuMemAllocFromPoolAsync+cuMemFreeAsync (int ptr)",
             "cu.cuMemFreeAsync(int(cu.cuMemAllocFromPoolAsync(4096, cupool, custream)[1]), custream)"),
            ("  int(CUdeviceptr)", "int(dptr)"),
            ("  check_nbytes(4096)", "check_nbytes(4096)"),
            ("  driver._stream(stream)", "driver._stream(stream)"),
            ("  stream._enter() (epoch + context check)", "stream._enter()"),
            ("raw cuEventRecord+cuStreamWaitEvent", "cu.cuEventRecord(cuev, h); cu.cuStreamWaitEvent(h2, cuev, 0)"),
        ]
    rows += [
        ("driver.alloc_async+free_async", "driver.free_async(driver.alloc_async(4096, stream), stream)"),
        ("AsyncCudaResource allocate+deallocate", "res.deallocate(res.allocate(4096))"),
        ("  StreamPool.resolve", "pool.resolve(sid)"),
        ("  Generation.next()", "Generation.next()"),
        ("  check_device(...)", "check_device('x', 0, block)"),
        ("stream.record(ev)+st2.wait(ev) (driver)", "stream.record(event); st2.wait(event)"),
        (
            "prepare+finish cross-stream READ",
            "res.prepare_block_use(bid, s2, READ); res.finish_block_use(bid, s2, READ)",
        ),
        ("  prepare_block_use alone", "res.prepare_block_use(bid, s2, READ)"),
        ("  finish_block_use alone", "res.finish_block_use(bid, s2, READ)"),
        ("  st2.wait(ev) alone (driver)", "st2.wait(event)"),
        ("  st2.record(ev) alone (driver)", "st2.record(event)"),
        ("bare pykka ask", "echo.ask(msg)"),
        ("device.ask(Allocate) + drop", "r = device.ask(msg); del r"),
        ("  DeviceContext.allocate + free (no actor)",
         "r = gctx.allocate(4096, sid, AllocTag.UNTAGGED); r._mark_released(); gctx.free(r.block); del r"),
        ("  GpuRef._new (handle creation)", "GpuRef._new(block, gctx)._mark_released()"),
        ("  pykka tell (Reclaim to the device)", "echo.tell(Reclaim(block, 0))"),
        ("DeviceClient.allocate + free", "client.free(client.allocate(4096))"),
        ("GpuRef.access()", "ref.access()"),
        ("  no-op method call", "plain.get()"),
    ]
    results: list[tuple[str, float]] = []
    try:
        _decompose_batches(driver)
        empty = min(timeit.Timer("pass").repeat(5, number)) / number
        for label, stmt in rows:
            n = number // 10 if ("ask" in stmt or "tell" in stmt) else number
            best = min(timeit.Timer(stmt, globals=ns).repeat(5, n)) / n
            results.append((label, (best - empty) * 1e9))
            print(f"{label:48s} {results[-1][1]:9.0f} ns")
            if driver.kind == "host":
                stream.synchronize()
                st2.synchronize()
    finally:
        client.free(ref)
        echo.stop()
        device.stop()
        res.deallocate(block)
        stream.synchronize()
        st2.synchronize()
        res.reap_pending()
        pool.close()
        driver.close()
    return results


def _decompose_batches(driver: Driver) -> None:
    """Where a demo-pipeline batch and a large host-to-device copy spend their time: each step
    timed alone (median of 5), in ms."""
    import statistics

    import numpy as np

    from ...driver.kernel_library import SCALE_ADD_F32, launch_shape
    from ..batches import ALPHA, BETA, expected, make_batch

    nbytes = (16 << 20) if driver.kind == "cuda" else (1 << 20)
    n = nbytes // 4
    stream = driver.create_stream(0)
    d_in, d_out = driver.alloc(0, nbytes), driver.alloc(0, nbytes)
    out = bytearray(nbytes)
    batch = make_batch(1, n)
    want = expected(1, n).tobytes()
    grid, block = launch_shape(n)

    def copy_in() -> None:
        driver.copy_to_device(d_in, batch, stream)
        stream.synchronize()

    def kernel() -> None:
        driver.launch(SCALE_ADD_F32, grid, block, [d_out, d_in, ALPHA, BETA, n], stream)
        stream.synchronize()

    def copy_out() -> None:
        driver.copy_to_host_into(d_out, out, stream)
        stream.synchronize()

    def copy_out_new() -> None:
        driver.copy_to_host(d_out, nbytes, stream)
        stream.synchronize()

    steps: list[tuple[str, Callable[[], object]]] = [
        (f"pipeline batch ({nbytes >> 20} MiB): make_batch", lambda: make_batch(1, n)),
        ("  expected(...).tobytes()", lambda: expected(1, n).tobytes()),
        ("  copy_to_device + synchronize (snapshot incl.)", copy_in),
        ("  bytes(memoryview(batch)) (the snapshot alone)", lambda: bytes(batch.data.cast("B"))),
        ("  launch SCALE_ADD_F32 + synchronize", kernel),
        ("  copy_to_host_into (preallocated) + synchronize", copy_out),
        ("  copy_to_host (new bytearray) + synchronize", copy_out_new),
        ("  compare out == want", lambda: out == want),
    ]
    big = np.ones(256 << 20 if driver.kind == "cuda" else 16 << 20, dtype=np.uint8)
    steps.append((f"bytes() of a {big.nbytes >> 20} MiB array (H2D snapshot)", lambda: bytes(big.data)))
    target = np.empty_like(big)
    steps.append((f"np.copyto of {big.nbytes >> 20} MiB into a preallocated buffer", lambda: np.copyto(target, big)))
    try:
        copy_in()
        kernel()
        for label, fn in steps:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            print(f"{label:56s} {statistics.median(times) * 1e3:9.2f} ms")
    finally:
        stream.synchronize()
        driver.free(0, d_in)
        driver.free(0, d_out)
        stream.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xlog_actors.cli.bench profile|decompose [--driver host] [--ops N]``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    Returns:
        The exit status: 0, 1 where ``--driver cuda`` has no GPU, 2 for a bad flag.
    Raises:
        SystemExit: for ``--help`` and bad flags.
    Thread rule: the process's main thread.
    """
    parser = OneLineParser(prog="python -m xlog_actors.cli.bench")
    parser.add_argument("what", choices=("profile", "decompose"))
    parser.add_argument("--driver", choices=KINDS, default="host")
    parser.add_argument("--ops", type=at_least(10), default=20_000)
    args = parser.parse_args(argv)
    try:
        driver = _open(args.driver)
    except (UsageError, NoGpu) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else 1
    if args.what == "profile":
        profile(driver, args.ops)
    else:
        decompose(driver, args.ops)
    return 0
