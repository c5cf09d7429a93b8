"""What the compiled core itself costs, on any machine with a C compiler: its CUDA fast path
driven through entry points that do nothing (a tiny C library built here), so what is timed is
the core's own work per call, without the driver's.

    python scripts/core_overhead.py

It prints ns per operation (``timeit``, best of 7, GC off) for the resource pair, the tracking
pair, the direct pair and the calls underneath; add a GPU's raw driver pair (the bench's twin)
to read the ratio the bench would give. Stand-ins carry the attributes ``CudaDriver.fast_path``
documents (see tests/memory/test_cuda_fast_path.py).

When to use: after a change to ``xlog_actors/_core`` or ``xlog_actors/memory``, to see what it
did to the core's own ns per call without a GPU (the bench's allocator rows need one). Needs
``cc`` on the path.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import threading
import timeit
from pathlib import Path
from typing import Any

from xlog_actors.driver.cuda.context import Stamped
from xlog_actors.driver.cuda.current import TOKEN_WRITES
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource, MemoryHistory
from xlog_actors.memory.block import Access, BlockId, StreamId

_C = r"""
typedef unsigned long long u64;
static u64 next = 0x10000;
int alloc_from_pool(u64 *p, unsigned long n, void *pool, void *s) { *p = (next += 0x1000); return 0; }
int mem_alloc(u64 *p, unsigned long n) { *p = (next += 0x1000); return 0; }
int nop2(void *a, void *b) { return 0; }
int nop3(void *a, void *b, unsigned c) { return 0; }
int nop1(u64 a) { return 0; }
"""


class Device(Stamped):
    """A device stand-in; ``Stamped`` keeps ``CudaDevice``'s version-cell contract."""

    def __init__(self) -> None:
        self.ordinal, self.token, self.epoch, self.poisoned, self.pool = 0, object(), 1, None, 0xF00
        self.epoch_token = object()
        self.pool_live: set[int] = set()
        self.direct_live: set[int] = set()

    def fail(self, err: object, what: str, requested: int = 0) -> None:
        raise RuntimeError(f"{what}: {err}")


class Stream:
    def __init__(self, dev: Device, handle: int, sid: int) -> None:
        self._dev, self._epoch, self._closed, self._handle, self._id = dev, dev.epoch, None, handle, sid
        self._live = dev.epoch_token


class Event:
    def __init__(self, dev: Device, handle: int) -> None:
        self._dev, self._epoch, self._h, self._live = dev, dev.epoch, handle, dev.epoch_token


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
    device_ordinal = 0

    def __init__(self, streams: dict[StreamId, Any]) -> None:
        self.streams = streams

    def resolve(self, sid: StreamId) -> Any:
        return self.streams.get(sid)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "nop.c"), Path(tmp, "libnop.so")
        src.write_text(_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        c = ctypes.CDLL(str(lib))
        addr = {n: int(ctypes.cast(getattr(c, n), ctypes.c_void_p).value or 0) for n in
                ("alloc_from_pool", "mem_alloc", "nop1", "nop2", "nop3")}
        entry_points = {"cuMemAllocFromPoolAsync": addr["alloc_from_pool"], "cuMemFreeAsync": addr["nop2"],
                        "cuEventRecord": addr["nop2"], "cuStreamWaitEvent": addr["nop3"],
                        "cuMemAlloc": addr["mem_alloc"], "cuMemFree": addr["nop1"]}
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
        ns = {"recorded": recorded, "res": res, "direct": direct, "bid": bid, "s1": StreamId(1),
              "READ": Access.READ, "dev": dev}
        rows: list[tuple[str, str]] = [
            ("AsyncCudaResource allocate+deallocate", "res.deallocate(res.allocate(4096))"),
            ("  the same, memory history on", "recorded.deallocate(recorded.allocate(4096))"),
            ("cross-stream READ prepare+finish",
             "res.prepare_block_use(bid, s1, READ); res.finish_block_use(bid, s1, READ)"),
            ("DirectCudaResource allocate+deallocate", "direct.deallocate(direct.allocate(4096))"),
            ("  (a set add+discard, for scale)", "dev.pool_live.add(1); dev.pool_live.discard(1)"),
        ]
        print(f"python {sys.version.split()[0]}; ns per operation, no-op entry points (the core's own work)")
        for label, stmt in rows:
            n = 200_000
            t = min(timeit.repeat(stmt, globals=ns, number=n, repeat=7)) / n * 1e9
            print(f"{label:48s} {t:8.0f}")


if __name__ == "__main__":
    main()
