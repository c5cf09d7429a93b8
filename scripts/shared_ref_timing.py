"""What handles across processes cost: exporting a ``GpuRef`` (pickling it),
opening it in another process (the first time, which maps the owner's segments, CUDA IPC handles
or pool, then later ones), and ``access()`` of the opened handle beside a ``GpuRef``'s.

    python scripts/shared_ref_timing.py [host|cuda|cuda-pool]

``host`` (the default) runs a host driver with ``shared=True``; ``cuda`` a GPU device on the
``direct`` stack (legacy CUDA IPC: every open maps its own IPC handle, each handle being a
distinct allocation); ``cuda-pool`` a GPU device on the ``async`` stack of a
``CudaDriver(ipc_pool=True)``: the first open fetches the pool's fd from the owner's fd server
and imports the pool, later ones import one block each (``cuMemPoolImportPointer``). The
consumer is a spawned process that imported everything, and on CUDA retained its context
(reported apart), before the clock starts. Targets on a GPU: open <= 5 ms the first time,
<= 50 us later.

When to use: after a change to shared handles (``xlog_actors.actors.shared_ref``, the CUDA IPC
importer, the pool's fd server), to check those open-time targets; the bench's
``cross-process read`` row times reads through an opened handle, not the opening.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import time
from multiprocessing.connection import Connection

import pykka

import xlog_actors as xa

HANDLES = 200


def _consumer(conn: Connection) -> None:
    import xlog_actors.actors.shared_ref  # noqa: F401 - imported before the clock starts

    blobs, kind = conn.recv()
    retain_s = 0.0
    if kind != "host":
        from xlog_actors.driver.cuda.importer import make_current

        start = time.perf_counter()
        make_current(0)  # the consumer's own context: a one-off per process, reported apart
        retain_s = time.perf_counter() - start
    times = []
    for blob in blobs:
        start = time.perf_counter()
        ref = pickle.loads(blob)
        if ref.export.driver == "host":
            ref.view(ordered=False)
        else:
            ref.raw_device_ptr()
        times.append(time.perf_counter() - start)
        ref.release()
    conn.send((times, retain_s))


def main(kind: str) -> None:
    """Print the figures for a device on driver ``kind``."""
    if kind not in ("host", "cuda", "cuda-pool"):
        raise SystemExit(f"unknown kind {kind!r}: host, cuda or cuda-pool")
    driver: xa.HostDriver | xa.CudaDriver
    if kind == "host":
        driver = xa.HostDriver(memory_per_device=64 << 20, shared=True)
    else:
        driver = xa.CudaDriver(ipc_pool=kind == "cuda-pool")
    device = xa.DeviceActor.start(0, driver, resource={"cuda": "direct", "cuda-pool": "async"}.get(kind))
    try:
        refs = [device.ask(xa.Allocate(4096)) for _ in range(HANDLES)]
        start = time.perf_counter()
        blobs = [pickle.dumps(ref) for ref in refs]
        export_s = (time.perf_counter() - start) / HANDLES
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=_consumer, args=(theirs,))
        process.start()
        mine.send((blobs, kind))
        if not mine.poll(120):
            raise TimeoutError("the consumer did not answer in 120 s")
        times, retain_s = mine.recv()
        process.join(30)
        later = sorted(times[1:])
        print(f"driver {kind}: export (pickle) {export_s * 1e6:.1f} us per handle")
        if kind != "host":
            print(f"consumer's primary-context retain (before the clock): {retain_s * 1e3:.1f} ms")
        print(
            f"open in another process: first {times[0] * 1e6:.0f} us; later median "
            f"{statistics.median(later) * 1e6:.1f} us, p90 {later[int(0.9 * len(later))] * 1e6:.1f} us"
        )
        shared = pickle.loads(pickle.dumps(refs[0]))
        n = 100_000
        start = time.perf_counter()
        for _ in range(n):
            shared.access()
        shared_ns = (time.perf_counter() - start) / n * 1e9
        start = time.perf_counter()
        for _ in range(n):
            refs[0].access()
        local_ns = (time.perf_counter() - start) / n * 1e9
        print(f"access(): SharedGpuRef {shared_ns:.0f} ns, GpuRef {local_ns:.0f} ns")
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="host", choices=("host", "cuda", "cuda-pool"),
                        help="the owner's device (default host)")
    main(parser.parse_args().kind)
