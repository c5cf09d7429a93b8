"""The host driver's copies between device memory and host buffers, alone: GB/s of 64 MiB copies
(issue #20: what a cross-node fetch pays on each side beside Ray's own transfer).

    PYTHONPATH=. python scripts/bench_host_copies.py [--mib N] [--reps N]

Prints, for each copy, the median GB/s of ``--reps`` timed copies (enqueue + synchronize) and the
range of their times, beside ``np.copyto`` of the same bytes (a plain memcpy) in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from xlog_actors.driver.host import HostDriver


def main() -> None:
    """Run the copies and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="bytes per copy, in MiB (default 64)")
    parser.add_argument("--reps", type=int, default=15, help="timed copies per row (default 15)")
    args = parser.parse_args()
    n = args.mib << 20
    driver = HostDriver(1, max(1 << 30, 2 * n))
    try:
        stream = driver.create_stream(0)
        ptr = driver.alloc(0, n)
        pageable = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        out = np.ones(n, np.uint8)
        pinned = np.frombuffer(driver.pinned_view(driver.alloc_pinned(0, n), n), np.uint8)

        def timed(op: Callable[[], object]) -> list[float]:
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                op()
                stream.synchronize()
                times.append(time.perf_counter() - t0)
            return sorted(times)

        rows: list[tuple[str, Callable[[], object]]] = [
            ("copy_to_device, pageable", lambda: driver.copy_to_device(ptr, pageable, stream)),
            ("copy_to_device, pinned", lambda: driver.copy_to_device(ptr, pinned, stream)),
            ("copy_to_host_into, pageable", lambda: driver.copy_to_host_into(ptr, out, stream)),
            ("copy_to_host_into, pinned", lambda: driver.copy_to_host_into(ptr, pinned, stream)),
            ("copy_to_host (a new bytearray)", lambda: driver.copy_to_host(ptr, n, stream)),
            ("np.copyto (reference)", lambda: np.copyto(out, pageable)),
        ]
        print(f"{args.mib} MiB, median of {args.reps}")
        for name, op in rows:
            times = timed(op)
            median = statistics.median(times)
            print(
                f"{name:32s} {n / median / 1e9:6.2f} GB/s   "
                f"{times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f} ms (median {median * 1e3:.1f} ms)"
            )
    finally:
        driver.close()


if __name__ == "__main__":
    main()
