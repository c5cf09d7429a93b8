"""``hot_waits``: the library actors' inbox and ask futures spin (GIL released) before they block,
and otherwise behave as pykka's own: FIFO, timeouts, errors, one reply."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core.doorbell import Doorbell
from xlog_actors.actors import hot_waits
from xlog_actors.actors.hot_waits import SpinningFuture, SpinningInbox, spin_budget


def later(seconds: float, fn: Any, *args: Any) -> threading.Thread:
    """Run ``fn(*args)`` on another thread after ``seconds``."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn(*args)), daemon=True)
    thread.start()
    return thread


def test_the_doorbell_reports_a_ring_since_what_the_caller_saw() -> None:
    bell = Doorbell()
    assert bell.count == 0 and not bell.wait(0, 0.0) and not bell.wait(0, 0.005)
    bell.ring()
    assert bell.count == 1 and bell.wait(0, 0.0)  # rung before the wait: not missed
    assert not bell.wait(1, 0.002)
    thread = later(0.002, bell.ring)
    assert bell.wait(1, 5.0) and bell.count == 2
    thread.join()


class Watched(SpinningInbox):
    """Counts the gets that fell through to the queue's own blocking get."""

    slept = 0

    def _sleep_get(self, block: bool, timeout: float | None) -> Any:
        self.slept += 1
        return super()._sleep_get(block, timeout)


def test_the_inbox_is_fifo_and_spins_for_a_message_before_it_blocks() -> None:
    inbox = Watched(5.0)
    for i in range(3):
        inbox.put(i)
    assert [inbox.get() for _ in range(3)] == [0, 1, 2]
    thread = later(0.005, inbox.put, "late")
    assert inbox.get() == "late"
    thread.join()
    assert inbox.slept == 0  # every get was served at once or by the spin, none by sleeping
    idle = Watched(0.0)
    thread = later(0.005, idle.put, "x")
    assert idle.get() == "x" and idle.slept == 1  # the same wait without a spin sleeps
    thread.join()


def test_an_inbox_that_does_not_spin_blocks_as_a_queue_does() -> None:
    inbox = SpinningInbox(0.0)
    thread = later(0.005, inbox.put, "x")
    assert inbox.get() == "x"
    thread.join()
    with pytest.raises(queue.Empty):
        inbox.get(block=False)
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        SpinningInbox(5.0).get(timeout=0.02)  # the spin is bounded by the timeout
    assert time.monotonic() - started < 2.0


def test_the_future_returns_a_reply_set_while_it_spins() -> None:
    future = SpinningFuture(5.0)
    thread = later(0.005, future.set, 42)
    assert future.get() == 42
    thread.join()
    with pytest.raises(queue.Full):
        future.set(43)  # one reply, as pykka's own future


def test_the_future_raises_the_error_and_times_out() -> None:
    future = SpinningFuture(5.0)
    try:
        raise xa.InvalidRequest("bad")
    except xa.InvalidRequest:
        future.set_exception()
    with pytest.raises(xa.InvalidRequest, match="bad"):
        future.get()
    started = time.monotonic()
    with pytest.raises(pykka.Timeout):
        SpinningFuture(5.0).get(timeout=0.02)
    assert time.monotonic() - started < 2.0


def test_few_cores_spin_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hot_waits, "CORES", hot_waits.MIN_CORES - 1)
    assert spin_budget(0.5) == 0.0
    monkeypatch.setattr(hot_waits, "CORES", hot_waits.MIN_CORES)
    assert spin_budget(0.5) == 0.5


def test_library_actors_use_them(host_driver: xa.Driver) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    copy = xa.CopyActor.start(device)
    try:
        ref = device.ask(xa.Allocate(64))
        future = copy.ask(xa.Fill(ref, 1), block=False)
        assert isinstance(future, SpinningFuture)
        assert future.get(timeout=10) is None
        assert isinstance(copy.actor_inbox, SpinningInbox)
        assert isinstance(copy.stop(block=False), SpinningFuture)  # pykka's derived futures too
    finally:
        copy.stop()
        device.stop()
    assert SpinningFuture()._spin_s == spin_budget(hot_waits.FUTURE_SPIN_S)  # pykka's no-argument form


def test_fill_sets_the_reply_without_ringing_and_hands_the_bell_over() -> None:
    future = SpinningFuture(5.0)
    bell = future.fill(41)
    assert bell.count == 0  # not rung: the answering thread rings it once it let go of the GIL
    assert future.get(timeout=1) == 41  # the reply is there all the same
    bell.ring()
    failed = SpinningFuture(0.0)
    failed.fill(exc_info=(ValueError, ValueError("bad"), None))
    with pytest.raises(ValueError, match="bad"):
        failed.get(timeout=1)


def test_put_unrung_queues_and_counts_without_ringing_and_hands_the_bell_over() -> None:
    inbox = SpinningInbox(5.0)
    seen = inbox._bell.count
    bell = inbox.put_unrung("work")
    assert bell is inbox._bell and bell.count == seen  # the caller rings it once it let go of the GIL
    assert inbox.unserved() == 1
    assert inbox.get(timeout=1) == "work"  # queued all the same


def test_ask_into_unrung_hands_a_library_actors_bell_over_and_sends_the_rest_as_ask_into(
    host_driver: xa.Driver,
) -> None:
    from xlog_actors.actors.pykka_internals import ask_into_unrung

    device = xa.DeviceActor.start(0, host_driver)
    copy = xa.CopyActor.start(device)
    try:
        ref = device.ask(xa.Allocate(64))
        future: Any = pykka.ThreadingFuture()
        bell = ask_into_unrung(copy, xa.Fill(ref, 7), future)
        assert isinstance(bell, Doorbell)
        bell.ring()
        assert future.get(timeout=10) is None  # served by the actor
        assert copy.ask(xa.CopyToHost(ref, nbytes=4)) == b"\x07" * 4
        plain = pykka.ThreadingFuture()
        assert ask_into_unrung(device, xa.GetStats(), plain) is None  # not a spinning inbox
        assert plain.get(timeout=10).bytes_outstanding >= 64
        copy.stop()
        dead: Any = pykka.ThreadingFuture()
        assert ask_into_unrung(copy, xa.Fill(ref, 1), dead) is None
        with pytest.raises(pykka.ActorDeadError):
            dead.get(timeout=1)
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_getter_asleep_on_the_condition_is_woken_by_fill_alone() -> None:
    future = SpinningFuture(0.0)  # no spin: the getter sleeps on the condition at once
    thread = later(0.01, future.fill, "late")
    assert future.get(timeout=5) == "late"
    thread.join()


def test_wait_readable_rings_the_bell_it_is_given_before_it_looks() -> None:
    import os

    from xlog_actors._core.fdwait import wait_readable

    r, w = os.pipe()
    try:
        bell = Doorbell()
        assert wait_readable(r, 0.0, bell) is False and bell.count == 1
        os.write(w, b"x")
        assert wait_readable(r, 1.0, None) is True and bell.count == 1
        assert wait_readable(r, 1.0, bell) is True and bell.count == 2
    finally:
        os.close(r)
        os.close(w)
