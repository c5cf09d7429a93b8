"""The raw three-stream pipeline, the demo's yardstick (:mod:`xlog_actors.cli.raw_pipeline`): its
batch schedule, its kernel arguments, its error messages, its teardown, and on a GPU both
spellings of its CUDA loop. ``tests/cli/test_demo.py`` runs it end to end on every driver."""

from __future__ import annotations

import ctypes
import dataclasses
import struct

import pytest

import xlog_actors as xa
from xlog_actors.cli import raw_pipeline as raw
from xlog_actors.cli.batches import ALPHA, BETA, BatchData


def test_the_schedule_marks_the_batches_whose_slot_has_readers_to_wait_for() -> None:
    slots = [("slot 0",), ("slot 1",)]
    assert raw._schedule(5, 2, ["a", "b", "c"], slots) == [
        (False, "a", "slot 0"), (False, "b", "slot 1"),
        (True, "c", "slot 0"), (True, "a", "slot 1"), (True, "b", "slot 0"),
    ]


def test_the_kernel_arguments_are_packed_as_cuLaunchKernel_reads_them() -> None:
    array = raw._kernel_params(0x1000, 0x2000, 77)
    base = ctypes.addressof(array)
    assert struct.unpack_from("<QQf4xf4xQ", array) == (0x1000, 0x2000, ALPHA, BETA, 77)
    # the void*[] after the values: one pointer per parameter, each to its own 8-byte slot
    assert list(array[5:]) == [base + 8 * k for k in range(5)]


def test_a_kernel_of_other_parameters_is_refused_before_any_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raw, "SCALE_ADD_F32", dataclasses.replace(raw.SCALE_ADD_F32, params=("ptr", "ptr", "f32")))
    with pytest.raises(RuntimeError, match="SCALE_ADD_F32 takes"):
        raw._kernel_params(0x1000, 0x2000, 77)


def test_a_failed_raw_call_is_named_with_its_error() -> None:
    assert str(raw._failed("cuEventRecord", 400)) == "raw pipeline: cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE"
    assert str(raw._failed("cuEventRecord", 123456)) == "raw pipeline: cuEventRecord failed: 123456"


@pytest.mark.parametrize("beta", [BETA, 1.5])
def test_the_host_run_frees_what_it_made_whether_or_not_it_verifies(
    host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch, beta: float
) -> None:
    before = host_driver.mem_info(0)
    monkeypatch.setattr(raw, "BETA", beta)
    if beta == BETA:
        assert raw.raw_pipeline(host_driver, BatchData(3, 1 << 12), 7, 2).seconds > 0
    else:
        with pytest.raises(RuntimeError, match="differs from its host reference"):
            raw.raw_pipeline(host_driver, BatchData(3, 1 << 12), 7, 2)
    assert host_driver.mem_info(0) == before


@pytest.mark.gpu
@pytest.mark.parametrize("calls", ["held", "bindings"])
def test_each_cuda_spelling_runs_verifies_and_frees(calls: raw._CudaCalls, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = xa.CudaDriver()
    try:
        seconds, cpu = raw._cuda_run(driver, BatchData(5, 1 << 16), 12, 4, calls)
        assert seconds > 0 and cpu >= 0
        before = driver.mem_info(0)[0]  # after the first run, which loaded the kernel's module
        monkeypatch.setattr(raw, "BETA", 1.5)
        with pytest.raises(RuntimeError, match="differs from its host reference"):
            raw._cuda_run(driver, BatchData(3, 1 << 12), 6, 2, calls)
        assert driver.mem_info(0)[0] == before  # the failed run's ring went back
    finally:
        driver.close()
