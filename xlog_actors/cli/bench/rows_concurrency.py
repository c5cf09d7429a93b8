"""The concurrency rows: many threads on one ``DeviceClient`` (also of a device with a block
cache), many actors asking one ``DeviceActor``. Each row's reference is its own twin with one
thread (one actor), measured in the same run, and the figure is the aggregate number of
operations per second."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pykka

from ...actors import Allocate, DeviceActor, GetClient
from .harness import Context, Group, Op, Row
from .plan import SIZE
from .result import Target
from .twins import alloc_free_loop

__all__ = ["CACHED_THREADS", "CONCURRENCY", "THREADS", "WORKERS", "Crew", "Worker"]

THREADS = 8  # DeviceClient threads of the first row
WORKERS = 16  # worker actors of the second row


class Crew:
    """``count`` threads that each run their own ``op(n)`` when :meth:`run` is called, all at
    once, and return when all are done: ``run`` is a timed :data:`~.harness.Op` whose one call
    runs ``count * n`` operations. The threads live until :meth:`close`, so a sample pays for
    two barrier crossings, not for starting threads.

    Thread rule: ``run`` and ``close`` from one thread (the bench's).
    """

    def __init__(self, make_op: Callable[[], Op], count: int) -> None:
        """Args:
            make_op: called once per thread, in the bench's thread: that thread's operation.
            count: the number of threads.
        """
        self.count = count
        self._go = threading.Barrier(count + 1)
        self._done = threading.Barrier(count + 1)
        self._n = 0
        self._closing = False
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(make_op(),), name=f"bench-crew-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, op: Op) -> None:
        while True:
            self._go.wait()
            if self._closing:
                return
            try:
                op(self._n)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the bench's thread
                self._errors.append(exc)
            self._done.wait()

    def run(self, n: int) -> None:
        """Every thread runs its operation ``n`` times; returns when all are done.

        Raises:
            the first error a thread met.
        """
        self._n = n
        self._go.wait()
        self._done.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        """Stop and join the threads. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._go.wait()
        for thread in self._threads:
            thread.join()


@dataclass
class _Threads:
    many: Crew
    one: Crew


@contextlib.contextmanager
def _device(ctx: Context) -> Iterator[pykka.ActorRef[Any]]:
    device = DeviceActor.start(0, ctx.driver)
    try:
        yield device
    finally:
        device.stop()


@contextlib.contextmanager
def _cached_device(ctx: Context) -> Iterator[pykka.ActorRef[Any]]:
    device = DeviceActor.start(0, ctx.driver, resource="async+cache")
    try:
        yield device
    finally:
        device.stop()


@contextlib.contextmanager
def _threads(device: pykka.ActorRef[Any]) -> Iterator[_Threads]:
    client: Any = device.ask(GetClient())

    def make_op() -> Op:
        return alloc_free_loop(client.allocate, client.free)

    many = Crew(make_op, THREADS)
    one = Crew(make_op, 1)
    try:
        yield _Threads(many, one)
    finally:
        many.close()
        one.close()


class Worker(pykka.ThreadingActor):
    """A worker actor: asked ``n``, it asks its device for ``n`` allocations of 4 KiB, dropping
    each handle before it asks for the next (the drop hands its free back to the device).

    Thread rule: a pykka actor; ask it from any thread.
    """

    def __init__(self, device: pykka.ActorRef[Any]) -> None:
        super().__init__()
        self._ask = device.ask
        self._msg = Allocate(SIZE)

    def on_receive(self, message: Any) -> None:
        """Run ``message`` (an int) allocations; answer None once done.

        Args:
            message: how many.
        Thread rule: the actor's thread only (pykka calls it).
        """
        ask, msg = self._ask, self._msg
        held: Any = None
        for _ in range(message):
            held = None  # the previous handle goes before the next ask
            held = ask(msg)
        del held


@dataclass
class _Workers:
    many: list[pykka.ActorRef[Any]]
    one: pykka.ActorRef[Any]


@contextlib.contextmanager
def _workers(device: pykka.ActorRef[Any]) -> Iterator[_Workers]:
    many = [Worker.start(device) for _ in range(WORKERS)]
    one = Worker.start(device)
    try:
        yield _Workers(many, one)
    finally:
        for worker in [*many, one]:
            worker.stop()


def _ask_all(workers: list[pykka.ActorRef[Any]]) -> Op:
    def run(n: int) -> None:
        futures = [worker.ask(n, block=False) for worker in workers]
        for future in futures:
            future.get()

    return run


CONCURRENCY = Group("many threads and many actors", (
    Row(f"DeviceClient {THREADS} threads / 1 thread",
        f"DeviceClient.allocate(4 KiB) + free from {THREADS} threads at once, one shared client: aggregate pairs "
        "per second", _threads, lambda f: f.many.run, lambda f: f.one.run, lambda p: p.threads,
        reference="the same pairs from 1 thread", kind="throughput", ours_ops=THREADS,
        ref_batch=lambda p: THREADS * p.threads[1], target=Target("ratio", ">=", 1.0), concurrency=(THREADS, 1),
        note="a sample is one round of every thread running its share (5,000 pairs on a GPU), started and joined "
        "at barriers: a share long against a thread's start (a wake-up), so the ratio is the pairs' and not the "
        "hand-offs'"),
    Row(f"Allocate {WORKERS} workers / 1 worker",
        f"device.ask(Allocate(4 KiB)) + dropping the GpuRef from {WORKERS} pykka worker actors at once: aggregate "
        "asks per second", _workers, lambda f: _ask_all(f.many), lambda f: _ask_all([f.one]), lambda p: p.workers,
        reference="the same asks from 1 worker actor", kind="throughput", ours_ops=WORKERS,
        ref_batch=lambda p: WORKERS * p.workers[1], target=Target("ratio", ">=", 1.0),
        concurrency=(WORKERS, 1),
        note="the device serves the allocations queued together in one wake-up (DeviceStats.batches)"),
), base=_device)


CACHED_THREADS = Group("many threads on cached sizes", (
    Row(f"DeviceClient through the cache {THREADS} threads / 1 thread",
        f"DeviceClient.allocate(4 KiB) + free of an async+cache device from {THREADS} threads at once, one shared "
        "client, a cached size: aggregate pairs per second", _threads, lambda f: f.many.run, lambda f: f.one.run,
        lambda p: p.threads, reference="the same pairs from 1 thread", kind="throughput", ours_ops=THREADS,
        ref_batch=lambda p: THREADS * p.threads[1], target=Target("ratio", ">=", 1.0), concurrency=(THREADS, 1),
        note="each thread keeps reusing its own kept block: no driver call left to serialize on; shares as in "
        "the row above"),
), base=_cached_device)
