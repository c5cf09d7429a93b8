"""The device actor serves the ``Allocate``/``AllocateMany``/``Free`` messages queued together at
the head of its inbox in one wake-up, keeping the order of messages, each asker's own answer, and
every counter exact.

Every scenario blocks the actor inside a ``GetStats`` (its ``mem_info`` waits on an event the
test holds), queues messages behind it, then lets it go: what was queued is then waiting at once.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.pykka_internals import BATCH_LIMIT

TIMEOUT = 10


class Unbatched(xa.DeviceActor):
    """The device actor with batched service switched off: one message per wake-up."""

    batch_types = ()


@pytest.fixture(autouse=True)
def stop_all(host_driver: xa.HostDriver) -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all()


class Gate:
    """Blocks the device actor inside the next ``GetStats`` until :meth:`open` is called."""

    def __init__(self, driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside, self.release, self.armed = threading.Event(), threading.Event(), False
        real = driver.mem_info

        def mem_info(ordinal: int) -> tuple[int, int]:
            if self.armed:
                self.armed = False
                self.inside.set()
                assert self.release.wait(TIMEOUT)
            return real(ordinal)

        monkeypatch.setattr(driver, "mem_info", mem_info)

    def block(self, device: pykka.ActorRef[Any]) -> pykka.Future[Any]:
        """Ask a ``GetStats`` that blocks the actor; return once the actor is inside it."""
        self.armed = True
        future = device.ask(xa.GetStats(), block=False)
        assert self.inside.wait(TIMEOUT)
        return future

    def open(self) -> None:
        self.release.set()


def stats(device: pykka.ActorRef[Any]) -> xa.DeviceStats:
    return device.ask(xa.GetStats(), timeout=TIMEOUT)


@pytest.fixture
def gate(host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch) -> Gate:
    return Gate(host_driver, monkeypatch)


@pytest.mark.parametrize("actor_class", [xa.DeviceActor, Unbatched], ids=["batched", "unbatched"])
def test_queued_allocations_are_served_in_one_wake_up(
    host_driver: xa.HostDriver, gate: Gate, monkeypatch: pytest.MonkeyPatch, actor_class: type[xa.DeviceActor]
) -> None:
    device = actor_class.start(0, host_driver)
    assert stats(device).batches == 0
    checks = [0]
    real_check = host_driver.check_context

    def check_context(ordinal: int) -> None:
        checks[0] += 1
        real_check(ordinal)

    monkeypatch.setattr(host_driver, "check_context", check_context)
    blocked = gate.block(device)
    futures = [device.ask(xa.Allocate(256), block=False) for _ in range(10)]
    many = device.ask(xa.AllocateMany([128, 128]), block=False)
    gate.open()
    blocked.get(timeout=TIMEOUT)
    refs = [f.get(timeout=TIMEOUT) for f in futures] + many.get(timeout=TIMEOUT)
    assert len({r.raw_device_ptr() for r in refs}) == 12
    s = stats(device)
    if actor_class is Unbatched:
        # The test has teeth: with batching off, the same scenario shows no batch, and one
        # context check per message.
        assert (s.batches, s.batched_messages, s.largest_batch) == (0, 0, 0)
        assert checks[0] == 1 + 11 + 1
    else:
        assert (s.batches, s.batched_messages, s.largest_batch) == (1, 11, 11)
        assert checks[0] == 1 + 1 + 1  # the blocked GetStats, the batch once, the last GetStats
    assert s.bytes_outstanding == 10 * 256 + 2 * 128 and s.live_blocks == 12
    del refs, futures, many
    gc.collect()
    assert stats(device).bytes_outstanding == 0 and host_driver.live_allocations(0) == 0


def test_a_batch_holds_at_most_the_limit(host_driver: xa.HostDriver, gate: Gate) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    futures = [device.ask(xa.Allocate(64), block=False) for _ in range(BATCH_LIMIT + 3)]
    gate.open()
    blocked.get(timeout=TIMEOUT)
    refs = [f.get(timeout=TIMEOUT) for f in futures]
    s = stats(device)
    assert (s.batches, s.batched_messages, s.largest_batch) == (2, BATCH_LIMIT + 3, BATCH_LIMIT)
    assert s.live_blocks == len(refs)


def test_order_is_kept_a_get_stats_between_allocations_sees_exactly_the_first(
    host_driver: xa.HostDriver, gate: Gate
) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    first = device.ask(xa.Allocate(1024), block=False)
    between = device.ask(xa.GetStats(), block=False)
    second = device.ask(xa.Allocate(2048), block=False)
    gate.open()
    blocked.get(timeout=TIMEOUT)
    seen: xa.DeviceStats = between.get(timeout=TIMEOUT)
    assert (seen.bytes_outstanding, seen.live_blocks) == (1024, 1)
    refs = [first.get(timeout=TIMEOUT), second.get(timeout=TIMEOUT)]
    assert [r.access().nbytes for r in refs] == [1024, 2048]
    # Each allocation was alone between other messages: no batch.
    assert stats(device).batches == 0


def test_frees_and_allocations_interleave_in_order(host_driver: xa.HostDriver, gate: Gate) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    held = [device.ask(xa.Allocate(512), timeout=TIMEOUT) for _ in range(3)]
    blocked = gate.block(device)
    answers = [device.ask(xa.Free(held[0]), block=False), device.ask(xa.Allocate(256), block=False)]
    device.tell(xa.Free(held[1]))
    answers.append(device.ask(xa.Free(held[1]), block=False))  # idempotent, after the told one
    gate.open()
    blocked.get(timeout=TIMEOUT)
    assert answers[0].get(timeout=TIMEOUT) is None and answers[2].get(timeout=TIMEOUT) is None
    new = answers[1].get(timeout=TIMEOUT)
    s = stats(device)
    assert s.largest_batch == 4
    assert held[0].released and held[1].released and not held[2].released
    assert (s.live_blocks, s.bytes_outstanding) == (2, 512 + 256)
    assert new.access().nbytes == 256


@pytest.mark.parametrize("bad", [xa.Allocate(-1), xa.Allocate(64, stream=xa.StreamId(999)), xa.Allocate(64, tag=3)])
def test_a_bad_allocation_in_a_batch_gets_its_own_error_and_harms_nobody(
    host_driver: xa.HostDriver, gate: Gate, bad: xa.Allocate
) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    before = [device.ask(xa.Allocate(256), block=False) for _ in range(3)]
    wrong = device.ask(bad, block=False)
    told_free = xa.Free("not a handle")  # type: ignore[arg-type]
    device.tell(told_free)  # a told message that fails: logged and dropped, the batch goes on
    after = [device.ask(xa.Allocate(256), block=False) for _ in range(3)]
    gate.open()
    blocked.get(timeout=TIMEOUT)
    with pytest.raises((xa.InvalidRequest, xa.StreamMisuse)):
        wrong.get(timeout=TIMEOUT)
    refs = [f.get(timeout=TIMEOUT) for f in before + after]
    assert all(r.access().nbytes == 256 for r in refs)
    s = stats(device)
    assert s.largest_batch == 8 and s.status == "running" and s.restarts == 0
    assert (s.live_blocks, s.bytes_outstanding) == (6, 6 * 256)
    assert host_driver.live_allocations(0) == 6
    del refs, before, after
    gc.collect()
    s = stats(device)
    assert (s.live_blocks, s.bytes_outstanding) == (0, 0) and host_driver.live_allocations(0) == 0
    assert device.is_alive()


def test_a_told_free_that_fails_in_a_batch_reaches_on_told_failure(
    host_driver: xa.HostDriver, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    first = device.ask(xa.Allocate(64), block=False)
    device.tell(xa.Free(42))  # type: ignore[arg-type]
    last = device.ask(xa.Allocate(64), block=False)
    with caplog.at_level("WARNING", logger="xlog_actors.actors.device_actor"):
        gate.open()
        blocked.get(timeout=TIMEOUT)
        refs = [first.get(timeout=TIMEOUT), last.get(timeout=TIMEOUT)]
        assert stats(device).largest_batch == 3
    assert any("dropped a told Free message" in r.getMessage() for r in caplog.records)
    assert len(refs) == 2 and device.is_alive()


def test_a_stop_queued_behind_allocations_is_never_overtaken_and_nothing_leaks(
    host_driver: xa.HostDriver, gate: Gate
) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    before = [device.ask(xa.Allocate(256), block=False) for _ in range(5)]
    stopped = device.stop(block=False)
    behind = device.ask(xa.Allocate(256), block=False)
    gate.open()
    blocked.get(timeout=TIMEOUT)
    refs = [f.get(timeout=TIMEOUT) for f in before]  # served before the stop: never overtaken
    assert stopped.get(timeout=TIMEOUT) is True
    with pytest.raises(pykka.ActorDeadError):
        behind.get(timeout=TIMEOUT)
    # The stop freed every block it handed out; the handles say so.
    assert host_driver.live_allocations(0) == 0
    for ref in refs:
        with pytest.raises(xa.GpuRefStale):
            ref.access()


def test_a_batch_of_a_broken_device_answers_each_asker_with_the_status_error(
    host_driver: xa.HostDriver, gate: Gate
) -> None:
    device = xa.DeviceActor.start(0, host_driver)
    blocked = gate.block(device)
    host_driver.inject_fault(0, "sticky")
    futures = [device.ask(xa.Allocate(64), block=False) for _ in range(4)]
    gate.open()
    blocked.get(timeout=TIMEOUT)
    for future in futures:
        with pytest.raises(xa.ContextPoisoned):
            future.get(timeout=TIMEOUT)
    s = stats(device)
    assert s.status == "poisoned" and s.largest_batch == 4
    assert device.is_alive()
