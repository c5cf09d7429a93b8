"""What the memory history costs per event, apart from any driver: ``record_alloc`` +
``record_free`` of one block (a pair of events) from a stack a few frames deep, with ``max_frames``
1 and 8, and the same through ``AsyncCudaResource`` on the host driver, with the history on and off.

    python scripts/history_cost.py              # ns per pair (timeit, best of 7, GC off)

(From a checkout whose core is built in place, put it first: ``PYTHONPATH=. python scripts/...``.)

A count of instructions, which the machine's load does not move (the GPU-independent proxy):

    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p python scripts/history_cost.py --pairs-empty 20000
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p python scripts/history_cost.py --pairs 20000

The difference of the two totals (``callgrind_annotate FILE | head``, "PROGRAM TOTALS"), divided by
20,000, is the instructions of one pair of events (the first run makes the same loop calling
functions that do nothing).

When to use: after a change to the memory history (``xlog_actors.memory`` history recording, its
compiled ring), to see its cost per event without a GPU; the callgrind count is the figure to
compare on a loaded machine. The bench's ``history on`` row needs a GPU and is noisier.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable

import xlog_actors as xa
from xlog_actors._core.blocks import make_block
from xlog_actors.memory import AsyncCudaResource, MemoryHistory, StreamPool
from xlog_actors.memory.block import StreamId

DEPTH = 6  # user frames under the recording call, like a small application's


def _nested(depth: int, fn: Callable[[], float]) -> float:
    return _nested(depth - 1, fn) if depth else fn()


def _best_ns(fn: Callable[[], None], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e9


def _timed() -> None:
    block = make_block(0x10000, 0, StreamId(0), 4096, 256, xa.AllocTag("bench"), 1)
    print(f"python {sys.version.split()[0]}; ns per pair of events (alloc + free), {DEPTH} user frames deep")
    for frames in (1, 8):
        history = MemoryHistory(max_frames=frames)

        def pair(h: MemoryHistory = history) -> None:
            h.record_alloc(block)
            h.record_free(block)

        ns = _nested(DEPTH, lambda p=pair: _best_ns(p, 50_000))
        print(f"record_alloc + record_free, max_frames={frames:<2d}      {ns:8.0f}")
    driver = xa.HostDriver(device_count=1, memory_per_device=64 << 20)
    pool = StreamPool(driver, 0)
    on, off = AsyncCudaResource(driver, 0, pool), AsyncCudaResource(driver, 0, pool)
    on.set_history(MemoryHistory())
    for label, res in (("AsyncCudaResource pair, history off", off), ("AsyncCudaResource pair, history on ", on)):
        ns = _nested(DEPTH, lambda r=res: _best_ns(lambda: r.deallocate(r.allocate(4096)), 10_000))
        print(f"{label} (host driver)  {ns:8.0f}")
        res.reap_pending()
    pool.close()
    driver.close()


def _pairs(n: int, empty: bool) -> None:
    block = make_block(0x10000, 0, StreamId(0), 4096, 256, xa.AllocTag("bench"), 1)
    history = MemoryHistory()
    record_alloc, record_free = (
        (lambda b: None, lambda b: None) if empty else (history.record_alloc, history.record_free)
    )

    def run() -> float:
        for _ in range(n):
            record_alloc(block)
            record_free(block)
        return 0.0

    _nested(DEPTH, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, help="make this many pairs of events, untimed (for callgrind)")
    parser.add_argument("--pairs-empty", type=int, help="the same loop calling functions that do nothing")
    args = parser.parse_args()
    if args.pairs is not None:
        _pairs(args.pairs, empty=False)
    elif args.pairs_empty is not None:
        _pairs(args.pairs_empty, empty=True)
    else:
        _timed()


if __name__ == "__main__":
    main()
