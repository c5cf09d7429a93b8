"""Where the time of the bench row ``Allocate 16 workers / 1 worker`` goes, and what each way of
waking the askers would make of it: one run prints the 16/1 ratio of every variant side by side.

Runs the row's own ``Worker`` actors (16 of them, and 1) against one ``DeviceActor``, rounds of
every (variant, worker count) case alternating in one process with garbage collection off, and
prints for each case: the median aggregate asks per second, the wall time and the process's CPU
per ask, and, from ``/proc/self/task/*/schedstat`` and ``status``, each kind of thread's CPU,
run-queue wait (runnable but not running: on a machine with idle cores, waiting for the GIL is
mostly *not* in it, since a thread that waits for the GIL sleeps), time slices and
voluntary/involuntary context switches per ask, plus the device's batches (``DeviceStats``).
A worker sleeps once for its reply; a second voluntary switch per ask is a sleep for the GIL.

Variants (``--variants``, comma-separated; each is parts joined by ``+``):

* ``now``: the product: a ``LatchFuture`` per ask, a batch's askers woken together at its end.
* ``each``: each asker woken as its message is served (``DEFER_WAKES`` off).
* ``pykka``: pykka's own ``ThreadingFuture`` (what the device used before ``LatchFuture``).
* ``chain``: the batch's end wakes its first asker only; each asker wakes the next one as soon
  as its ``get`` has the GIL back, so the next one's wake-up overlaps the work of this one and
  at most two threads want the GIL at once.
* ``late``: as ``chain``, but each asker wakes the next one at its own next ask (just before it
  blocks again): the GIL is free by the time the next one runs, if a wake-up is quicker than
  the work left.
* ``spin``: an asker spins on its reply with the GIL released (``Doorbell``) for up to
  ``hot_waits.FUTURE_SPIN_S`` before it blocks, so it is running when the reply comes; the
  project's rule applies: nothing spins on fewer than ``hot_waits.MIN_CORES`` cores
  (``--force-spin`` overrides it, to test the mechanics on a small machine).
* ``devspin``: the device spins on its inbox for up to ``hot_waits.INBOX_SPIN_S`` before it
  sleeps between batches (same rule).
* ``gather``: before it takes a batch, the device waits (spinning, the GIL released) up to
  ``GATHER_S`` for an ask from each of the N workers of the case (it is told N: the product
  would have to count its active askers).

A chained asker whose predecessor never passes the wake on (it never calls ``get``, or never
asks again) opens itself ``CHAIN_FALLBACK_S`` after its batch ended: a stall is bounded.

How to read it: the variant with the highest ratio wins the row, but look at the 16-worker asks
per second too (a variant that speeds up the 1-worker twin more lowers the ratio while helping
everybody). "GIL idle" is wall minus process CPU per ask with 16 workers: time in which no
thread ran Python; spinning variants burn CPU while they wait, so their CPU overstates the work
and their idle time reads low.

Usage:  python3 scripts/workers_anatomy.py [host|cuda] [--rounds N] [--variants V,...]
        [--force-spin] [--detail]
(Linux only: it reads /proc.)

When to use: the bench's ``Allocate 16 workers / 1 worker`` row moved, or before changing how the
device wakes its askers (``DEFER_WAKES``, ``LatchFuture``, the hot waits): it compares every way
of waking side by side with each thread's CPU and sleeps; the bench measures the product only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pykka

from xlog_actors._core.doorbell import Doorbell
from xlog_actors.actors import DeviceActor, GetStats, hot_waits, pykka_internals
from xlog_actors.actors.latch_future import LatchFuture, _Result
from xlog_actors.cli.bench.rows_concurrency import WORKERS, Worker
from xlog_actors.driver import open_driver

_ASKS_MANY = 40  # asks per worker per round, as the bench's sample
_ASKS_ONE = WORKERS * _ASKS_MANY
_FIELDS = ("cpu", "runq", "slices", "vol", "invol")

#: The longest a ``gather`` device waits for more asks before it serves what it has.
GATHER_S = 50e-6
#: How long after its batch ended a chained asker opens itself when no predecessor woke it.
CHAIN_FALLBACK_S = 0.002

DEFAULT_VARIANTS = (
    "now", "each", "chain", "late", "spin", "spin+chain", "spin+late", "devspin", "spin+devspin",
    "spin+chain+devspin", "gather", "spin+chain+gather",
)
_PARTS = {"now", "each", "pykka", "chain", "late", "spin", "devspin", "gather"}


# -- the askers' side: futures ---------------------------------------------------------------------
class _Chain(threading.local):
    """Per thread: a ``late`` asker's pending wake of the next asker of its batch."""

    baton: _ProbeFuture | None = None


_late = _Chain()


class _Batch:
    """The chain being built by the device's current batch (device thread only)."""

    head: _ProbeFuture | None = None
    tail: _ProbeFuture | None = None


class _ProbeFuture(LatchFuture):
    """A ``LatchFuture`` that may spin on its reply and may be chained to the next asker of its
    batch; its class attributes say which (one subclass per variant, made by ``_future_class``).
    The batching loop fills it (``fill`` returns the future itself) and calls ``release`` on it
    when the batch ends, in the order the batch was served."""

    chain: ClassVar[str] = ""  # "", "chain" or "late"
    spin_s: ClassVar[float] = 0.0

    def __init__(self) -> None:
        super().__init__()
        self._shut = True  # popped (one atomic dict operation) by whoever opens the latch, once
        self._next: _ProbeFuture | None = None
        self._ended = False
        self._bell = Doorbell() if self.spin_s > 0 else None

    def _unlatch(self) -> None:
        if self.__dict__.pop("_shut", False):
            self._latch.release()
            if self._bell is not None:
                self._bell.ring()

    def _open(self, result: _Result) -> None:
        self._fill(result)
        self._unlatch()

    def set_get_hook(self, func: Any) -> None:
        if self._result is not None or self._get_hook is not None:
            raise queue.Full
        pykka.Future.set_get_hook(self, func)
        self._unlatch()

    def fill(self, value: Any) -> Any:
        self._fill(_Result(value, None))
        if self.chain:
            if _Batch.tail is None:
                _Batch.head = self
            else:
                _Batch.tail._next = self
            _Batch.tail = self
        return self

    def release(self) -> None:
        """The batch ended (the loop's call, device thread)."""
        if not self.chain:
            self._unlatch()
            return
        self._ended = True
        if self is _Batch.head:
            _Batch.head = _Batch.tail = None
            self._unlatch()

    def get(self, *, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._get_hook is None and "_shut" in self.__dict__:
            if self._bell is not None:
                self._bell.wait(0, self.spin_s if timeout is None else min(self.spin_s, timeout))
            if self.chain:
                self._await_turn(deadline)
        nxt, self._next = self._next, None
        if nxt is not None:
            if self.chain == "late":
                _late.baton = nxt
            else:
                nxt._unlatch()
        return super().get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))

    def _await_turn(self, deadline: float | None) -> None:
        latch = self._latch
        while "_shut" in self.__dict__:
            wait = CHAIN_FALLBACK_S if deadline is None else min(CHAIN_FALLBACK_S, deadline - time.monotonic())
            if wait <= 0:
                return
            if latch.acquire(True, wait):
                latch.release()
                return
            if self._ended:
                self._unlatch()  # nobody passed the wake on: the batch is over, go


def _late_factory(cls: type[_ProbeFuture]) -> Callable[[], pykka.Future[Any]]:
    def make() -> pykka.Future[Any]:
        baton = _late.baton
        if baton is not None:
            _late.baton = None
            baton._unlatch()  # this asker's GIL work is nearly done: the next one may come
        return cls()

    return make


# -- the device's side: its inbox -------------------------------------------------------------------
class _InboxPatch:
    """Spinning and gathering for the device's inbox (a ``queue.Queue``), put on the instance and
    taken off again, so the product's class is untouched."""

    def __init__(self, inbox: Any) -> None:
        self._inbox = inbox
        self._bell = Doorbell()

    def apply(self, spin_s: float, gather_s: float, target: int) -> None:
        inbox, bell = self._inbox, self._bell
        self.remove()
        if spin_s <= 0 and gather_s <= 0:
            return
        cls = type(inbox)
        waiting = inbox.queue

        def put(item: Any, block: bool = True, timeout: float | None = None) -> None:
            cls.put(inbox, item, block, timeout)
            bell.ring()

        def get(block: bool = True, timeout: float | None = None) -> Any:
            if block:
                seen = bell.count
                if not waiting and spin_s > 0:
                    bell.wait(seen, spin_s)
                if waiting and gather_s > 0 and len(waiting) < target:
                    end = time.perf_counter() + gather_s
                    while len(waiting) < target:
                        left = end - time.perf_counter()
                        if left <= 0 or not bell.wait(bell.count, left):
                            break
            return cls.get(inbox, block, timeout)

        inbox.put, inbox.get = put, get

    def remove(self) -> None:
        self._inbox.__dict__.pop("put", None)
        self._inbox.__dict__.pop("get", None)


# -- variants --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One way of serving the asks: the future, whether a batch's wakes wait for its end, and the
    device inbox's spin and gather."""

    name: str
    make_future: Callable[[], pykka.Future[Any]]
    deferred: type  # the reply class the batching loop fills and opens at the batch's end
    defer: bool
    device_spin_s: float
    gather_s: float

    @classmethod
    def parse(cls, name: str, force_spin: bool) -> Variant:
        parts = set(name.split("+"))
        unknown = parts - _PARTS
        if unknown or not parts:
            raise SystemExit(f"unknown variant part(s) {sorted(unknown)} in {name!r}; parts: {sorted(_PARTS)}")
        if "chain" in parts and "late" in parts:
            raise SystemExit(f"{name!r}: chain and late are two ways of the same thing; pick one")

        def budget(seconds: float) -> float:
            return seconds if force_spin else hot_waits.spin_budget(seconds)

        if "pykka" in parts:
            return cls(name, pykka.ThreadingFuture, LatchFuture, True, 0.0, 0.0)
        chain = "late" if "late" in parts else "chain" if "chain" in parts else ""
        spin_s = budget(hot_waits.FUTURE_SPIN_S) if "spin" in parts else 0.0
        device_spin_s = budget(hot_waits.INBOX_SPIN_S) if parts & {"devspin", "gather"} else 0.0
        gather_s = GATHER_S if "gather" in parts else 0.0
        if not chain and not spin_s:
            make: Callable[[], pykka.Future[Any]] = LatchFuture
            return cls(name, make, LatchFuture, "each" not in parts, device_spin_s, gather_s)
        future = type(f"_Future_{name}", (_ProbeFuture,), {"chain": chain, "spin_s": spin_s})
        make = _late_factory(future) if chain == "late" else future
        return cls(name, make, future, "each" not in parts, device_spin_s, gather_s)

    @contextlib.contextmanager
    def applied(self, inbox: _InboxPatch, workers: int) -> Iterator[None]:
        own_future = DeviceActor.__dict__["_create_future"]
        # pykka asks the actor class for each ask's future (``_create_future``); the batching loop
        # defers the wakes of replies of exactly the class ``pykka_internals.LatchFuture`` names.
        setattr(DeviceActor, "_create_future", staticmethod(self.make_future))  # noqa: B010
        setattr(pykka_internals, "LatchFuture", self.deferred)  # noqa: B010
        pykka_internals.DEFER_WAKES = self.defer
        inbox.apply(self.device_spin_s, self.gather_s, workers)
        try:
            yield
        finally:
            inbox.remove()
            pykka_internals.DEFER_WAKES = True
            setattr(pykka_internals, "LatchFuture", LatchFuture)  # noqa: B010
            setattr(DeviceActor, "_create_future", own_future)  # noqa: B010
            baton = _late.baton
            if baton is not None:  # a late chain left on the main thread cannot be: workers hold them
                _late.baton = None
                baton._unlatch()


# -- measuring -------------------------------------------------------------------------------------
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
    """What the rounds of one case (a variant and a worker count) add up to."""

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

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_per_ask)

    def per_ask(self, kind: str, field: str) -> float:
        sums = self.threads.get(kind)
        return 0.0 if sums is None else sums[_FIELDS.index(field)] / self.asks

    def report(self, label: str) -> None:
        print(
            f"{label}: {self.rate:9,.0f} asks/s (median), {self.cpu:6.1f} us of process CPU per ask; "
            f"{self.batched / self.asks:.0%} of asks in batches, mean batch {self.batched / max(self.batches, 1):.1f}"
        )
        for kind, (cpu, runq, slices, vol, invol) in sorted(self.threads.items()):
            a = self.asks
            print(
                f"    {kind:7s} per ask: CPU {cpu / a / 1e3:6.2f} us, run-queue wait {runq / a / 1e3:6.2f} us, "
                f"slices {slices / a:5.2f}, voluntary switches {vol / a:5.2f}, involuntary {invol / a:5.2f}"
            )


def _summary(variants: list[Variant], tallies: dict[tuple[str, int], _Tally]) -> None:
    print(
        f"{'variant':22s} {'16/1 ratio':>10s} {'16w asks/s':>11s} {'1w asks/s':>10s} {'16w wall/ask':>12s} "
        f"{'16w CPU/ask':>11s} {'GIL idle':>8s} {'worker sleeps':>13s} {'mean batch':>10s}"
    )
    for variant in variants:
        many, one = tallies[(variant.name, WORKERS)], tallies[(variant.name, 1)]
        ratio = statistics.median(m / o for m, o in zip(many.rates, one.rates, strict=True))
        wall = 1e6 / many.rate
        print(
            f"{variant.name:22s} {ratio:9.2f}x {many.rate:11,.0f} {one.rate:10,.0f} {wall:10.1f}us "
            f"{many.cpu:9.1f}us {max(wall - many.cpu, 0.0):6.1f}us {many.per_ask('worker', 'vol'):13.2f} "
            f"{many.batched / max(many.batches, 1):10.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    """Run the probe (see the module docstring); ``argv`` as ``sys.argv[1:]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("driver", nargs="?", default="host", choices=["host", "cuda"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated; see the docstring")
    parser.add_argument("--force-spin", action="store_true", help="spin even on fewer than MIN_CORES cores")
    parser.add_argument("--detail", action="store_true", help="per kind of thread, per case")
    args = parser.parse_args(argv)
    variants = [Variant.parse(name, args.force_spin) for name in args.variants.split(",")]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("a variant is named twice")

    driver = open_driver(args.driver)
    device = DeviceActor.start(0, driver)
    inbox = _InboxPatch(device.actor_inbox)
    many = [Worker.start(device) for _ in range(WORKERS)]
    one = [Worker.start(device)]
    tallies = {(v.name, count): _Tally() for v in variants for count in (WORKERS, 1)}
    try:
        _round(many, 20)
        _round(one, 200)
        gc.collect()
        gc.disable()
        for r in range(args.rounds):
            for variant in variants if r % 2 == 0 else reversed(variants):
                for workers in (many, one):
                    with variant.applied(inbox, len(workers)):
                        tallies[(variant.name, len(workers))].add(device, workers, _ASKS_MANY * WORKERS // len(workers))
    finally:
        gc.enable()
        for worker in [*many, *one]:
            worker.stop()
        device.stop()
        driver.close()
    spin = "forced on" if args.force_spin else ("on" if hot_waits.spin_budget(1.0) else "off (too few cores)")
    print(
        f"{args.driver} driver, {os.cpu_count()} cores, Python {'.'.join(map(str, sys.version_info[:3]))}, "
        f"{args.rounds} rounds of each case, alternating; spinning {spin}"
    )
    _summary(variants, tallies)
    if args.detail:
        for variant in variants:
            print(f"== {variant.name}")
            tallies[(variant.name, WORKERS)].report(f"  {WORKERS} workers")
            tallies[(variant.name, 1)].report("  1 worker  ")


if __name__ == "__main__":
    main()
