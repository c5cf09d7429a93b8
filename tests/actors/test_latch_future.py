"""``LatchFuture``, the future of every ``DeviceActor`` ask: pykka's future behaviour with one lock."""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

import pykka
import pytest

from xlog_actors.actors import Allocate, DeviceActor, GetStats
from xlog_actors.actors.latch_future import LatchFuture
from xlog_actors.driver import HostDriver

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 5


def test_a_value_set_is_what_every_get_returns() -> None:
    future = LatchFuture()
    future.set("value")
    assert future.get() == "value"
    assert future.get(timeout=0) == "value"  # the latch stays open


def test_every_thread_waiting_in_get_wakes_on_set() -> None:
    future = LatchFuture()
    got: list[Any] = []
    started = threading.Barrier(5)

    def wait() -> None:
        started.wait()
        got.append(future.get(timeout=TIMEOUT))

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for thread in threads:
        thread.start()
    started.wait()
    future.set(7)
    for thread in threads:
        thread.join(TIMEOUT)
    assert got == [7, 7, 7, 7]


def test_an_error_set_is_raised_by_get_with_its_traceback() -> None:
    future = LatchFuture()
    try:
        raise ValueError("bad")
    except ValueError:
        future.set_exception()  # sys.exc_info(), as pykka's
        raised_here = sys.exc_info()[2]
    with pytest.raises(ValueError, match="bad") as raised:
        future.get()
    assert raised_here is not None
    frames = []
    tb = raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert raised_here.tb_frame in frames  # the actor's frames come with the error


def test_an_error_class_without_a_value_is_raised_as_an_instance() -> None:
    future = LatchFuture()
    future.set_exception((KeyError, None, None))
    with pytest.raises(KeyError):
        future.get()


def test_a_get_that_times_out_raises_pykkas_timeout_and_changes_nothing() -> None:
    future = LatchFuture()
    with pytest.raises(pykka.Timeout, match="0.01 seconds"):
        future.get(timeout=0.01)
    with pytest.raises(pykka.Timeout):
        future.get(timeout=-1)  # a past deadline: no wait at all, as pykka's
    future.set(3)
    assert future.get(timeout=0) == 3


@pytest.mark.parametrize("second", ["set", "set_exception", "set_get_hook"])
def test_a_second_result_is_refused_with_queue_full_and_the_first_stays(second: str) -> None:
    future = LatchFuture()
    future.set(1)
    with pytest.raises(queue.Full):
        if second == "set":
            future.set(2)
        elif second == "set_exception":
            future.set_exception((ValueError, ValueError(), None))
        else:
            future.set_get_hook(lambda timeout: 2)
    assert future.get() == 1


def test_a_result_after_a_get_hook_is_refused() -> None:
    future = LatchFuture()
    future.set_get_hook(lambda timeout: "hooked")
    with pytest.raises(queue.Full):
        future.set(1)
    with pytest.raises(queue.Full):
        future.set_get_hook(lambda timeout: "again")
    assert future.get() == "hooked"


def test_pykkas_derived_futures_are_latch_futures_and_work() -> None:
    first, second = LatchFuture(), LatchFuture()
    mapped = first.map(lambda value: value + 1)
    joined = first.join(second)
    assert isinstance(mapped, LatchFuture) and isinstance(joined, LatchFuture)
    waiter: list[Any] = []
    thread = threading.Thread(target=lambda: waiter.append(joined.get(timeout=TIMEOUT)))
    thread.start()
    first.set(1)
    second.set(2)
    thread.join(TIMEOUT)
    assert mapped.get() == 2
    assert waiter == [[1, 2]]
    assert pykka.get_all([first, second]) == [1, 2]


def test_the_base_future_keeps_the_get_hook_attribute_the_latch_reads() -> None:
    # LatchFuture reads pykka.Future's private ``_get_hook`` (None until set_get_hook).
    future = pykka.ThreadingFuture[Any]()
    assert future._get_hook is None

    def hook(timeout: float | None) -> int:
        return 1

    future.set_get_hook(hook)
    assert future._get_hook is hook


def test_device_asks_and_stop_are_answered_through_latch_futures() -> None:
    device = DeviceActor.start(0, HostDriver())
    try:
        future = device.ask(Allocate(4096), block=False)
        assert isinstance(future, LatchFuture)
        ref = future.get(timeout=TIMEOUT)
        assert ref.nbytes == 4096
        del ref, future
        with pytest.raises(Exception, match="does not understand"):
            device.ask("nonsense", timeout=TIMEOUT)
        assert device.ask(GetStats(), timeout=TIMEOUT).live_blocks == 0
    finally:
        stopped = device.stop(block=False)
    assert isinstance(stopped, LatchFuture)
    stopped.get(timeout=TIMEOUT)
    with pytest.raises(pykka.ActorDeadError):
        device.ask(GetStats(), timeout=TIMEOUT)


def test_an_ask_queued_behind_the_stop_is_answered_actor_dead() -> None:
    device = DeviceActor.start(0, HostDriver())
    stopped = device.stop(block=False)
    late = device.ask(GetStats(), block=False)  # queued behind the stop, or refused: dead either way
    stopped.get(timeout=TIMEOUT)
    with pytest.raises(pykka.ActorDeadError):
        late.get(timeout=TIMEOUT)


def test_a_filled_value_is_read_only_once_its_latch_is_released() -> None:
    future = LatchFuture()
    latch = future.fill("later")
    with pytest.raises(pykka.Timeout):
        future.get(timeout=0.01)  # filled, not yet opened
    with pytest.raises(queue.Full):
        future.fill("again")
    latch.release()
    assert future.get(timeout=0) == "later"
