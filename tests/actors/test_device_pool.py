"""``DevicePool`` on the host driver with several emulated ordinals: the choice (least outstanding
work), routing, a device skipped while it restarts and rejoining after (its own generation bumped,
no other device's touched), and bad input."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault

MIB = 1 << 20


@pytest.fixture
def three() -> Iterator[xa.HostDriver]:
    driver = xa.HostDriver(device_count=3, memory_per_device=64 << 20)
    yield driver
    pykka.ActorRegistry.stop_all()
    driver.close()


def test_allocations_go_to_the_device_of_least_outstanding_work(three: xa.HostDriver) -> None:
    pool = xa.DevicePool.start(3, three)
    held = [pool.allocate(MIB) for _ in range(3)]
    assert sorted(r.device_id for r in held) == [0, 1, 2]  # one each: the loads were equal, in turn
    assert [m.outstanding_bytes for m in pool.members()] == [MIB, MIB, MIB]
    big = pool.allocate(4 * MIB)
    small = [pool.allocate(MIB) for _ in range(2)]
    assert big.device_id not in {r.device_id for r in small}  # the two lighter devices take the next two
    # Dropping a device's handle gives its bytes back: the heaviest device is the lightest again.
    freed = big.device_id
    assert [m.outstanding_bytes for m in pool.members()][freed] == 5 * MIB
    del big
    gc.collect()
    assert pool.pick().ordinal == freed
    assert pool.allocate(64).device_id == freed
    pool.stop()
    with pytest.raises(xa.DeviceUnavailable, match="stopped"):
        pool.pick()


def test_a_worker_gets_a_device_without_naming_it(three: xa.HostDriver) -> None:
    pool = xa.DevicePool.start([1, 2], three)
    chosen = pool.pick()
    assert chosen.ordinal in (1, 2) and chosen.generation == 0
    copy = xa.CopyActor.start(chosen.ref)
    ref = chosen.ref.ask(xa.Allocate(64))
    copy.ask(xa.Fill(ref, 7))
    assert copy.ask(xa.CopyToHost(ref)) == b"\x07" * 64
    pool.stop()


def test_a_poisoned_device_is_skipped_and_the_others_are_untouched(three: xa.HostDriver) -> None:
    pool = xa.DevicePool.start(3, three)
    keep = [pool.allocate(4096) for _ in range(3)]
    three.inject_fault(1, "sticky")
    got = [pool.allocate(4096) for _ in range(6)]  # device 1's turn fails and goes to another
    assert all(r.device_id != 1 for r in got)
    members = {m.ordinal: m for m in pool.members()}
    assert members[1].status in ("poisoned", "restarting")
    assert members[0].generation == members[2].generation == 0
    for r in keep:
        if r.device_id != 1:
            r.access()  # the other devices' handles are still good
    pool.stop()


def test_bad_input_is_refused(three: xa.HostDriver) -> None:
    with pytest.raises(xa.InvalidRequest, match="non-empty"):
        xa.DevicePool([])
    with pytest.raises(xa.InvalidRequest, match="not the ActorRef"):
        xa.DevicePool(["device 0"])  # type: ignore[list-item]
    dev = xa.DeviceActor.start(0, three)
    with pytest.raises(xa.InvalidRequest, match="two devices of ordinal 0"):
        xa.DevicePool([dev, dev])
    with pytest.raises(xa.InvalidRequest, match="count or a list"):
        xa.DevicePool.start("all", three)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest, match="no devices"):
        xa.DevicePool.start([], three)
    with pytest.raises(xa.InvalidRequest):
        xa.DevicePool.start([1, 7], three)  # ordinal 7 of three: device 1, started first, is stopped again
    pool = xa.DevicePool([dev])
    with pytest.raises(xa.InvalidRequest):
        pool.allocate(0)
    with pytest.raises(xa.InvalidRequest):
        pool.wait_serving(5)
    assert pool.members()[0].outstanding_bytes == 0 and pool.members()[0].status == "serving"
    pool.stop()
    dev.stop()
    with pytest.raises(xa.DeviceUnavailable, match="stopped"):
        xa.DevicePool([dev])


def test_an_isolated_device_is_skipped_while_it_restarts_and_rejoins_after() -> None:
    """Two isolated host devices (no hot spare: the restart spawns a process, which takes a
    while). Device 1's process dies: the pool skips it from the moment its death bumps its
    generation, so every allocation meanwhile is device 0's; then device 1 rejoins with its
    generation bumped, and device 0's generation and handles are as they were."""
    pool = xa.DevicePool.start(2, "host", isolate=True, hot_spare=False)
    try:
        first = [pool.allocate(4096) for _ in range(2)]
        assert sorted(r.device_id for r in first) == [0, 1]
        dev1 = pool.devices[1]
        with contextlib.suppress(xa.GpuRefStale, xa.DeviceUnavailable):
            dev1.ask(ChildFault("exit"))
        deadline = time.monotonic() + 10
        while pool.members()[1].status == "serving" and time.monotonic() < deadline:
            time.sleep(0.005)  # the death is seen by the device's reader thread
        while_restarting: list[Any] = []
        while pool.members()[1].status == "restarting" and len(while_restarting) < 20:
            while_restarting.append(pool.allocate(4096))
        assert while_restarting and {r.device_id for r in while_restarting} == {0}
        member = pool.wait_serving(1, 60.0)
        assert member.generation == 1 and member.rejoins == 1
        assert pool.members()[0].generation == 0
        for r in first:
            if r.device_id == 0:
                r.access()  # device 0's handles are untouched
        again = [pool.allocate(4096) for _ in range(3)]
        assert 1 in {r.device_id for r in again}
        assert dev1.ask(xa.GetStats()).generation == 1
    finally:
        pool.stop()


def test_a_rebuilt_device_rejoins_with_its_generation_bumped_and_no_other(three: xa.HostDriver) -> None:
    pool = xa.DevicePool.start(3, three)
    held = [pool.allocate(MIB) for _ in range(3)]
    assert pool.devices[2].ask(xa.Rebuild("test")) == 1
    member = pool.wait_serving(2, 10.0)
    deadline = time.monotonic() + 10
    while pool.members()[2].generation != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    members = pool.members()
    assert [m.generation for m in members] == [0, 0, 1] and member.status == "serving"
    assert members[2].outstanding_bytes == 0  # its old handles went with its old context
    assert [m.outstanding_bytes for m in members[:2]] == [MIB, MIB]
    assert pool.allocate(64).device_id == 2
    for r in held:
        if r.device_id != 2:
            r.access()
    pool.stop()
