"""The two concurrency rows of the bench at several sample lengths, side by side in one process.

A sample of ``DeviceClient 8 threads / 1 thread`` gives each thread a *share* of pairs and starts
and joins them at barriers; ``Allocate 16 workers / 1 worker`` does the same with worker actors.
Under one GIL the threads of a sample run one after the other, so a sample whose shares are
shorter than the interpreter's switch interval (5 ms) holds one GIL hand-off per thread, to a
thread that is asleep, besides the work. This probe runs the rows' own crews and workers
(``xlog_actors.cli.bench.rows_concurrency``) with shares of several lengths, rounds of every case
alternating with garbage collection off, and prints for each length the median of the per-round
ratios (N threads / 1 thread, aggregate operations per second), both figures, and the
voluntary context switches (sleeps) of all the process's threads per 1000 operations on each
side (Linux: read from ``/proc``). The bench's
shares are the first length of each list.

    python3 scripts/scaling_probe.py [cuda|host] [--rounds N] [--switch-ms MS]

When to use: the bench's ``threads /`` or ``workers /`` ratio moved, to tell a real change from
the GIL hand-offs of short samples (``--switch-ms`` shows how much is the interpreter's forced
switches); the bench runs one sample length only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from xlog_actors.actors import DeviceActor, GetClient
from xlog_actors.cli.bench.rows_concurrency import THREADS, WORKERS, Crew, Worker, _ask_all
from xlog_actors.cli.bench.twins import alloc_free_loop
from xlog_actors.driver.open import open_driver

PAIR_SHARES = (200, 2_000, 20_000)  # allocate+free pairs per thread per sample
ASK_SHARES = (40, 400, 4_000)  # asks per worker per sample


def _switches() -> int:
    """Voluntary context switches of every thread of this process so far (a thread that sleeps
    for the GIL, a lock or a reply switches voluntarily)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def _rate(run: Callable[[int], None], share: int, ops: int, sleeps: list[float] | None = None) -> float:
    before = _switches() if sleeps is not None else 0
    t = time.perf_counter()
    run(share)
    rate = ops / (time.perf_counter() - t)
    if sleeps is not None:
        sleeps.append((_switches() - before) / ops * 1e3)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("driver", choices=("cuda", "host"), nargs="?", default="cuda")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--switch-ms", type=float, default=None,
                        help="the interpreter's switch interval for the run (diagnostic; default: unchanged)")
    args = parser.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    drv = open_driver(args.driver)
    device = DeviceActor.start(0, drv)
    client: Any = device.ask(GetClient())

    def make_op() -> Callable[[int], None]:
        return alloc_free_loop(client.allocate, client.free)

    many, one = Crew(make_op, THREADS), Crew(make_op, 1)
    workers = [Worker.start(device) for _ in range(WORKERS)]
    lone = Worker.start(device)
    cases: list[tuple[str, int, Callable[[int], None], Callable[[int], None], int]] = []
    for share in PAIR_SHARES:
        cases.append((f"DeviceClient {THREADS} threads, {share} pairs each", share, many.run, one.run, THREADS))
    for share in ASK_SHARES:
        cases.append((f"Allocate {WORKERS} workers, {share} asks each", share, _ask_all(workers),
                      _ask_all([lone]), WORKERS))
    ratios: dict[str, list[float]] = {c[0]: [] for c in cases}
    rates: dict[str, tuple[list[float], list[float]]] = {c[0]: ([], []) for c in cases}
    sleeps: dict[str, tuple[list[float], list[float]]] = {c[0]: ([], []) for c in cases}
    try:
        for _name, share, ours, ref, count in cases:  # warm-up
            ours(share)
            ref(share * count)
        gc.collect()
        gc.disable()
        for r in range(args.rounds):
            for name, share, ours, ref, count in cases:
                ops = share * count
                # ABBA within a round, so drift lands on both sides
                a1 = _rate(ours, share, ops, sleeps[name][0])
                b1 = _rate(ref, ops, ops, sleeps[name][1])
                b2 = _rate(ref, ops, ops)
                a2 = _rate(ours, share, ops)
                a, b = (a1 + a2) / 2, (b1 + b2) / 2
                ratios[name].append(a / b)
                rates[name][0].append(a)
                rates[name][1].append(b)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        gc.enable()
        many.close()
        one.close()
        for w in [*workers, lone]:
            w.stop()
        device.stop()
    print(f"driver {args.driver}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
          f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms, {args.rounds} rounds (median of per-round ratios)")
    for name, *_ in cases:
        ours_rates, ref_rates = rates[name]
        print(f"{name:45s} ratio {statistics.median(ratios[name]):.3f}x  (min {min(ratios[name]):.3f}, "
              f"max {max(ratios[name]):.3f})  ours {statistics.median(ours_rates) / 1e3:8.1f}k/s  "
              f"one {statistics.median(ref_rates) / 1e3:8.1f}k/s  sleeps per 1000 ops "
              f"{statistics.median(sleeps[name][0]):.1f} / {statistics.median(sleeps[name][1]):.1f}")


if __name__ == "__main__":
    main()
