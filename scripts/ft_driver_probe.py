"""Does the CUDA driver's stream-ordered allocator scale with threads when Python has no GIL?

N threads (N = 1, 2, 4, 8) each run K allocate+free pairs through ``cuda.bindings.driver``:
``cuMemAllocFromPoolAsync(4096 bytes)`` on the device's default memory pool (or
``cuMemAllocAsync`` with ``--api async``, which takes the same pool) and ``cuMemFreeAsync`` of
that pointer, then ``cuStreamSynchronize`` of their stream. Every thread makes the device's primary
context current (``cuDevicePrimaryCtxRetain`` once, ``cuCtxSetCurrent`` in each thread). Two
variants:

* ``shared``: every thread on one stream made with ``cuStreamCreate`` (never the legacy default
  stream), each thread holding its own Python wrapper of that handle;
* ``own``: each thread on a stream of its own, made with ``cuStreamCreate`` in that thread;
* ``ownpool`` (``--variant ownpool`` or ``pools``): a stream and a memory pool per thread, made in
  that thread (does the pool's own lock serialize the threads?);
* ``control`` (``--variant control`` or ``all``): the same loop with two driver calls that leave the
  allocator alone (``cuCtxGetDevice``, ``cuStreamQuery`` of the thread's own stream): how far the
  interpreter and the bindings scale by themselves on that machine. (On 3.13t, threads that pass
  the same objects around, such as the ``CUresult`` member every call returns, contend on their
  reference counts.)

Streams are non-blocking (``CU_STREAM_NON_BLOCKING``). The threads set up and warm up first, then
start together at a ``threading.Barrier``; a sample's aggregate rate is N*K pairs over the wall
time from the first thread's leaving the barrier to the last one's end (its stream synchronized),
read by the threads themselves (``time.perf_counter``, one clock for all threads). Samples
alternate over N (1, 2, 4, 8, 1, 2, ...) and variant for ``--repeats`` rounds, a line each as it
ends; then a table per variant gives the median rate for each N and its ratio to N=1's median.

On a free-threaded CPython (3.13t, 3.14t) the threads run in parallel unless the GIL came back (an
extension that does not declare free-threading support turns it on at import; ``PYTHON_GIL=1``
forces it): the header says which. Run from the repository root::

    PYTHONPATH=.ft/site .ft/python/bin/python3 scripts/ft_driver_probe.py [--pairs K] [--repeats R]
    PYTHON_GIL=1 PYTHONPATH=.ft/site .ft/python/bin/python3 scripts/ft_driver_probe.py

Depends on the standard library and cuda.bindings only. A failed CUDA call ends the run with one
line naming the call and its error, and exit status 1 (2 when cuda.bindings does not import).

When to use: on a new CUDA driver, cuda-bindings or free-threaded CPython, to see whether the
driver's allocator now scales with threads once the GIL is gone (what would lift the ceiling of
the bench's concurrency rows). Run it four ways: GIL off and ``PYTHON_GIL=1``, each with the
default variants and with ``--variant control --repeats 3``; the control shows how far the
interpreter and the bindings scale without the allocator.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

THREAD_COUNTS = (1, 2, 4, 8)
ALLOC_BYTES = 4096
WARMUP_PAIRS = 2_000
CU_STREAM_NON_BLOCKING = 1
LABELS = {
    "shared": "one shared stream",
    "own": "a stream per thread",
    "ownpool": "a stream and a memory pool per thread (cuMemPoolCreate, release threshold at its maximum)",
    "control": "no allocator (cuCtxGetDevice + cuStreamQuery), a stream per thread",
}
VARIANTS = {"both": ("shared", "own"), "all": ("shared", "own", "control"), "pools": ("own", "ownpool")} | {
    v: (v,) for v in LABELS
}


class CudaError(RuntimeError):
    """A CUDA driver call returned an error."""


def _gil_enabled() -> bool | None:
    """Whether the GIL is on now; None before 3.13 (no ``sys._is_gil_enabled``)."""
    probe: Callable[[], bool] | None = getattr(sys, "_is_gil_enabled", None)
    return None if probe is None else probe()


def _free_threaded_build() -> bool:
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@dataclass
class Cuda:
    """The driver module and what every thread shares: the primary context, device, pool."""

    driver: Any
    device: Any
    ctx: Any
    pool: Any
    success: Any = field(init=False)

    def __post_init__(self) -> None:
        self.success = self.driver.CUresult.CUDA_SUCCESS

    def check(self, name: str, result: tuple[Any, ...]) -> Any:
        """The value(s) after the status of one driver call's result; CudaError on failure."""
        err = result[0]
        if err != self.success:
            raise CudaError(f"{name} failed: {_error_name(self.driver, err)}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]


def _error_name(driver: Any, err: Any) -> str:
    try:
        name_err, name = driver.cuGetErrorName(err)
    except Exception:  # noqa: BLE001 - only a label for the message
        return repr(err)
    if name_err != driver.CUresult.CUDA_SUCCESS:
        return repr(err)
    text = name.decode() if isinstance(name, bytes) else str(name)
    return f"{text} ({int(err)})"


def _open(driver: Any) -> Cuda:
    """cuInit, device 0, its primary context (current on this thread) and default pool."""
    cuda = Cuda(driver=driver, device=None, ctx=None, pool=None)
    cuda.check("cuInit", driver.cuInit(0))
    cuda.device = cuda.check("cuDeviceGet", driver.cuDeviceGet(0))
    cuda.ctx = cuda.check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(cuda.device))
    cuda.check("cuCtxSetCurrent", driver.cuCtxSetCurrent(cuda.ctx))
    cuda.pool = cuda.check("cuDeviceGetDefaultMemPool", driver.cuDeviceGetDefaultMemPool(cuda.device))
    return cuda


def _describe(cuda: Cuda) -> str:
    driver = cuda.driver
    name = cuda.check("cuDeviceGetName", driver.cuDeviceGetName(256, cuda.device))
    version = cuda.check("cuDriverGetVersion", driver.cuDriverGetVersion())
    text = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    return f"{text}, driver API {version // 1000}.{version % 1000 // 10}"


class Worker(threading.Thread):
    """One thread of a sample: set up and warm up, meet the others at the barrier, run ``pairs``."""

    def __init__(
        self, cuda: Cuda, api: str, pairs: int, barrier: threading.Barrier, shared: int | None, own_pool: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.own_pool = own_pool
        self.pool: Any = None  # this thread's own pool, to destroy after the sample
        self.cuda = cuda
        self.api = api
        self.pairs = pairs
        self.barrier = barrier
        self.shared = shared  # the shared stream's handle, or None for a stream of its own
        self.stream: Any = None  # this thread's stream, to destroy after the sample when its own
        self.began = 0.0  # perf_counter when this thread left the barrier
        self.ended = 0.0  # and when its stream had synchronized after the last pair
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which reports it
            self.error = exc
            self.barrier.abort()

    def _run(self) -> None:
        cuda, driver = self.cuda, self.cuda.driver
        cuda.check("cuCtxSetCurrent", driver.cuCtxSetCurrent(cuda.ctx))
        if self.shared is None:
            self.stream = cuda.check("cuStreamCreate", driver.cuStreamCreate(CU_STREAM_NON_BLOCKING))
            stream = self.stream
        else:
            stream = driver.CUstream(self.shared)  # a wrapper of this thread's own, same handle
        if self.own_pool:
            self.pool = _create_pool(cuda)
            pool = self.pool
        else:
            pool = driver.CUmemoryPool(int(cuda.pool))
        loop = {"pool": self._loop_pool, "async": self._loop_async, "control": self._loop_control}[self.api]
        loop(stream, pool, WARMUP_PAIRS)
        cuda.check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
        self.barrier.wait()
        self.began = time.perf_counter()
        loop(stream, pool, self.pairs)
        cuda.check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
        self.ended = time.perf_counter()

    def _loop_pool(self, stream: Any, pool: Any, pairs: int) -> None:
        driver, success = self.cuda.driver, self.cuda.success
        alloc, free, size = driver.cuMemAllocFromPoolAsync, driver.cuMemFreeAsync, ALLOC_BYTES
        for _ in range(pairs):
            err, ptr = alloc(size, pool, stream)
            if err != success:
                self.cuda.check("cuMemAllocFromPoolAsync", (err,))
            (err,) = free(ptr, stream)
            if err != success:
                self.cuda.check("cuMemFreeAsync", (err,))

    def _loop_control(self, stream: Any, pool: Any, pairs: int) -> None:
        del pool  # two driver calls that leave the allocator alone: the binding's and Python's share
        driver, success = self.cuda.driver, self.cuda.success
        get_device, query = driver.cuCtxGetDevice, driver.cuStreamQuery
        for _ in range(pairs):
            err, _device = get_device()
            if err != success:
                self.cuda.check("cuCtxGetDevice", (err,))
            (err,) = query(stream)
            if err != success:
                self.cuda.check("cuStreamQuery", (err,))

    def _loop_async(self, stream: Any, pool: Any, pairs: int) -> None:
        del pool  # cuMemAllocAsync takes the device's current pool: the default one here
        driver, success = self.cuda.driver, self.cuda.success
        alloc, free, size = driver.cuMemAllocAsync, driver.cuMemFreeAsync, ALLOC_BYTES
        for _ in range(pairs):
            err, ptr = alloc(size, stream)
            if err != success:
                self.cuda.check("cuMemAllocAsync", (err,))
            (err,) = free(ptr, stream)
            if err != success:
                self.cuda.check("cuMemFreeAsync", (err,))


@dataclass
class Sample:
    rate: float  # pairs per second, all threads together
    thread_rates: list[float]  # each thread's own pairs per second over its own loop


def _create_pool(cuda: Cuda) -> Any:
    """A memory pool of device 0 of its own, keeping freed memory as the default pool does here."""
    driver = cuda.driver
    props = driver.CUmemPoolProps()
    props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    props.handleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    pool = cuda.check("cuMemPoolCreate", driver.cuMemPoolCreate(props))
    threshold = driver.cuuint64_t((1 << 64) - 1)
    attr = driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    cuda.check("cuMemPoolSetAttribute", driver.cuMemPoolSetAttribute(pool, attr, threshold))
    return pool


def _sample(cuda: Cuda, api: str, threads: int, pairs: int, shared: Any, own_pool: bool = False) -> Sample:
    """One sample: ``threads`` workers of ``pairs`` pairs each; shared is a stream or None."""
    barrier = threading.Barrier(threads + 1)
    handle = None if shared is None else int(shared)
    workers = [Worker(cuda, api, pairs, barrier, handle, own_pool) for _ in range(threads)]
    for worker in workers:
        worker.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass  # a worker failed before the start: reported below
    for worker in workers:
        worker.join()
    for worker in workers:
        if worker.stream is not None:
            cuda.check("cuStreamDestroy", cuda.driver.cuStreamDestroy(worker.stream))
        if worker.pool is not None:
            cuda.check("cuMemPoolDestroy", cuda.driver.cuMemPoolDestroy(worker.pool))
    errors = [w.error for w in workers if w.error is not None]
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))  # the cause before its echoes
    if errors:
        raise errors[0]
    # The threads' own clock readings, not the main thread's: it may get the CPU (or the GIL) late.
    wall = max(w.ended for w in workers) - min(w.began for w in workers)
    return Sample(threads * pairs / wall, [pairs / (w.ended - w.began) for w in workers])


def _run(cuda: Cuda, api: str, variants: tuple[str, ...], pairs: int, repeats: int) -> None:
    """``repeats`` rounds, each of every variant at every thread count in turn (a line per sample
    as it ends, so that a run cut short still tells), then a table per variant of the medians."""
    shared = cuda.check("cuStreamCreate", cuda.driver.cuStreamCreate(CU_STREAM_NON_BLOCKING))
    samples: dict[tuple[str, int], list[Sample]] = {(v, n): [] for v in variants for n in THREAD_COUNTS}
    try:
        for round_ in range(1, repeats + 1):
            for variant in variants:
                for n in THREAD_COUNTS:
                    mode = "control" if variant == "control" else api
                    sample = _sample(
                        cuda, mode, n, pairs, shared if variant == "shared" else None, variant == "ownpool"
                    )
                    samples[variant, n].append(sample)
                    print(f"round {round_} {variant:>6} N={n}: {sample.rate:>12,.0f} pairs/s", flush=True)
    finally:
        cuda.check("cuStreamDestroy", cuda.driver.cuStreamDestroy(shared))
    for variant in variants:
        label = LABELS[variant]
        print(f"\n[{variant}] {label}: {pairs} pairs per thread, median of {repeats}")
        print(f"{'threads':>7} {'pairs/s':>12} {'x N=1':>7} {'per thread':>11}  all samples (pairs/s)")
        base = statistics.median(s.rate for s in samples[variant, 1])
        for n in THREAD_COUNTS:
            rate = statistics.median(s.rate for s in samples[variant, n])
            per_thread = statistics.median(r for s in samples[variant, n] for r in s.thread_rates)
            every = " ".join(f"{s.rate:,.0f}" for s in samples[variant, n])
            print(f"{n:>7} {rate:>12,.0f} {rate / base:>7.2f} {per_thread:>11,.0f}  {every}")


def _bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:  # noqa: BLE001 - a label only
        import cuda.bindings

        return str(getattr(cuda.bindings, "__version__", "unknown"))


def _header(gil_before: bool | None, gil_after: bool | None) -> None:
    print(f"python {sys.version.split()[0]} ({platform.python_implementation()}) at {sys.executable}")
    build = "free-threaded" if _free_threaded_build() else "with the GIL (not free-threaded)"
    print(f"build: {build}; sys._is_gil_enabled() = {gil_after} (before importing cuda.bindings: {gil_before})")
    print(
        f"cuda-bindings {_bindings_version()}; PYTHON_GIL={os.environ.get('PYTHON_GIL', '(unset)')}; "
        f"switch interval {sys.getswitchinterval() * 1000:g} ms; {os.cpu_count()} CPUs"
    )
    if _free_threaded_build() and gil_after:
        if os.environ.get("PYTHON_GIL") == "1":
            print("NOTE: GIL forced ON by PYTHON_GIL=1 (as asked): threads take turns")
        else:
            banner = "!" * 78
            print(
                f"{banner}\n!!! THE GIL IS ENABLED on a free-threaded build (an extension turned it back on"
                f"{' at import of cuda.bindings' if not gil_before else ''}).\n"
                f"!!! These figures are NOT no-GIL figures.\n{banner}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200_000, help="allocate+free pairs per thread per sample")
    parser.add_argument("--repeats", type=int, default=5, help="samples of each thread count")
    parser.add_argument(
        "--api",
        choices=("pool", "async"),
        default="pool",
        help="cuMemAllocFromPoolAsync on the default pool, or cuMemAllocAsync",
    )
    parser.add_argument(
        "--variant",
        choices=tuple(VARIANTS),
        default="both",
        help="both: shared and own; all: those and control; pools: own and ownpool",
    )
    args = parser.parse_args(argv)

    gil_before = _gil_enabled()
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        print(f"ft_driver_probe: cannot import cuda.bindings: {exc}", file=sys.stderr)
        return 2
    gil_after = _gil_enabled()
    _header(gil_before, gil_after)
    try:
        cuda = _open(driver)
        api = "cuMemAllocFromPoolAsync" if args.api == "pool" else "cuMemAllocAsync"
        print(f"device: {_describe(cuda)}; {api}({ALLOC_BYTES}) + cuMemFreeAsync, default pool")
        _run(cuda, args.api, VARIANTS[args.variant], args.pairs, args.repeats)
        cuda.check("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(cuda.device))
    except CudaError as exc:
        print(f"ft_driver_probe: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # e.g. cuda.bindings cannot load libcuda.so.1
        print(f"ft_driver_probe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    gil_end = _gil_enabled()
    if gil_end != gil_after:
        print(f"!!! sys._is_gil_enabled() changed during the run: {gil_after} -> {gil_end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
