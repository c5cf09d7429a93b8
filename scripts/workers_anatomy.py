"""Where the time of the bench row ``Allocate 16 workers / 1 worker`` goes, thread by thread.

Runs the row's own ``Worker`` actors (16 of them, and 1) against one ``DeviceActor``, rounds of
the two alternating in one process with garbage collection off, and prints for each: the median
aggregate asks per second, the process's CPU per ask, and, from ``/proc/self/task/*/schedstat``
and ``status``, each kind of thread's CPU, run-queue wait (runnable but not running: on a machine
with idle cores, mostly waiting for the GIL is *not* in it, since a thread that waits for the GIL
sleeps), time slices and voluntary/involuntary context switches per ask, plus the device's batches
(``DeviceStats``). A worker sleeps once for its reply; a second voluntary switch per ask is a
sleep waiting for the GIL.

With ``--compare-futures`` the same rounds also alternate the future of the device's asks between
pykka's ``ThreadingFuture`` and ``LatchFuture`` (what ``DeviceActor`` uses), to read what the
cheaper reply is worth on this machine. With ``--compare-wakes`` they alternate
``pykka_internals.DEFER_WAKES`` (the askers of a batch woken together at its end, or each as its
message is served) instead.

Usage:  python3 scripts/workers_anatomy.py [host|cuda] [--rounds N] [--compare-futures | --compare-wakes]
(Linux only: it reads /proc.)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pykka

from xlog_actors.actors import DeviceActor, GetStats, pykka_internals
from xlog_actors.actors.latch_future import LatchFuture
from xlog_actors.cli.bench.rows_concurrency import WORKERS, Worker
from xlog_actors.driver import open_driver

_ASKS_MANY = 40  # asks per worker per round, as the bench's sample
_ASKS_ONE = WORKERS * _ASKS_MANY
_FIELDS = ("cpu", "runq", "slices", "vol", "invol")


def _tasks() -> dict[int, tuple[int, ...]]:
    """Per thread id: CPU ns, run-queue wait ns, time slices, voluntary and involuntary switches."""
    found: dict[int, tuple[int, ...]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                cpu, wait, slices = map(int, stat.read().split())
            with open(f"/proc/self/task/{tid}/status") as status:
                text = status.read()
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
        voluntary = int(text.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        involuntary = int(text.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        found[int(tid)] = (cpu, wait, slices, voluntary, involuntary)
    return found


def _kind(tid: int, names: dict[int | None, str]) -> str:
    name = names.get(tid, "other")
    if "DeviceActor" in name:
        return "device"
    if "Worker" in name:
        return "worker"
    return "main" if tid == threading.main_thread().native_id else "other"


def _round(workers: list[pykka.ActorRef[Any]], n: int) -> None:
    futures = [worker.ask(n, block=False) for worker in workers]
    for future in futures:
        future.get()


class _Tally:
    """What the rounds of one case (a worker count and a future) add up to."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.cpu_per_ask: list[float] = []
        self.threads: dict[str, list[int]] = {}
        self.asks = 0
        self.batches = self.batched = 0

    def add(self, device: pykka.ActorRef[Any], workers: list[pykka.ActorRef[Any]], n: int) -> None:
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        stats0: Any = device.ask(GetStats())
        before, cpu0, wall0 = _tasks(), time.process_time(), time.perf_counter()
        _round(workers, n)
        wall, cpu, after = time.perf_counter() - wall0, time.process_time() - cpu0, _tasks()
        stats1: Any = device.ask(GetStats())
        asks = len(workers) * n
        self.rates.append(asks / wall)
        self.cpu_per_ask.append(cpu / asks * 1e6)
        self.asks += asks
        self.batches += stats1.batches - stats0.batches
        self.batched += stats1.batched_messages - stats0.batched_messages
        for tid, now in after.items():
            if tid in before:
                sums = self.threads.setdefault(_kind(tid, names), [0] * len(_FIELDS))
                for i, (end, start) in enumerate(zip(now, before[tid], strict=True)):
                    sums[i] += end - start

    def report(self, label: str) -> None:
        print(
            f"{label}: {statistics.median(self.rates):9,.0f} asks/s (median), "
            f"{statistics.median(self.cpu_per_ask):6.1f} us of process CPU per ask; "
            f"{self.batched / self.asks:.0%} of asks in batches, mean batch "
            f"{self.batched / max(self.batches, 1):.1f}"
        )
        for kind, (cpu, runq, slices, vol, invol) in sorted(self.threads.items()):
            a = self.asks
            print(
                f"    {kind:7s} per ask: CPU {cpu / a / 1e3:6.2f} us, run-queue wait {runq / a / 1e3:6.2f} us, "
                f"slices {slices / a:5.2f}, voluntary switches {vol / a:5.2f}, involuntary {invol / a:5.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("driver", nargs="?", default="host", choices=["host", "cuda"])
    parser.add_argument("--rounds", type=int, default=30)
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--compare-futures", action="store_true")
    choice.add_argument("--compare-wakes", action="store_true")
    args = parser.parse_args()

    # Each case: the future of the device's asks, and whether a batch's wakes wait for its end.
    futures: dict[str, tuple[Callable[[], pykka.Future[Any]], bool]] = {"LatchFuture": (LatchFuture, True)}
    if args.compare_futures:
        futures["pykka ThreadingFuture"] = (pykka.ThreadingFuture, True)
    if args.compare_wakes:
        futures["LatchFuture, each asker woken as served"] = (LatchFuture, False)
    device = DeviceActor.start(0, open_driver(args.driver))
    many = [Worker.start(device) for _ in range(WORKERS)]
    one = [Worker.start(device)]
    tallies = {(name, count): _Tally() for name in futures for count in (WORKERS, 1)}
    own_future = DeviceActor.__dict__["_create_future"]
    try:
        _round(many, 20)
        _round(one, 200)
        gc.collect()
        gc.disable()
        for r in range(args.rounds):
            order = list(futures) if r % 2 == 0 else list(reversed(futures))
            for name in order:
                # pykka asks the actor class for each ask's future (``_create_future``).
                make, pykka_internals.DEFER_WAKES = futures[name]
                setattr(DeviceActor, "_create_future", staticmethod(make))  # noqa: B010
                tallies[(name, WORKERS)].add(device, many, _ASKS_MANY)
                tallies[(name, 1)].add(device, one, _ASKS_ONE)
    finally:
        gc.enable()
        setattr(DeviceActor, "_create_future", own_future)  # noqa: B010
        pykka_internals.DEFER_WAKES = True
        for worker in [*many, *one]:
            worker.stop()
        device.stop()
    print(f"{args.driver} driver, {os.cpu_count()} cores, {args.rounds} rounds of each case, alternating")
    for name in futures:
        many_tally, one_tally = tallies[(name, WORKERS)], tallies[(name, 1)]
        ratios = [m / o for m, o in zip(many_tally.rates, one_tally.rates, strict=True)]
        print(f"== {name}: {WORKERS} workers / 1 worker, median of per-round ratios {statistics.median(ratios):.2f}x")
        many_tally.report(f"  {WORKERS} workers")
        one_tally.report("  1 worker  ")


if __name__ == "__main__":
    main()
