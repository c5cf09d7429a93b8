"""The memory report and adaptors as the device actor exposes them."""

from __future__ import annotations

import csv
import gc
from collections.abc import Iterator
from pathlib import Path

import pykka
import pytest

import xlog_actors as xa


@pytest.fixture
def driver() -> Iterator[xa.HostDriver]:
    drv = xa.HostDriver(memory_per_device=64 << 20)
    yield drv
    pykka.ActorRegistry.stop_all()
    drv.close()


def test_stats_and_report_list_live_blocks_by_tag_and_stream(driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver, resource="async+stats")
    client = device.ask(xa.GetClient())
    a = [client.allocate(1024, tag=xa.AllocTag("weights")) for _ in range(3)]
    b = device.ask(xa.Allocate(4096, tag=xa.AllocTag("activations")))
    stats = device.ask(xa.GetStats())
    assert stats.stack == "async+stats"
    assert stats.report["by_tag"]["weights"]["count"] == 3
    assert stats.report["by_tag"]["activations"]["nbytes"] == 4096
    assert stats.report["statistics"]["current_count"] == 4
    assert "blocks" not in stats.report
    report = device.ask(xa.GetReport())
    assert len(report.blocks) == 4 and all(blk.age_s is not None and blk.age_s >= 0 for blk in report.blocks)
    assert "weights: 3 blocks" in report.format()
    del a, b
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.report["statistics"]["current_count"] == 0 and stats.report["by_tag"] == {}


@pytest.mark.parametrize("resource", ["async", "async+cache"])
@pytest.mark.parametrize("through", ["actor", "client"])
def test_out_of_memory_says_what_was_asked_what_is_free_and_the_largest_tags(
    driver: xa.HostDriver, resource: str, through: str
) -> None:
    device = xa.DeviceActor.start(0, driver, resource=resource)
    held = device.ask(xa.Allocate(40 << 20, tag=xa.AllocTag("big-cache")))
    with pytest.raises(xa.OutOfMemory) as info:
        if through == "actor":
            device.ask(xa.Allocate(48 << 20))
        else:
            device.ask(xa.GetClient()).allocate(48 << 20)
    message = str(info.value)
    assert info.value.requested == 48 << 20
    assert "asked for 48.0 MiB" in message and "device free" in message and "big-cache 40.0 MiB" in message
    assert device.ask(xa.GetStats()).bytes_outstanding == 40 << 20
    del held


def test_budget_exceeded_through_the_actor_changes_nothing(driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver, resource="async+budget:1MiB")
    keep = device.ask(xa.Allocate(768 << 10))
    with pytest.raises(xa.BudgetExceeded):
        device.ask(xa.Allocate(512 << 10))
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 768 << 10 and stats.live_blocks == 1 and stats.status == "running"
    del keep


def test_guard_corruption_through_the_actor_frees_the_block_and_reports_it(driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver, resource="async+guard")
    ref = device.ask(xa.Allocate(1000, tag=xa.AllocTag("victim")))
    block = ref.access()
    stream = ref.context.runtime.stream_pool.resolve(xa.StreamId.DEFAULT)
    driver.fill(block.ptr + 1024, 0x00, 1, stream)  # one byte past the 1024-byte rounded end
    with pytest.raises(xa.CorruptionDetected, match="victim"):
        device.ask(xa.Free(ref))
    assert ref.released
    stats = device.ask(xa.GetStats())
    assert stats.live_blocks == 0 and stats.bytes_outstanding == 0
    device.ask(xa.Free(ref))  # idempotent: nothing more to free


def test_logging_is_switched_on_by_the_environment(driver: xa.HostDriver, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "alloc.csv"
    monkeypatch.setenv("XLOG_ACTORS_LOG", str(path))
    device = xa.DeviceActor.start(0, driver)
    assert device.ask(xa.GetStats()).stack == f"async+log:{path}"
    ref = device.ask(xa.Allocate(256, tag=xa.AllocTag("logged")))
    device.ask(xa.Free(ref))
    device.stop()
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert [r["action"] for r in rows][:2] == ["allocate", "free"]
    assert rows[0]["tag"] == "logged" and int(rows[0]["size"]) == 256


def _wait_for(predicate, timeout: float = 2.0) -> bool:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_dropped_handles_are_freed_in_batches_and_large_ones_at_once(driver: xa.HostDriver) -> None:
    """Small dropped handles ride along with the device's next message (or a full batch); a
    large one, or release(), wakes the idle device at once."""
    from xlog_actors.actors.device_context import RECLAIM_BATCH, RECLAIM_WAKE_BYTES

    device = xa.DeviceActor.start(0, driver)
    small = device.ask(xa.Allocate(4096))
    del small
    gc.collect()
    assert not _wait_for(lambda: driver.live_allocations(0) == 0, timeout=0.2), "a small free waits for a message"
    device.ask(xa.GetStats())
    assert driver.live_allocations(0) == 0
    large = device.ask(xa.Allocate(RECLAIM_WAKE_BYTES))
    del large
    gc.collect()
    assert _wait_for(lambda: driver.live_allocations(0) == 0), "a large free wakes the device"
    refs = device.ask(xa.AllocateMany([4096] * RECLAIM_BATCH))
    del refs
    gc.collect()
    assert _wait_for(lambda: driver.live_allocations(0) == 0), "a full batch wakes the device"
    released = device.ask(xa.Allocate(4096))
    released.release()
    assert _wait_for(lambda: driver.live_allocations(0) == 0), "release() frees at once"
