"""``xlog-actors bench``: what users pay for this runtime beside what they would use instead.

Every row is measured in the same run as its reference (its "raw twin"), the two sampled
alternately so the machine's noise hits both, and reported as median, p99 and their ratio, with
the issue's target and pass/fail. A progress line goes to stderr, the table to stdout, and
``--json PATH`` writes everything (see ``docs/performance.md`` for what each row means).

``python -m xlog_actors.cli.bench profile [--driver host]`` runs the allocator, actor and tracking
hot paths under cProfile; ``... decompose`` times their pieces one by one (what
``docs/performance.md`` says the per-op cost is made of).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from ..driver.host import HostDriver
from ..driver.open import open_driver
from ..driver.protocol import Driver
from .bench_rows import GROUPS, Context, RowResult, Skipped, make_plan, row_names, timer_overhead_ns
from .info import versions

__all__ = ["HOST_MEMORY", "collect", "render_table", "run_bench"]

# The host driver's emulated device for the benchmarks: pages are committed only when touched,
# so a large window costs nothing until the scaling row's 100,000 live blocks use it.
HOST_MEMORY = 4 << 30


class _Progress:
    """One line on stderr, rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        stamp = f"[{time.perf_counter() - self.started:6.1f} s]"
        if self.tty:
            print(f"\r\033[K  bench {stamp} {text}", end="", file=sys.stderr, flush=True)
        else:
            print(f"  bench {stamp} {text}", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _open(kind: str | None) -> Driver:
    driver = open_driver(kind)  # type: ignore[arg-type]
    if driver.kind == "host":
        driver.close()
        driver = HostDriver(memory_per_device=HOST_MEMORY)  # type: ignore[assignment]
    return driver


def _selector(only: Sequence[str] | None):  # type: ignore[no-untyped-def]
    if not only:
        return lambda name: True
    needles = [n.lower() for n in only]
    return lambda name: any(n in name.lower() for n in needles)


def collect(driver: Driver, quick: bool, only: Sequence[str] | None = None, progress=None) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Run every selected row on ``driver``; the JSON document (rows as dicts)."""
    progress = progress or (lambda text: None)
    plan = make_plan(driver.kind, quick)
    wants = _selector(only)
    ctx = Context(driver, plan, wants, progress)
    errors: list[dict[str, str]] = []
    started = time.perf_counter()
    for title, group, names in GROUPS:
        if not any(wants(n) for n in names):
            continue
        progress(f"{title} ...")
        try:
            group(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken group must not hide the others
            errors.append(
                {"group": title, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
            progress(f"{title}: ERROR {type(exc).__name__}: {exc}")
    rows = [r for r in ctx.results if isinstance(r, RowResult)]
    skipped = [r for r in ctx.results if isinstance(r, Skipped)]
    doc: dict[str, Any] = {
        "device": driver.device_name(0),
        "driver": driver.kind,
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "method": {
            "clock": "time.perf_counter_ns",
            "timer_overhead_ns": timer_overhead_ns(),
            "gc": "gc.collect() then gc.disable() around every timed loop",
            "order": "ours and reference sampled alternately (ABBA)",
            "p99": "nearest-rank 99th percentile over samples; each sample averages ops_per_sample ops",
            "plan": dict(plan.__dict__.items()),
        },
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.to_json() for r in rows],
        "skipped": [{"name": s.name, "reason": s.reason} for s in skipped],
        "errors": errors,
    }
    if driver.kind == "cuda":
        doc["cuda_driver_version"] = _cuda_driver_version()
    return doc


def _cuda_driver_version() -> str | None:
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # noqa: BLE001 - informational only
        return None


def _fmt(value: float, unit: str) -> str:
    if unit == "us":
        return f"{value:,.3f} µs" if value < 10 else f"{value:,.1f} µs"
    return f"{value:,.2f} GB/s" if value < 100 else f"{value:,.0f} GB/s"


def render_table(doc: dict[str, Any]) -> str:
    """The table printed at the end of a run."""
    header = ("row", "median", "p99", "reference", "ref median", "ref p99", "ratio", "target", "")
    lines: list[tuple[str, ...]] = []
    for row in doc["rows"]:
        unit = row["unit"]
        ref = row["reference"]
        arrow = "↓" if row["direction"] == "lower_is_better" else "↑"
        target = row["target"]["text"] if row["target"] else "(info)"
        verdict = "" if row["pass"] is None else ("pass" if row["pass"] else "FAIL")
        lines.append((
            row["name"], _fmt(row["median"], unit), _fmt(row["p99"], unit), ref["name"],
            _fmt(ref["median"], unit), _fmt(ref["p99"], unit), f"{row['ratio']:.3f}x {arrow}", target, verdict,
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    # the reference names are long: cap that column and let it wrap into the next line instead
    widths[3] = min(widths[3], 46)

    def fmt(cols: tuple[str, ...]) -> list[str]:
        ref_name = cols[3]
        first = ref_name[: widths[3]]
        rest = ref_name[widths[3]:]
        out = ["  ".join(
            (c if i != 3 else first).ljust(widths[i]) if i in (0, 3, 7, 8) else c.rjust(widths[i])
            for i, c in enumerate(cols)
        ).rstrip()]
        indent = sum(widths[:3]) + 6
        while rest:
            out.append(" " * indent + rest[: widths[3]])
            rest = rest[widths[3]:]
        return out

    text = [
        (f"xlog-actors bench: driver {doc['driver']}, device {doc['device']}, {doc['date']}"
         f"{' (--quick)' if doc['quick'] else ''}"),
        "versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        "ratio = ours / reference: of times (↓, lower is better) or of bandwidths (↑, higher is better)",
        "",
    ]
    text += fmt(header)
    text.append("  ".join("-" * w for w in widths))
    for line in lines:
        text += fmt(line)
    for s in doc["skipped"]:
        text.append(f"skipped: {s['name']}: {s['reason']}")
    for e in doc["errors"]:
        text.append(f"ERROR in {e['group']}: {e['error']}")
    rated = [r for r in doc["rows"] if r["pass"] is not None]
    text.append(f"{sum(1 for r in rated if r['pass'])}/{len(rated)} targets met ({doc['seconds']} s)")
    return "\n".join(text)


def run_bench(args: argparse.Namespace) -> int:
    driver = _open(args.driver)
    progress = _Progress()
    only = getattr(args, "only", None)
    if only:
        known = list(row_names())
        unknown = [o for o in only if not any(o.lower() in n.lower() for n in known)]
        if unknown:
            print(f"xlog-actors bench: --only {unknown} matches no row; rows: {known}", file=sys.stderr)
            driver.close()
            return 2
    print(
        f"xlog-actors bench: driver {driver.kind} ({driver.device_name(0)}){', quick' if args.quick else ''}",
        file=sys.stderr,
    )
    try:
        doc = collect(driver, args.quick, only, progress)
    finally:
        progress.done()
        driver.close()
    print(render_table(doc))
    if args.json:
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if doc["errors"] else 0


# -- profiling ----------------------------------------------------------------------------------
def profile(kind: str | None, ops: int = 20_000, top: int = 18) -> None:
    """cProfile the allocator, actor and tracking hot paths on ``kind``'s driver and print the
    top functions of each by own time (cProfile inflates every call, so read the shares, not the
    absolute times)."""
    import cProfile
    import pstats

    from ..actors import Allocate, DeviceActor, GetClient
    from ..memory.async_resource import AsyncCudaResource
    from ..memory.block import Access, BlockId, StreamId
    from ..memory.direct import DirectCudaResource
    from ..memory.stream_pool import StreamPool

    driver = _open(kind)
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


def decompose(kind: str | None, number: int = 20_000) -> list[tuple[str, float]]:
    """Time the pieces of the hot paths one by one (``timeit``: GC off, best of 5, the empty
    loop subtracted) and print ns per call. The pieces overlap and interact (caches, the GIL),
    so their sum only approximates the whole; it says where the time goes."""
    import threading
    import timeit

    from ..actors import Allocate, DeviceActor, GetClient
    from ..actors.messages import Reclaim
    from ..driver.checks import check_device
    from ..memory import async_resource as ar
    from ..memory.async_resource import AsyncCudaResource
    from ..memory.block import Access, AllocTag, BlockId, Generation, StreamId, make_block
    from ..memory.stream_pool import StreamPool
    from .bench_rows import _Echo, _Plain

    driver = _open(kind)
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
    echo = _Echo.start()
    client: Any = device.ask(GetClient())
    ref = client.allocate(4096)
    gctx = ref.context
    lock = threading.Lock()
    live: dict[int, object] = {}
    pending: dict[StreamId, int] = {}
    sid = StreamId.DEFAULT
    tag = AllocTag.UNTAGGED
    gen = Generation.next()
    ns: dict[str, object] = dict(  # noqa: C408 - the names of a timeit namespace
        res=res, driver=driver, stream=stream, st2=st2, s2=s2, bid=bid, READ=Access.READ, event=event,
        pool=pool, Generation=Generation, Entry=ar._Entry, sid=sid, tag=tag, gen=gen, make_block=make_block,
        lock=lock, live=live, pending=pending, check_device=check_device, block=block, time=time,
        device=device, echo=echo, Allocate=Allocate, msg=Allocate(4096), client=client, ref=ref,
        gctx=gctx, Reclaim=Reclaim, plain=_Plain(), GpuRef=type(ref),
    )
    rows: list[tuple[str, str]] = []
    if driver.kind == "cuda":
        from cuda.bindings import driver as cu

        ns.update(cu=cu, h=cu.CUstream(stream.handle), h2=cu.CUstream(st2.handle),
                  cuev=cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))[1])
        from ..driver.checks import check_nbytes

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
        ("  _Entry(...) (with time.monotonic)", "Entry(gen, 4096, sid, tag)"),
        ("  time.monotonic()", "time.monotonic()"),
        ("  make_block(...)", "make_block(1, 0, sid, 4096, 256, tag, gen)"),
        ("  with lock: (empty)", "with lock: pass"),
        ("  check_device(...)", "check_device('x', 0, block)"),
        ("  live[ptr] = e; del live[ptr]", "live[1] = block; del live[1]"),
        ("  pending[sid] += n (get+set)", "pending[sid] = pending.get(sid, 0) + 4096"),
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
         "r = gctx.allocate(4096, sid, tag); r._mark_released(); gctx.free(r.block); del r"),
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

    from ..driver.kernel_library import SCALE_ADD_F32, launch_shape
    from .pipeline import ALPHA, BETA, expected, make_batch

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

    steps = [
        (f"pipeline batch ({nbytes >> 20} MiB): make_batch", lambda: make_batch(1, n)),
        ("  expected(...).tobytes()", lambda: expected(1, n).tobytes()),
        ("  copy_to_device + synchronize (snapshot incl.)", copy_in),
        ("  bytes(memoryview(batch)) (the snapshot alone)", lambda: bytes(memoryview(batch).cast("B"))),
        ("  launch SCALE_ADD_F32 + synchronize", kernel),
        ("  copy_to_host_into (preallocated) + synchronize", copy_out),
        ("  copy_to_host (new bytearray) + synchronize", copy_out_new),
        ("  compare out == want", lambda: out == want),
    ]
    big = np.ones(256 << 20 if driver.kind == "cuda" else 16 << 20, dtype=np.uint8)
    steps.append((f"bytes() of a {big.nbytes >> 20} MiB array (H2D snapshot)", lambda: bytes(memoryview(big))))
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


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlog_actors.cli.bench")
    parser.add_argument("what", choices=("profile", "decompose"))
    parser.add_argument("--driver", choices=("auto", "cuda", "host"), default="host")
    parser.add_argument("--ops", type=int, default=20_000)
    args = parser.parse_args(argv)
    if args.what == "profile":
        profile(args.driver, args.ops)
    else:
        decompose(args.driver, args.ops)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
