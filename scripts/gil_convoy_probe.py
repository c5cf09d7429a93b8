"""How the cost of a raw ``cuda.bindings`` call grows with the threads that make such calls.

Each ``cuda.bindings.driver`` call gives up the GIL around the C call and must win it back; with
several threads calling the driver, or one Python thread busy beside it, winning it back is what
a call costs. This probe times ``cuEventRecord`` + ``cuStreamWaitEvent`` pairs (each thread on its
own stream and event) from 1, 2 and 4 threads, and from one thread beside one pure-Python spinner,
at the default switch interval and at 0.1 ms; then the same pairs called through
``ctypes.PyDLL`` on the ``libcuda`` that cuda-bindings loaded, which keeps the GIL across the call.
It touches nothing of xlog_actors: it is the floor that any Python layer above ``cuda.bindings``
stands on, and the measurement behind the compiled core's rule of calling the driver's short entry
points without giving up the GIL (see docs/performance.md).

Usage, on a GPU machine:  python3 scripts/gil_convoy_probe.py

When to use: after an upgrade of cuda-bindings (or of CPython), to see whether a raw driver call
still pays for winning the GIL back when other threads run; that floor decides whether the
compiled core's own driver calls must keep holding the GIL. The bench never measures raw calls
under contention.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from typing import Any

from cuda.bindings import driver as cu


def _check(result: tuple[Any, ...]) -> Any:
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA call failed: {result[0]}")
    return result[1] if len(result) > 1 else None


def main() -> None:
    _check(cu.cuInit(0))
    ctx = _check(cu.cuDevicePrimaryCtxRetain(_check(cu.cuDeviceGet(0))))
    _check(cu.cuCtxSetCurrent(ctx))

    # PyDLL: ctypes keeps the GIL across the call (its CDLL gives it up, as cuda.bindings does).
    libcuda = ctypes.PyDLL("libcuda.so.1")
    record = libcuda.cuEventRecord
    record.argtypes, record.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    wait = libcuda.cuStreamWaitEvent
    wait.argtypes, wait.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int
    held = False

    def pairs(n: int, out: list[float]) -> None:
        _check(cu.cuCtxSetCurrent(ctx))
        stream = _check(cu.cuStreamCreate(1))
        event = _check(cu.cuEventCreate(2))
        s, e = int(stream), int(event)
        t = time.perf_counter()
        if held:
            for _ in range(n):
                record(e, s)
                wait(s, e, 0)
        else:
            for _ in range(n):
                cu.cuEventRecord(event, stream)
                cu.cuStreamWaitEvent(stream, event, 0)
        out.append((time.perf_counter() - t) / n * 1e6)
        _check(cu.cuStreamSynchronize(stream))

    def run(label: str, threads: int, spinners: int = 0, n: int = 20_000) -> None:
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        busy = [threading.Thread(target=spin) for _ in range(spinners)]
        for t in busy:
            t.start()
        out: list[float] = []
        workers = [threading.Thread(target=pairs, args=(n, out)) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        wall = time.perf_counter() - t0
        stop.set()
        for t in busy:
            t.join()
        per_thread = ", ".join(f"{us:.2f}" for us in out)
        print(f"{label:46s} µs per pair, per thread: {per_thread:32s} aggregate {threads * n / wall:>10,.0f} pairs/s")

    print("cuda.bindings (the GIL given up around each call):")
    run("1 thread", 1)
    run("2 threads", 2)
    run("4 threads", 4)
    run("1 thread beside 1 Python spinner", 1, spinners=1, n=2_000)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0001)
    run("the same, switch interval 0.1 ms", 1, spinners=1, n=2_000)
    sys.setswitchinterval(interval)
    print("ctypes.PyDLL (the GIL kept across each call):")
    held = True
    run("1 thread", 1)
    run("4 threads", 4)
    run("1 thread beside 1 Python spinner", 1, spinners=1, n=2_000)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
