"""The raw pipeline on a device of its choice behind a start gate (``raw_pipeline``'s ``ordinal``
and ``start_gate``), and the bench's run of it on several devices at once (``rows_multi.raw_at_once``):
the gate is passed once everything is made, on the device asked for; a worker that fails calls the
run off with its device named."""

from __future__ import annotations

import pytest

import xlog_actors as xa
from xlog_actors.cli.batches import BatchData
from xlog_actors.cli.bench.rows_multi import raw_at_once
from xlog_actors.cli.raw_pipeline import raw_pipeline

DEPTH = 2


def test_the_gate_opens_once_the_ring_is_made_on_the_device_asked_for() -> None:
    driver = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    seen: list[tuple[int, int]] = []
    try:
        result = raw_pipeline(driver, BatchData(DEPTH + 1, 1 << 12), 6, DEPTH, ordinal=1,
                              start_gate=lambda: seen.append((driver.live_allocations(0),
                                                              driver.live_allocations(1))))
        assert seen == [(0, 2 * DEPTH)], "one gate, after the ring was allocated, all of it on device 1"
        assert result.seconds > 0 and (driver.live_allocations(0), driver.live_allocations(1)) == (0, 0)
    finally:
        driver.close()


def test_a_gate_that_calls_the_run_off_leaves_nothing_behind() -> None:
    driver = xa.HostDriver(device_count=2, memory_per_device=64 << 20)

    def called_off() -> None:
        raise RuntimeError("called off")

    try:
        with pytest.raises(RuntimeError, match="called off"):
            raw_pipeline(driver, BatchData(DEPTH + 1, 1 << 12), 6, DEPTH, ordinal=1, start_gate=called_off)
        assert driver.live_allocations(1) == 0
    finally:
        driver.close()


def test_raw_at_once_times_every_device_from_the_first_start_to_the_last_end() -> None:
    assert raw_at_once("host", 2, 64 << 10, 6, depth=DEPTH) > 0


def test_a_worker_that_fails_calls_the_run_off_and_names_its_device() -> None:
    with pytest.raises(RuntimeError, match=r"raw pipeline on device 0: ValueError: .*multiple of 4"):
        raw_at_once("host", 2, 6, 4, depth=DEPTH)  # 6 bytes a batch: every worker refuses it
