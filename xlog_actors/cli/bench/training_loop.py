"""One half of the training-loop rows, run as a process of its own that serves timed rounds:
``python -m xlog_actors.cli.bench.training_loop {device|torch|null|rmm} STEPS [CPU]``.

Why a process per half: PyTorch takes a pluggable allocator only before its first CUDA
allocation in a process, and never gives it back; so the loop through the device and the same
loop on torch's own caching allocator cannot share one.

The protocol, one line each way (:mod:`.training_session` drives it): the half sets up, runs one
untimed round, pins its main thread to ``CPU`` (when given, on Linux), runs a second untimed
round there, and prints ``{"ready": true, "cpu": ...}``. Then each line ``round`` on its input
runs one timed round of ``STEPS`` steps and prints its nanoseconds per step; ``stop`` (or the
input's end) ends it, after the half's own checks, with ``{"done": true, "what": "..."}``.
Exit status 3: torch cannot use CUDA here; 4: RMM cannot be used here (either way the row is
skipped with the message, printed last on standard error); 2: bad arguments; any other
failure is the row's error.

Why served rounds and one CPU: on the GPU machines, which are virtual, one CPU runs this loop up
to 1.5 times as long as another, and a process keeps its CPU; halves timed in separate processes
one after the other measured where each landed, not its allocator. Kept alive together and
pinned to the same CPU, the halves' rounds alternate, so each round of one half has the other's
beside it.

The halves:

* ``torch``: torch's own caching allocator, the reference.
* ``device``: torch allocating through a :class:`~xlog_actors.DeviceActor`
  (:func:`xlog_actors.interop.torch.use_device`); after the first round the allocator bridge's
  cache serves every size, as torch's own cache does. ``what`` carries its hits and misses, and
  the half fails if bytes are still counted under the tag after its cache is flushed.
* ``null``: torch through the cheapest allocator its pluggable interface can load
  (:mod:`xlog_actors._core.null_allocator`: a stack of freed blocks per size class, no lock, no
  bookkeeping): the ceiling of any allocator behind that interface.
* ``rmm``: RMM's torch allocator (``rmm.allocators.torch``, also a ``CUDAPluggableAllocator``)
  over RMM's pool (``PoolMemoryResource`` over ``CudaMemoryResource``, its default initial size),
  the setup RMM documents for PyTorch: a peer, not a twin.

A step is what a training step does to an allocator: allocate a tensor (sizes drawn once,
log-uniform from 4 KiB to 64 MiB, the same sequence in every half), compute on it (a fill), and
free the tensor of four steps before (four stay alive, as activations do). A round ends with a
device synchronize, inside its time.

Thread rule: a program; its one thread does everything.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_NO_CUDA", "EXIT_NO_RMM", "HALVES", "STEP_SIZES", "main", "step_sizes"]

#: How many distinct sizes the loop cycles through.
STEP_SIZES = 1024
#: The halves this program runs.
HALVES = ("device", "torch", "null", "rmm")
_LOW, _HIGH = 4 << 10, 64 << 20
_LIVE = 4
#: Exit statuses of a half that cannot run here (the row is skipped with its last stderr line).
EXIT_NO_CUDA = 3
EXIT_NO_RMM = 4


def step_sizes(count: int = STEP_SIZES, seed: int = 19) -> list[int]:
    """The loop's sizes: log-uniform in [4 KiB, 64 MiB], multiples of 512 bytes, fixed by ``seed``.

    Args:
        count: how many.
        seed: the generator's seed.
    Returns:
        the sizes.
    Thread rule: any thread.
    """
    rng = random.Random(seed)
    lo, hi = math.log(_LOW), math.log(_HIGH)
    return [max(_LOW, min(_HIGH, int(math.exp(rng.uniform(lo, hi))) // 512 * 512)) for _ in range(count)]


def _loop(torch: Any, steps: int, sizes: list[int]) -> int:
    """One round; returns its nanoseconds."""
    dev = torch.device("cuda", 0)
    empty, u8 = torch.empty, torch.uint8
    ring: list[Any] = [None] * _LIVE
    n = len(sizes)
    t0 = time.perf_counter_ns()
    for i in range(steps):
        x = empty(sizes[i % n], dtype=u8, device=dev)
        x.fill_(i & 0xFF)
        ring[i % _LIVE] = x  # drops the tensor of _LIVE steps before
    del x
    ring = [None] * _LIVE
    torch.cuda.synchronize()
    return time.perf_counter_ns() - t0


class _Skip(Exception):
    """This half cannot run here; its exit status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _said(text: str) -> Callable[[], str]:
    """A half's ``what`` that is known from its set-up on."""

    def what() -> str:
        return text

    return what


def _use_rmm(torch: Any) -> Callable[[], str]:
    """Make RMM's pool torch's allocator in this process; a function saying what ran."""
    try:
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        if rmm_torch_allocator is None:
            raise RuntimeError("rmm.allocators.torch has no allocator (torch or its CUDA not found by RMM)")
        rmm.mr.set_current_device_resource(rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource()))
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    except Exception as exc:  # any failure to set RMM up skips the peer row
        raise _Skip(EXIT_NO_RMM, f"RMM is not usable here: {type(exc).__name__}: {exc}") from exc
    return _said(
        f"PyTorch {torch.__version__} through RMM {rmm.__version__}'s torch allocator "
        "(PoolMemoryResource over CudaMemoryResource)"
    )


def _use_null(torch: Any) -> Callable[[], str]:
    """Make the null allocator torch's allocator in this process; a function saying what ran."""
    from ..._core import null_allocator

    libcuda = ctypes.CDLL("libcuda.so.1")
    null_allocator.configure(
        ctypes.cast(libcuda.cuMemAlloc_v2, ctypes.c_void_p).value or 0,
        ctypes.cast(libcuda.cuMemFree_v2, ctypes.c_void_p).value or 0,
    )
    torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
        null_allocator.library_path(), null_allocator.ALLOC_SYMBOL, null_allocator.FREE_SYMBOL))

    def what() -> str:
        figures = null_allocator.stats()
        return (f"PyTorch {torch.__version__} through the null allocator (a stack of freed blocks per size "
                f"class: {figures['hits']} hits, {figures['misses']} misses)")

    return what


class _DeviceHalf:
    """The device half's setup and end: a DeviceActor on the CUDA driver, torch routed to it."""

    def __init__(self, torch: Any) -> None:
        import xlog_actors as xa
        from xlog_actors.interop.torch import use_device

        self._torch = torch
        self._driver = xa.CudaDriver()
        self._device = xa.DeviceActor.start(0, self._driver)
        self._route = use_device(self._device)

    def finish(self) -> str:
        """What ran (the bridge's cache figures); flushes the cache and checks that the tag is
        back to 0 bytes.

        Raises:
            RuntimeError: bytes are still counted under the tag.
        """
        import xlog_actors as xa

        cache = self._route.cache_stats()
        what = (
            f"PyTorch {self._torch.__version__} through DeviceActor(0) (tag 'torch', {self._route.allocator!r}; the "
            f"bridge's cache: {cache['hits']} hits, {cache['misses']} misses, {cache['cached_bytes']} bytes cached)"
        )
        self._route.allocator.flush()  # the bridge's cache too
        stats: Any = self._device.ask(xa.GetStats())
        left = stats.report["by_tag"].get("torch", {}).get("nbytes", 0)
        if left:
            raise RuntimeError(f"{left} bytes still counted under 'torch' after the loop")
        return what

    def close(self) -> None:
        import pykka

        pykka.ActorRegistry.stop_all()
        self._driver.close()


def _pin(cpu: int | None) -> int | None:
    """Pin this (the calling) thread to ``cpu``; the CPU pinned to, or None where threads cannot
    be pinned (not Linux)."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, {cpu})  # 0: the calling thread only; threads started before keep theirs
    return cpu


def _serve(torch: Any, steps: int, cpu: int | None, rounds_in: Any, out: Any) -> None:
    """Warm up, pin, say ready, then run a round per ``round`` line until ``stop`` or the end."""
    sizes = step_sizes()
    _loop(torch, steps, sizes)
    pinned = _pin(cpu)
    _loop(torch, steps, sizes)
    print(json.dumps({"ready": True, "cpu": pinned}), file=out, flush=True)
    for line in rounds_in:
        command = line.strip()
        if command == "stop":
            return
        if command != "round":
            raise ValueError(f"training_loop: expected 'round' or 'stop', got {command!r}")
        print(_loop(torch, steps, sizes) / steps, file=out, flush=True)


def _usage(argv: list[str]) -> int:
    print(f"usage: training_loop {{{'|'.join(HALVES)}}} STEPS [CPU] (got {argv})", file=sys.stderr)
    return 2


def main(argv: list[str], rounds_in: Any = None, out: Any = None) -> int:
    """Run one half (see the module docstring).

    Args:
        argv: ``[half, steps]`` or ``[half, steps, cpu]``.
        rounds_in: where the ``round``/``stop`` lines come from (standard input by default).
        out: where the lines go (standard output by default).
    Returns:
        the exit status.
    Thread rule: the program's main thread.
    """
    if len(argv) not in (2, 3) or argv[0] not in HALVES or not all(a.isdigit() for a in argv[1:]):
        return _usage(argv)
    half, steps = argv[0], int(argv[1])
    cpu = int(argv[2]) if len(argv) == 3 else None
    if steps < 1:
        return _usage(argv)
    rounds_in = sys.stdin if rounds_in is None else rounds_in
    out = sys.stdout if out is None else out
    import torch

    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False", file=sys.stderr)
        return EXIT_NO_CUDA
    device: _DeviceHalf | None = None
    try:
        what: Callable[[], str]
        if half == "torch":
            what = _said(f"PyTorch {torch.__version__} caching allocator")
        elif half == "rmm":
            what = _use_rmm(torch)
        elif half == "null":
            what = _use_null(torch)
        else:
            device = _DeviceHalf(torch)
            what = device.finish
        _serve(torch, steps, cpu, rounds_in, out)
        print(json.dumps({"done": True, "what": what()}), file=out, flush=True)
        return 0
    except _Skip as skip:
        print(str(skip), file=sys.stderr)
        return skip.status
    finally:
        if device is not None:
            device.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
