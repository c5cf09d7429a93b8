"""What the compiled core itself costs, on any machine with a C compiler: its CUDA fast path
driven through entry points that do nothing (a tiny C library built here), so what is timed is
the core's own work per call, without the driver's.

    python scripts/core_overhead.py                  # every row
    python scripts/core_overhead.py --only cache     # the rows whose label contains "cache"

It prints ns per operation (``timeit``, best of 7, GC off) for the resource pair, the tracking
pair, the direct pair, the block cache's hit (``async+cache``: through the resource, and through
a ``DeviceClient`` of a host-driver device, since a hit makes no driver call) and the calls
underneath; add a GPU's raw driver pair (the bench's twin) to read the ratio the bench would give.
Then the client's cached pair from 8 threads at once against 1 thread (aggregate pairs per
second): with the GIL it cannot pass 1.0x, and what it loses below is hand-offs and contention.
Stand-ins carry the attributes ``CudaDriver.fast_path`` documents (see
tests/memory/test_cuda_fast_path.py).

A count of instructions, which the machine's load does not move:

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=builtin_eval \
        --callgrind-out-file=/tmp/cg.%p python scripts/core_overhead.py --only "(async+cache)" --pairs-empty 20000
    (the same with --pairs 20000)

The loop is the one thing the script evaluates with ``eval``, so only it is counted (the device
actor's threads idle meanwhile). The difference of the two totals (``callgrind_annotate FILE |
head``, "PROGRAM TOTALS"), divided by 20,000, is the instructions of one operation of the row
named, above the same loop calling two builtins that do nothing (name one row: the loops of
several add up).

When to use: after a change to ``xlog_actors/_core`` or ``xlog_actors/memory``, to see what it
did to the core's own ns per call without a GPU (the bench's allocator rows need one). Needs
``cc`` on the path.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xlog_actors._core.async_core import StreamsVersion
from xlog_actors.actors import DeviceActor, GetClient
from xlog_actors.driver.cuda.context import Stamped
from xlog_actors.driver.cuda.current import TOKEN_WRITES
from xlog_actors.driver.host import HostDriver
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource, MemoryHistory
from xlog_actors.memory.adaptors import BlockCacheResource
from xlog_actors.memory.block import Access, BlockId, StreamId

_C = r"""
typedef unsigned long long u64;
static u64 next = 0x10000;
int alloc_from_pool(u64 *p, unsigned long n, void *pool, void *s) { *p = (next += 0x1000); return 0; }
int mem_alloc(u64 *p, unsigned long n) { *p = (next += 0x1000); return 0; }
int nop2(void *a, void *b) { return 0; }
int nop3(void *a, void *b, unsigned c) { return 0; }
int nop1(u64 a) { return 0; }
int nop_any(void) { return 0; }
int primary_state(int dev, unsigned *flags, int *active) { *flags = 0; *active = 1; return 0; }
"""

THREADS = 8  # as the bench's concurrency rows


class Device(Stamped):
    """A device stand-in; ``Stamped`` keeps ``CudaDevice``'s version-cell contract."""

    def __init__(self) -> None:
        self.ordinal, self.token, self.epoch, self.poisoned, self.pool = 0, object(), 1, None, 0xF00
        self.epoch_token = object()
        self.pool_live: set[int] = set()
        self.direct_live: set[int] = set()
        self.cudev = 0

    def fail(self, err: object, what: str, requested: int = 0) -> None:
        raise RuntimeError(f"{what}: {err}")


class Stream:
    def __init__(self, dev: Device, handle: int, sid: int) -> None:
        self._dev, self._epoch, self._closed, self._handle, self._id = dev, dev.epoch, None, handle, sid
        self._live = dev.epoch_token


class Event:
    def __init__(self, dev: Device, handle: int) -> None:
        self._dev, self._epoch, self._h, self._live = dev, dev.epoch, handle, dev.epoch_token


class EntryPoints(dict[str, int]):
    """The entry points by name; a name the core asks for that none here plays does nothing."""

    def __init__(self, known: dict[str, int], nop: int) -> None:
        super().__init__(known)
        self.nop = nop

    def __missing__(self, name: str) -> int:
        return self.nop


class Driver:
    def __init__(self, entry_points: dict[str, int], dev: Device, tls: threading.local) -> None:
        self.entry_points, self.dev, self.tls, self._closed, self.n = entry_points, dev, tls, False, 0

    def fast_path(self, ordinal: object) -> tuple[Any, ...]:
        # The CUDA driver's own count of token writes: nothing here writes a token after setup.
        return (self.entry_points, self.dev, self.tls, Stream, Event, int, TOKEN_WRITES)

    def create_event(self, ordinal: int) -> Event:
        self.n += 1
        return Event(self.dev, 0xE000 + self.n)


class Pool:
    """A stream pool's stand-in: its streams and its version, as ``StreamPool`` gives them."""

    device_ordinal = 0

    def __init__(self, streams: dict[StreamId, Any]) -> None:
        self.streams = streams
        self.streams_version = StreamsVersion()

    def resolve(self, sid: StreamId) -> Any:
        return self.streams.get(sid)


def _pairs_per_s(op: Callable[[int], None], threads: int, n: int) -> float:
    """Aggregate operations per second of ``threads`` threads each running ``op(n)``, released
    together by a barrier: from the first thread's start to the last one's end."""
    go = threading.Barrier(threads)
    starts: list[float] = []
    ends: list[float] = []

    def run() -> None:
        go.wait()
        starts.append(time.perf_counter())
        op(n)
        ends.append(time.perf_counter())

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * n / (max(ends) - min(starts))


def _scaling(op: Callable[[int], None], threads: int, pairs: int, rounds: int) -> tuple[float, float, float]:
    """``threads`` threads sharing ``pairs`` operations against one thread running them all, in
    rounds ordered ABBA so drift lands on both: the median of the rounds' ratios, and the best
    rate of each side."""
    ratios, many, one = [], [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {}
        for is_many in order:
            got[is_many] = _pairs_per_s(op, threads, pairs // threads) if is_many else _pairs_per_s(op, 1, pairs)
        many.append(got[True])
        one.append(got[False])
        ratios.append(got[True] / got[False])
    return statistics.median(ratios), max(many), max(one)


def _loop(alloc: Callable[[int], Any], free: Callable[[Any], Any]) -> Callable[[int], None]:
    def op(n: int) -> None:
        for _ in range(n):
            free(alloc(4096))

    return op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="the rows whose label contains NAME (case-insensitive); repeatable")
    parser.add_argument("--pairs", type=int, metavar="N", help="run the rows chosen N times each, untimed "
                        "(for callgrind)")
    parser.add_argument("--pairs-empty", type=int, metavar="N", help="the same set-up and loop, calling two "
                        "builtins that do nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "nop.c"), Path(tmp, "libnop.so")
        src.write_text(_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        c = ctypes.CDLL(str(lib))
        addr = {n: int(ctypes.cast(getattr(c, n), ctypes.c_void_p).value or 0) for n in
                ("alloc_from_pool", "mem_alloc", "nop1", "nop2", "nop3", "nop_any", "primary_state")}
        entry_points = EntryPoints({
            "cuMemAllocFromPoolAsync": addr["alloc_from_pool"], "cuMemFreeAsync": addr["nop2"],
            "cuEventRecord": addr["nop2"], "cuStreamWaitEvent": addr["nop3"], "cuMemAlloc": addr["mem_alloc"],
            "cuMemFree": addr["nop1"], "cuDevicePrimaryCtxGetState": addr["primary_state"],
        }, addr["nop_any"])
        dev, tls = Device(), threading.local()
        tls.token = dev.token
        driver = Driver(entry_points, dev, tls)
        s0, s1 = Stream(dev, 0x5000, 1), Stream(dev, 0x5100, 2)
        res = AsyncCudaResource(driver, 0, Pool({StreamId.DEFAULT: s0, StreamId(1): s1}))  # type: ignore[arg-type]
        recorded = AsyncCudaResource(driver, 0, Pool({StreamId.DEFAULT: s0, StreamId(1): s1}))  # type: ignore[arg-type]
        recorded.set_history(MemoryHistory())
        direct = DirectCudaResource(driver, 0)  # type: ignore[arg-type]
        block = res.allocate(4096)
        bid = BlockId.from_block(block)
        res.prepare_block_use(bid, StreamId(1), Access.READ)
        res.finish_block_use(bid, StreamId(1), Access.READ)
        cache = BlockCacheResource(AsyncCudaResource(driver, 0, Pool({StreamId.DEFAULT: s0})))  # type: ignore[arg-type]
        cache_recorded = BlockCacheResource(AsyncCudaResource(driver, 0, Pool({StreamId.DEFAULT: s0})))  # type: ignore[arg-type]
        cache_recorded.set_history(MemoryHistory())
        host = HostDriver(device_count=1, memory_per_device=64 << 20)
        device = DeviceActor.start(0, driver=host, resource="async+cache")
        client: Any = device.ask(GetClient())
        for c in (cache, cache_recorded):
            c.deallocate(c.allocate(4096))  # the miss: every timed pair after it is a hit
        client.free(client.allocate(4096))
        ns = {"recorded": recorded, "res": res, "direct": direct, "bid": bid, "s1": StreamId(1),
              "READ": Access.READ, "dev": dev, "cache_alloc": cache.allocate, "cache_free": cache.deallocate,
              "recorded_alloc": cache_recorded.allocate, "recorded_free": cache_recorded.deallocate,
              "client_alloc": client.allocate, "client_free": client.free}
        rows: list[tuple[str, str]] = [
            ("AsyncCudaResource allocate+deallocate", "res.deallocate(res.allocate(4096))"),
            ("  the same, memory history on", "recorded.deallocate(recorded.allocate(4096))"),
            ("cross-stream READ prepare+finish",
             "res.prepare_block_use(bid, s1, READ); res.finish_block_use(bid, s1, READ)"),
            ("DirectCudaResource allocate+deallocate", "direct.deallocate(direct.allocate(4096))"),
            ("  (a set add+discard, for scale)", "dev.pool_live.add(1); dev.pool_live.discard(1)"),
            # The methods bound once, as the bench's rows bind them.
            ("BlockCacheResource (async+cache) alloc+dealloc, a hit", "cache_free(cache_alloc(4096))"),
            ("BlockCacheResource hit, memory history on", "recorded_free(recorded_alloc(4096))"),
            ("DeviceClient through the cache allocate+free, a hit", "client_free(client_alloc(4096))"),
        ]
        chosen = [(label, stmt) for label, stmt in rows
                  if not args.only or any(o.lower() in label.lower() for o in args.only)]
        threads_row = f"DeviceClient through the cache {THREADS} threads / 1 thread"
        with_threads = not args.only or any(o.lower() in threads_row.lower() for o in args.only)
        try:
            count = args.pairs if args.pairs is not None else args.pairs_empty
            if count is not None:
                for _label, stmt in chosen:
                    # The empty loop makes the same two calls per pass, into builtins doing nothing.
                    code = "abs(abs(4096))" if args.pairs_empty is not None else stmt
                    # A function, so its names are the interpreter's cached globals (as timeit's
                    # are locals); called through ``eval``, so callgrind can count the call alone.
                    exec(f"def _run():\n    for _ in range({count}):\n        {code}\n", ns)
                    eval("_run()", ns)
                return
            print(f"python {sys.version.split()[0]}; ns per operation, no-op entry points (the core's own work)")
            for label, stmt in chosen:
                n = 200_000
                t = min(timeit.repeat(stmt, globals=ns, number=n, repeat=7)) / n * 1e9
                print(f"{label:56s} {t:8.0f}")
            if with_threads:
                ratio, many, one = _scaling(_loop(client.allocate, client.free), THREADS, 400_000, 9)
                print(f"{threads_row:56s} {ratio:8.3f}x  (median of 9 rounds; best {many / 1e3:.0f}k/s "
                      f"against {one / 1e3:.0f}k/s)")
        finally:
            device.stop()
            host.close()


if __name__ == "__main__":
    main()
