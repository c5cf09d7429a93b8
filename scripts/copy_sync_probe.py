"""What waiting for a host-to-device copy costs, by the way one waits: raw calls side by side.

    python scripts/copy_sync_probe.py [MiB] [samples]     (CUDA only)
    python scripts/copy_sync_probe.py overhead

Each sample copies MiB from pinned memory to the device and then waits, one of these ways:
``sync``: cuStreamSynchronize; ``pageable1``: a 1-byte cuMemcpyDtoHAsync into pageable memory,
then cuStreamSynchronize (what a CopyToHost(nbytes=1) does); ``sync+pageable1``: synchronize
first, then the pageable byte; ``pinned1``: a 1-byte copy into pinned memory, then synchronize.
Then the CopyActor's own pattern (ask CopyToDevice + ask CopyToHost(nbytes=1)), and an ask of
CopyToDevice followed by a synchronize of the actor's stream. Prints medians in microseconds.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from cuda.bindings import driver as cu

from xlog_actors.actors import Allocate, CopyActor, CopyToDevice, CopyToHost, DeviceActor
from xlog_actors.actors.messages import AllocatePinned
from xlog_actors.driver import open_driver


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    nbytes = mib << 20
    driver = open_driver("cuda")
    device = DeviceActor.start(0, driver)
    copy = CopyActor.start(device)
    try:
        pinned = device.ask(AllocatePinned(nbytes))
        one = device.ask(AllocatePinned(64))
        ref = device.ask(Allocate(nbytes))
        dptr = ref.raw_device_ptr()
        stream = driver.create_stream(0)
        h = cu.CUstream(stream.handle)
        hp = pinned.array().ctypes.data
        onep = one.array().ctypes.data
        page = np.zeros(64, np.uint8)  # pageable
        pagep = page.ctypes.data

        def sync() -> None:
            cu.cuMemcpyHtoDAsync(dptr, hp, nbytes, h)
            cu.cuStreamSynchronize(h)

        def pageable1() -> None:
            cu.cuMemcpyHtoDAsync(dptr, hp, nbytes, h)
            cu.cuMemcpyDtoHAsync(pagep, dptr, 1, h)
            cu.cuStreamSynchronize(h)

        def sync_pageable1() -> None:
            cu.cuMemcpyHtoDAsync(dptr, hp, nbytes, h)
            cu.cuStreamSynchronize(h)
            cu.cuMemcpyDtoHAsync(pagep, dptr, 1, h)
            cu.cuStreamSynchronize(h)

        def pinned1() -> None:
            cu.cuMemcpyHtoDAsync(dptr, hp, nbytes, h)
            cu.cuMemcpyDtoHAsync(onep, dptr, 1, h)
            cu.cuStreamSynchronize(h)

        to_device, probe = CopyToDevice(ref, pinned), CopyToHost(ref, nbytes=1)
        copy.ask(to_device, timeout=30)  # through the actor: it has started
        actor = copy._actor_weakref()

        def actor_pattern() -> None:
            copy.ask(to_device)
            copy.ask(probe)

        def actor_then_sync() -> None:
            copy.ask(to_device)
            actor._stream.synchronize()

        ways = {
            "sync": sync, "pageable1": pageable1, "sync+pageable1": sync_pageable1, "pinned1": pinned1,
            "actor: CopyToDevice + CopyToHost(1)": actor_pattern, "actor: CopyToDevice + stream sync": actor_then_sync,
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(3):
            for fn in ways.values():
                fn()
        for _ in range(samples):
            for name, fn in ways.items():  # interleaved, so drift hits every way alike
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1e6)
        base = statistics.median(times["sync"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{name:40s} {m:9.1f} us  {m - base:+8.1f} us vs sync  ({nbytes / m / 1e3:.2f} GB/s)")
        stream.synchronize()
        stream.close()
    finally:
        copy.stop()
        device.stop()




def overhead(n: int = 3000) -> None:
    """``overhead`` mode: the CPU time of one served ``CopyToDevice`` of 4 KiB pinned and of one
    ``CopyToHost(nbytes=1)``, then a cProfile of the first (top 25 by own time)."""
    import cProfile
    import pstats

    driver = open_driver("cuda")
    device = DeviceActor.start(0, driver)
    copy = CopyActor.start(device)
    try:
        pinned = device.ask(AllocatePinned(4096))
        ref = device.ask(Allocate(4096))
        to_device, probe = CopyToDevice(ref, pinned), CopyToHost(ref, nbytes=1)
        copy.ask(to_device, timeout=30)
        for name, msg in (("CopyToDevice 4 KiB pinned", to_device), ("CopyToHost(nbytes=1)", probe)):
            for _ in range(200):
                copy.ask(msg)
            t = time.perf_counter()
            for _ in range(n):
                copy.ask(msg)
            print(f"{name:30s} {(time.perf_counter() - t) / n * 1e6:7.2f} us per ask (served in the caller)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            copy.ask(to_device)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        copy.stop()
        device.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["overhead"]:
        overhead()
    else:
        main()
