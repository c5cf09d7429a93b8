"""One half of the "torch training loop through device" row (or of the "through RMM" peer row),
run in a process of its own:
``python -m xlog_actors.cli.bench.training_loop {device|torch|rmm} STEPS ROUNDS``.

Why a process per half: PyTorch takes a pluggable allocator only before its first CUDA
allocation in a process, and never gives it back; so the loop through the device and the same
loop on torch's own caching allocator cannot share one. Each half warms up with one untimed
round, then times ``ROUNDS`` rounds of ``STEPS`` steps, and prints one JSON line:
``{"ns_per_step": [...], "what": "..."}``. Exit status 3: torch cannot use CUDA here; 4: RMM
cannot be used here (either way the row is skipped with the message); any other failure is the
row's error.

The ``rmm`` half is the same loop on RMM's torch allocator (``rmm.allocators.torch``, also a
``CUDAPluggableAllocator``) over RMM's pool (``PoolMemoryResource`` over ``CudaMemoryResource``,
its default initial size), the setup RMM documents for PyTorch: a peer, not a twin.

A step is what a training step does to an allocator: allocate a tensor (sizes drawn once,
log-uniform from 4 KiB to 64 MiB, the same sequence in both halves), compute on it (a fill),
and free the tensor of four steps before (four stay alive, as activations do). A round ends
with a device synchronize, inside its time. Through the device, the allocator bridge's cache
serves torch's sizes after the first round (the untimed one), as torch's own cache does; the
JSON's ``what`` carries its hits and misses.

Thread rule: a program; its one thread does everything.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from typing import Any

__all__ = ["STEP_SIZES", "main", "step_sizes"]

#: How many distinct sizes the loop cycles through.
STEP_SIZES = 1024
_LOW, _HIGH = 4 << 10, 64 << 20
_LIVE = 4


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


_NO_RMM = 4


def _use_rmm(torch: Any) -> str:
    """Make RMM's pool torch's allocator in this process; what the half measures."""
    import rmm
    from rmm.allocators.torch import rmm_torch_allocator

    if rmm_torch_allocator is None:
        raise RuntimeError("rmm.allocators.torch has no allocator (torch or its CUDA not found by RMM)")
    rmm.mr.set_current_device_resource(rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource()))
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    return (
        f"PyTorch {torch.__version__} through RMM {rmm.__version__}'s torch allocator "
        "(PoolMemoryResource over CudaMemoryResource)"
    )


def main(argv: list[str]) -> int:
    """Run one half (see the module docstring).

    Args:
        argv: ``[half, steps, rounds]``, ``half`` being ``device`` or ``torch``.
    Returns:
        the exit status.
    Thread rule: the program's main thread.
    """
    half, steps, rounds = argv[0], int(argv[1]), int(argv[2])
    if half not in ("device", "torch", "rmm") or steps < 1 or rounds < 1:
        print(f"usage: training_loop {{device|torch|rmm}} STEPS ROUNDS (got {argv})", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False", file=sys.stderr)
        return 3
    sizes = step_sizes()
    if half == "torch":
        what = f"PyTorch {torch.__version__} caching allocator"
        _loop(torch, steps, sizes)
        times = [_loop(torch, steps, sizes) for _ in range(rounds)]
    elif half == "rmm":
        try:
            what = _use_rmm(torch)
        except Exception as exc:  # noqa: BLE001 - any failure to set RMM up skips the peer row
            print(f"RMM is not usable here: {type(exc).__name__}: {exc}", file=sys.stderr)
            return _NO_RMM
        _loop(torch, steps, sizes)
        times = [_loop(torch, steps, sizes) for _ in range(rounds)]
    else:
        import pykka

        import xlog_actors as xa
        from xlog_actors.interop.torch import use_device

        driver = xa.CudaDriver()
        try:
            device = xa.DeviceActor.start(0, driver)
            route = use_device(device)
            _loop(torch, steps, sizes)
            times = [_loop(torch, steps, sizes) for _ in range(rounds)]
            cache = route.cache_stats()
            what = (
                f"PyTorch {torch.__version__} through DeviceActor(0) (tag 'torch', {route.allocator!r}; the bridge's "
                f"cache: {cache['hits']} hits, {cache['misses']} misses, {cache['cached_bytes']} bytes cached)"
            )
            route.allocator.flush()  # the bridge's cache too
            stats: Any = device.ask(xa.GetStats())
            left = stats.report["by_tag"].get("torch", {}).get("nbytes", 0)
            if left:
                print(f"{left} bytes still counted under 'torch' after the loop", file=sys.stderr)
                return 1
        finally:
            pykka.ActorRegistry.stop_all()
            driver.close()
    print(json.dumps({"ns_per_step": [t / steps for t in times], "what": what}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
