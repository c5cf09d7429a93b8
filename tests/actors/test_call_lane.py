"""The call lane (``_core.call_lane``): its slot protocol on one buffer, then an isolated device
that answers allocations through it (forced on here whatever the machine's cores)."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core import call_lane as lanes
from xlog_actors._core.call_lane import CallLane
from xlog_actors.actors.isolated import ChildTimeline, _proxy

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_process")]


def _pair() -> tuple[CallLane, CallLane]:
    """The parent's and the child's view of one zeroed buffer."""
    buffer = mmap.mmap(-1, lanes.SIZE)
    return CallLane(buffer), CallLane(buffer)


def test_a_request_is_posted_taken_answered_and_read_back_and_the_slot_is_reused() -> None:
    parent, child = _pair()
    slot = parent.claim()
    assert slot == 0
    assert parent.post(slot, 7, 0, 4096, 3, b"weights", 2, [0x10, 0x20]) is False  # the child is awake
    assert child.wait(-1, 0.0, 0) == lanes.REQUEST
    assert child.take(0) == (slot, 7, 4096, 3, b"weights", 2, [0x10, 0x20], False)
    assert child.take(0) is None  # claimed: taken once
    child.done(slot, 0x7000, 4096, 256, 3, 11, 1, 5)
    assert parent.wait_reply(slot, 1.0) == lanes.DONE
    assert parent.reply(slot) == (0x7000, 4096, 256, 3, 11, 1, 5)
    assert parent.claim() == slot  # idle and unclaimed again


def test_a_request_waits_for_the_pipe_frames_sent_before_it() -> None:
    parent, child = _pair()
    slot = parent.claim()
    parent.post(slot, 1, 3, 64, 0, b"", 0, [])  # three frames were sent before it
    assert child.wait(-1, 0.0, 2) == lanes.PIPE  # read the third frame first
    assert child.take(2) is None
    assert child.wait(-1, 0.0, 3) == lanes.REQUEST
    assert child.take(3) is not None


def test_a_piped_answer_releases_the_slot_only_once_read() -> None:
    parent, child = _pair()
    slot = parent.claim()
    parent.post(slot, 1, 0, 64, 0, b"", 0, [])
    assert child.take(0) is not None
    child.piped(slot)
    assert parent.wait_reply(slot, 1.0) == lanes.PIPED
    assert parent.claim() == 1  # slot 0 is still claimed
    parent.release(slot, True)
    assert parent.claim() == 0


def test_an_unclaimed_request_is_abandoned_and_then_served_as_a_pipe_ask() -> None:
    parent, child = _pair()
    slot = parent.claim()
    parent.post(slot, 9, 0, 64, 0, b"t", 4, [0x30])
    assert parent.wait_reply(slot, 0.001) == lanes.ABANDONED
    parent.release(slot, False)
    assert parent.claim() == 1  # slot 0 is not idle until the child took the abandoned request
    assert child.wait(-1, 0.0, 0) == lanes.REQUEST  # it still counts: the child must answer it
    assert child.take(0) == (slot, 9, 64, 0, b"t", 4, [0x30], True)
    parent.release(1, False)
    assert parent.claim() == 0


def test_a_dead_child_ends_the_wait_and_full_slots_refuse_a_claim() -> None:
    parent, _child = _pair()
    slots = [parent.claim() for _ in range(lanes.SLOTS)]
    assert sorted(slots) == list(range(lanes.SLOTS)) and parent.claim() == -1
    parent.post(slots[0], 1, 0, 64, 0, b"", 0, [])
    child_took = _child.take(0)
    assert child_took is not None  # claimed: the asker waits past its spin ...
    threading.Timer(0.05, parent.mark_dead).start()
    t = time.monotonic()
    assert parent.wait_reply(slots[0], 0.001) == lanes.DEAD  # ... until the child is marked dead
    assert time.monotonic() - t < 5.0 and parent.dead


def test_bad_fields_are_refused_and_post_nothing() -> None:
    parent, child = _pair()
    slot = parent.claim()
    with pytest.raises(ValueError, match="tag"):
        parent.post(slot, 1, 0, 64, 0, b"x" * (lanes.MAX_TAG + 1), 0, [])
    with pytest.raises(ValueError, match="frees"):
        parent.post(slot, 1, 0, 64, 0, b"", 0, list(range(lanes.MAX_FREES + 1)))
    with pytest.raises(ValueError, match="slot"):
        parent.post(lanes.SLOTS, 1, 0, 64, 0, b"", 0, [])
    assert child.take(0) is None and child.wait(-1, 0.0, 0) == lanes.NOTHING
    with pytest.raises(ValueError, match="needs"):
        CallLane(bytearray(64))


def test_the_childs_waits_ring_the_bell_they_are_given_before_they_look() -> None:
    """``wait`` and ``sleep`` ring a bell once the GIL is released (the library actor the frame
    reader handed work: it then takes the GIL at once), whatever they find; none is rung
    without one."""
    from xlog_actors._core.doorbell import Doorbell

    parent, child = _pair()
    r, w = os.pipe()
    try:
        bell = Doorbell()
        assert child.wait(-1, 0.0, 0, bell) == lanes.NOTHING and bell.count == 1
        assert child.wait(-1, 0.0, 0) == lanes.NOTHING and bell.count == 1
        os.write(w, b"x")
        assert child.sleep(r, 0, bell) == lanes.PIPE and bell.count == 2
    finally:
        os.close(r)
        os.close(w)


def test_a_sleeping_child_is_seen_by_the_poster_and_woken_by_the_pipe() -> None:
    parent, child = _pair()
    r, w = os.pipe()
    try:
        found: list[int] = []
        sleeper = threading.Thread(target=lambda: found.append(child.sleep(r, 0)))
        sleeper.start()
        slot = parent.claim()
        time.sleep(0.2)  # the child is blocked in poll by now
        assert parent.post(slot, 1, 0, 64, 0, b"", 0, []) is True  # asleep: the poster must wake it
        os.write(w, b"x")  # what the ("wake",) frame does
        sleeper.join(5)
        assert found == [lanes.REQUEST]  # woken: the request is looked at before the pipe
        assert child.sleep(r, 0) == lanes.REQUEST  # a posted request is seen before blocking
        assert child.take(0) is not None
        assert child.sleep(r, 0) == lanes.PIPE  # no request: the frame (still unread) is next
    finally:
        os.close(r)
        os.close(w)


# -- an isolated device through its lane ----------------------------------------------------------


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[pykka.ActorRef[Any]]:
    monkeypatch.setattr(_proxy, "CALL_LANE", True)
    ref = xa.DeviceActor.start(0, "host", resource="async+budget:64KiB", isolate=True)
    ref.ask(xa.GetStats())  # started: its inbox serves in the caller
    yield ref
    ref.stop()


def _child(device: pykka.ActorRef[Any]) -> Any:
    return device.actor_inbox.serve.__self__._child  # type: ignore[attr-defined]  # the proxy, by its inbox


def test_allocations_are_answered_in_the_lane_and_dropped_handles_freed_with_them(
    device: pykka.ActorRef[Any],
) -> None:
    child = _child(device)
    child.lane_spin = 30.0  # an asker waits for its claim however slowly the child wakes
    held = None
    for _ in range(100):
        held = None  # its free rides in the next request
        held = device.ask(xa.Allocate(4096, tag=xa.AllocTag("lane")))
    assert child.lane_answers >= 90  # (a few may meet a busy proxy and take the pipe)
    assert isinstance(held, xa.GpuRef) and held.generation == 0 and held.tag == "lane"
    held.access()
    stats = device.ask(xa.GetStats())
    assert (stats.bytes_outstanding, stats.live_blocks) == (4096, 1)
    assert stats.report["by_tag"]["lane"]["count"] == 1
    del held
    assert device.ask(xa.GetStats()).bytes_outstanding == 0


def test_an_error_comes_typed_on_the_pipe_and_changes_nothing(device: pykka.ActorRef[Any]) -> None:
    child = _child(device)
    kept = device.ask(xa.Allocate(4096))
    with pytest.raises(xa.BudgetExceeded):
        device.ask(xa.Allocate(1 << 20))
    with pytest.raises(xa.StreamMisuse):
        device.ask(xa.Allocate(64, stream=xa.StreamId(999)))
    answered = child.lane_answers  # neither error was answered in the lane
    assert device.ask(xa.GetStats()).bytes_outstanding == 4096
    # The lane still serves: an asker now waits for its claim as long as the child takes (no slow
    # wake-up can send it to the pipe), and the proxy is idle between asks, so the first of these
    # allocations goes through the lane by construction; the loop only bounds a broken lane.
    child.lane_spin = 30.0
    again = []
    while child.lane_answers == answered and len(again) < 50:
        again.append(device.ask(xa.Allocate(4096)))
    assert child.lane_answers > answered, f"{len(again)} allocations, none answered in the lane"
    assert kept.block.ptr not in {ref.block.ptr for ref in again}


def test_askers_that_stop_waiting_at_once_are_still_answered_and_nothing_leaks(
    device: pykka.ActorRef[Any], run_threads: Callable[..., list[BaseException]]
) -> None:
    """Whichever wins, the asker abandoning its request or the child claiming it, every
    allocation is answered once and every slot comes back."""
    child = _child(device)
    child.lane_spin = 0.0

    def churn() -> None:
        for _ in range(50):
            ref = device.ask(xa.Allocate(1024))
            assert isinstance(ref, xa.GpuRef)
            del ref

    errors = run_threads(churn, 4, 40)
    assert not errors, errors[:3]
    assert device.ask(xa.GetStats()).bytes_outstanding == 0
    child.lane_spin = 1.0
    slots = [child.lane.claim() for _ in range(lanes.SLOTS)]
    deadline = time.monotonic() + 5
    while -1 in slots and time.monotonic() < deadline:  # the child puts abandoned slots back
        for i, slot in enumerate(slots):
            if slot < 0:
                slots[i] = child.lane.claim()
        time.sleep(0.01)
    assert sorted(slots) == list(range(lanes.SLOTS))
    for slot in slots:
        child.lane.release(slot, False)
    assert device.ask(xa.Allocate(64)).nbytes == 64


def test_a_child_killed_while_an_asker_waits_in_the_lane_is_served_by_the_next(device: pykka.ActorRef[Any]) -> None:
    child = _child(device)
    child.lane_spin = 30.0  # the asker would wait this long for a claim
    pid = device.ask(ChildTimeline())["pid"]
    os.kill(pid, signal.SIGSTOP)  # it cannot claim the request
    outcome: list[BaseException | object] = []

    def ask() -> None:
        try:
            outcome.append(device.ask(xa.Allocate(64), timeout=40))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.2)
    assert not outcome  # posted, waiting
    os.kill(pid, signal.SIGKILL)
    asker.join(20)
    assert not asker.is_alive(), "the asker hangs on a dead child's lane"
    # An allocation names no handle: the one in flight at the death goes to the next process.
    assert isinstance(outcome[0], xa.GpuRef) and outcome[0].generation == 1, outcome
    fresh = [device.ask(xa.Allocate(64)) for _ in range(5)]
    assert fresh[-1].generation == 1 and _child(device).lane_answers >= 1  # the new child has a lane


def test_a_request_is_served_after_the_pipe_frames_its_asker_sent_before_it(device: pykka.ActorRef[Any]) -> None:
    """The hazard the pipe count guards: a free sent on the pipe, then an allocation posted in
    the lane that fits the 4 KiB budget only once that free ran, both waiting for a stopped child.
    Resumed, the child sees both at once; it must read the frame first (without the count it
    serves the lane first and the allocation is refused)."""
    device.stop()
    device = xa.DeviceActor.start(0, "host", resource="async+budget:4KiB", isolate=True)
    child = _child_when_started(device)
    child.lane_spin = 30.0
    ref = device.ask(xa.Allocate(4096))
    pid = device.ask(ChildTimeline())["pid"]
    for _ in range(3):
        os.kill(pid, signal.SIGSTOP)
        device.tell(xa.Free(ref))
        deadline = time.monotonic() + 5
        sent = child.proc.channel.sent
        while device.actor_inbox.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)  # the proxy sends the free
        time.sleep(0.1)
        assert child.proc.channel.sent >= sent
        outcome: list[Any] = []
        asker = threading.Thread(target=_ask_into, args=(device, xa.Allocate(4096), outcome))
        asker.start()
        time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        asker.join(20)
        assert isinstance(outcome[0], xa.GpuRef), outcome  # BudgetExceeded if it overtook the free
        ref = outcome[0]
    assert child.lane_answers >= 3
    device.stop()


def _child_when_started(device: pykka.ActorRef[Any]) -> Any:
    device.ask(xa.GetStats())
    return _child(device)


def _ask_into(device: pykka.ActorRef[Any], message: Any, outcome: list[Any]) -> None:
    try:
        outcome.append(device.ask(message, timeout=30))
    except BaseException as exc:  # noqa: BLE001 - the caller checks it
        outcome.append(exc)


@pytest.mark.gpu
def test_on_the_gpu_allocations_come_through_the_lane_and_hold_the_childs_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import numpy as np

    monkeypatch.setattr(_proxy, "CALL_LANE", True)
    device = xa.DeviceActor.start(0, "cuda", isolate=True)
    try:
        child = _child_when_started(device)
        copier = xa.CopyActor.start(device)
        refs = [device.ask(xa.Allocate(1 << 16)) for _ in range(50)]
        assert child.lane_answers >= 45
        assert len({ref.block.ptr for ref in refs}) == 50 and all(ref.generation == 0 for ref in refs)
        for i, ref in enumerate(refs[:5]):
            values = np.arange(16384, dtype=np.float32) + i
            copier.ask(xa.CopyToDevice(ref, values))
            assert np.frombuffer(copier.ask(xa.CopyToHost(ref)), np.float32).tolist() == values.tolist()
        del ref  # the loop's name held the fifth
        refs.clear()
        assert device.ask(xa.GetStats()).bytes_outstanding == 0
    finally:
        device.stop()
