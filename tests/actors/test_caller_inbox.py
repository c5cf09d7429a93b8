"""Asks served in the asker's thread (``CallerServedInbox``): an ``Allocate`` or ``AllocateMany``
that finds the device idle runs in the asking thread; anything queued or in service before it
keeps it on the actor's thread, behind them; a failure reaches the supervisor before the asker."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.caller_inbox import CallerServedInbox
from xlog_actors.actors.gpu_ref import RECLAIM_WAKE_BYTES

pytestmark = pytest.mark.timeout(30)


def spy_on_allocations(device: pykka.ActorRef[Any]) -> list[str]:
    """The names of the threads that run the device's context allocations, from now on."""
    ctx = device.ask(xa.GetClient())._cell.lifecycle.context
    threads: list[str] = []
    real_one, real_many = ctx.allocate, ctx.allocate_many

    def one(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_one(*args)

    def many(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_many(*args)

    ctx.allocate, ctx.allocate_many = one, many
    return threads


def test_an_idle_device_serves_allocations_in_the_askers_thread(host_device: pykka.ActorRef[Any]) -> None:
    threads = spy_on_allocations(host_device)
    ref = host_device.ask(xa.Allocate(256))
    refs = host_device.ask(xa.AllocateMany([64, 128]))
    me = threading.current_thread().name
    assert threads == [me, me]
    assert ref.nbytes == 256 and [r.nbytes for r in refs] == [64, 128]
    stats = host_device.ask(xa.GetStats())
    assert (stats.live_blocks, stats.bytes_outstanding, stats.batches) == (3, 448, 0)


def test_with_inline_serving_off_the_actor_serves(host_device: pykka.ActorRef[Any]) -> None:
    threads = spy_on_allocations(host_device)
    host_device.actor_inbox.serve_in_caller((), None)
    host_device.ask(xa.Allocate(256))
    assert threads and threads[0] != threading.current_thread().name


def test_an_allocation_sent_behind_a_message_in_service_waits_for_it(host_device: pykka.ActorRef[Any]) -> None:
    """Same-sender order: a told message the actor is serving is done before the allocation
    runs, and the allocation then runs on the actor's thread."""
    threads = spy_on_allocations(host_device)
    inside, gate = threading.Event(), threading.Event()
    order: list[str] = []
    actor = host_device.actor_inbox.serve.__self__  # the DeviceActor behind the ref
    stats_handler = actor._on_stats

    def slow_stats(msg: Any) -> Any:
        inside.set()
        assert gate.wait(10)
        order.append("stats")
        return stats_handler(msg)

    actor._on_stats = slow_stats  # this actor's handler of GetStats (looked up per message)
    host_device.tell(xa.GetStats())
    assert inside.wait(10)
    future = host_device.ask(xa.Allocate(64), block=False)
    assert threads == [], "served while an earlier message of this sender was in service"
    gate.set()
    assert future.get(timeout=10).nbytes == 64
    order.append("allocated")
    assert order == ["stats", "allocated"]
    assert threads and threads[0] != threading.current_thread().name


def test_a_failure_reaches_the_supervisor_before_the_asker(host_driver: xa.HostDriver,
                                                           host_device: pykka.ActorRef[Any]) -> None:
    old = host_device.ask(xa.Allocate(64))
    host_driver.inject_fault(0, "context_lost")
    with pytest.raises(xa.ContextLost):
        host_device.ask(xa.Allocate(64))
    # No other message was sent: the rebuild already ran when the asker got its error.
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        old.access()
    stats = host_device.ask(xa.GetStats())
    assert (stats.generation, stats.restarts) == (1, 1)
    assert host_device.ask(xa.Allocate(64)).generation == 1


def test_a_bad_request_is_refused_and_changes_nothing(host_device: pykka.ActorRef[Any]) -> None:
    before = host_device.ask(xa.GetStats())
    with pytest.raises(xa.InvalidRequest):
        host_device.ask(xa.Allocate(-1))
    with pytest.raises(xa.InvalidRequest):
        host_device.ask(xa.AllocateMany([64, 0]))
    after = host_device.ask(xa.GetStats())
    assert (after.live_blocks, after.bytes_outstanding, after.status) == (before.live_blocks, 0, "running")


def test_a_recording_history_keeps_allocations_on_the_actors_thread(host_device: pykka.ActorRef[Any]) -> None:
    threads = spy_on_allocations(host_device)
    host_device.ask(xa.RecordMemoryHistory(True))
    host_device.ask(xa.Allocate(64))
    assert threads and threads[0] != threading.current_thread().name


def test_a_stopped_device_answers_through_its_inbox_as_before(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver)
    inbox = device.actor_inbox
    assert isinstance(inbox, CallerServedInbox) and inbox.serve is not None
    device.stop()
    assert inbox.serve is None, "the inbox, which every ActorRef holds, let go of the actor"
    with pytest.raises(pykka.ActorDeadError):
        device.ask(xa.Allocate(64))


def test_a_context_reset_from_outside_leaves_the_ask_to_the_actor(host_driver: xa.HostDriver,
                                                                  host_device: pykka.ActorRef[Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor checks the context before every message (a reset by another library leaves the
    pool's handle dangling; CUDA may crash on it); an ask served in the caller's thread checks it
    too, and leaves the ask to the actor when the check fails."""
    threads = spy_on_allocations(host_device)
    real = host_driver.check_context
    failures = [xa.ContextLost("device 0: reset from outside (planted)")]

    def check(ordinal: int) -> None:
        if failures:
            raise failures.pop()
        real(ordinal)

    monkeypatch.setattr(host_driver, "check_context", check)
    assert host_device.ask(xa.Allocate(64)).nbytes == 64
    assert not failures, "the caller's thread did not check the context"
    assert threads and threads[0] != threading.current_thread().name


def test_a_dropped_handle_is_freed_by_the_next_allocation_served_in_the_caller(host_driver: xa.HostDriver) -> None:
    """A budget that holds one block: the dropped handle's block (queued to be reclaimed, too
    small to wake the actor) is freed by the asker before its own allocation, in its thread."""
    device = xa.DeviceActor.start(0, host_driver, resource="async+budget:4KiB")
    try:
        threads = spy_on_allocations(device)  # (an ask of the actor: before the drop below)
        device.ask(xa.Allocate(4096))  # its handle is dropped at once
        assert device.ask(xa.Allocate(4096)).nbytes == 4096  # BudgetExceeded if the first still held
        assert threads == [threading.current_thread().name] * 2
        stats = device.ask(xa.GetStats())
        assert (stats.live_blocks, stats.bytes_outstanding) == (0, 0)
    finally:
        device.stop()


class Ask:
    """An ask the inboxes below serve in the caller."""


class Wake:
    """A wake-up of the inboxes below."""


def _inbox_serving(served: list[Any]) -> CallerServedInbox:
    """An inbox that serves ``Ask`` into ``served`` and takes ``Wake`` for a wake-up."""
    inbox = CallerServedInbox()
    inbox.serve_in_caller((Ask,), lambda envelope: served.append(envelope), wake_types=(Wake,))
    return inbox


def test_a_queue_of_wake_ups_only_counts_as_empty_and_nothing_else_does() -> None:
    from pykka._envelope import Envelope

    served: list[Any] = []
    inbox = _inbox_serving(served)
    inbox.put(Envelope(Wake(), reply_to=None))  # a told wake-up: queued
    first = Envelope(Ask(), reply_to=pykka.ThreadingFuture())
    inbox.put(first)
    assert served == [first] and len(inbox.queue) == 1  # served past the wake-up
    inbox.put(Envelope(Wake(), reply_to=pykka.ThreadingFuture()))  # an *asked* Wake orders: not a wake-up
    inbox.put(Envelope(Ask(), reply_to=pykka.ThreadingFuture()))
    assert served == [first] and len(inbox.queue) == 3
    inbox.queue.clear()
    inbox.put(Envelope(object(), reply_to=None))  # any other told message orders too
    inbox.put(Envelope(Ask(), reply_to=pykka.ThreadingFuture()))
    assert served == [first] and len(inbox.queue) == 2
    inbox.queue.clear()
    inbox.serve_in_caller((Ask,), lambda envelope: served.append(envelope))  # no wake types: as before
    inbox.put(Envelope(Wake(), reply_to=None))
    inbox.put(Envelope(Ask(), reply_to=pykka.ThreadingFuture()))
    assert served == [first] and len(inbox.queue) == 2


def test_an_actor_serving_a_wake_up_counts_as_idle_and_one_serving_anything_else_does_not() -> None:
    from pykka._envelope import Envelope

    served: list[Any] = []
    inbox = _inbox_serving(served)
    inbox.put(Envelope(Wake(), reply_to=None))
    inbox.get()  # the actor took the wake-up and serves it
    assert inbox.busy and inbox.busy_wake and not inbox.quiet()
    first = Envelope(Ask(), reply_to=pykka.ThreadingFuture())
    inbox.put(first)
    assert served == [first] and not inbox.queue  # served beside the wake-up's work
    inbox.put(Envelope(object(), reply_to=None))
    inbox.get()  # the actor took a message that orders
    assert inbox.busy and not inbox.busy_wake
    inbox.put(Envelope(Ask(), reply_to=pykka.ThreadingFuture()))
    assert served == [first] and len(inbox.queue) == 1  # it waits for that message
    inbox.queue.clear()
    inbox.put(Envelope(Wake(), reply_to=pykka.ThreadingFuture()))  # an asked Wake is no wake-up
    inbox.get()
    inbox.put(Envelope(Ask(), reply_to=pykka.ThreadingFuture()))
    assert served == [first] and len(inbox.queue) == 1


def test_a_handle_collected_inside_the_inbox_lock_does_not_hang_its_thread(host_device: pykka.ActorRef[Any]) -> None:
    """A garbage collection may start inside a section of the inbox's own lock (a ``get``
    allocates its waiter there) and collect a handle whose free wakes the actor: the wake-up
    must not wait for that lock on that thread. It is given up, and the next message frees the
    block."""
    ref = host_device.ask(xa.Allocate(RECLAIM_WAKE_BYTES))  # its drop wakes the actor
    box: list[Any] = [ref]
    box.append(box)  # a cycle: the handle goes at a collection, not before
    del ref
    gc.collect()
    gc.disable()  # the collection below is the only one: inside the inbox's lock
    try:
        del box

        def inside_the_lock() -> None:
            with host_device.actor_inbox.mutex:
                gc.collect()

        thread = threading.Thread(target=inside_the_lock, daemon=True)
        thread.start()
        thread.join(10.0)
        assert not thread.is_alive(), "the collected handle's wake-up waited for its own thread's lock"
    finally:
        gc.enable()
    stats = host_device.ask(xa.GetStats())
    assert (stats.live_blocks, stats.bytes_outstanding) == (0, 0)
