"""A host kernel that touches memory outside the allocations live on the device is caught, as
compute-sanitizer's memcheck catches it, and reported as the sticky illegal-address error: the
device is poisoned (``ContextPoisoned``, ``CUDA_ERROR_ILLEGAL_ADDRESS``) and the supervision path
sees it, exactly as for an injected sticky fault. In-bounds launches are untouched, including
those that use memory a stream-ordered free has not released yet.

Host-only: on a GPU these launches would poison the test process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.driver.host.memory import Allocations
from xlog_actors.errors import ContextPoisoned, DriverError, InvalidRequest
from xlog_actors.kernels import FILL_F32, SCALE_ADD_F32, SUM_F32, launch_shape

KIB = 1024
ILLEGAL_ADDRESS = "CUDA_ERROR_ILLEGAL_ADDRESS"


@pytest.fixture
def drv() -> Iterator[xa.HostDriver]:
    d = xa.HostDriver(device_count=2, memory_per_device=16 << 20)
    yield d
    d.close()


def floats(drv: xa.HostDriver, ptr: int, n: int, stream: xa.HostStream) -> list[float]:
    out = drv.copy_to_host(ptr, 4 * n, stream)
    stream.synchronize()
    return np.frombuffer(out, np.float32).tolist()


def hold(drv: xa.HostDriver, stream: xa.HostStream) -> threading.Event:
    """Block ``stream`` until the returned event is set: the work enqueued behind it runs later
    than anything the test does meanwhile, whatever the machine's load."""
    gate = threading.Event()
    blocker = xa.Kernel(name="hold", source="", params=(), host=lambda mem, grid, block: gate.wait(10))
    drv.launch(blocker, 1, 1, [], stream)
    return gate


def assert_poisoned(drv: xa.HostDriver, stream: xa.HostStream) -> None:
    """The sticky illegal address surfaces at the sync and stays; the other device is fine."""
    with pytest.raises(ContextPoisoned) as info:
        stream.synchronize()
    assert info.value.code == ILLEGAL_ADDRESS
    with pytest.raises(ContextPoisoned):
        drv.alloc(0, 64)
    with pytest.raises(ContextPoisoned):
        drv.rebuild_context(0)
    drv.free(1, drv.alloc(1, 64))


def test_fill_past_the_end_of_its_buffer_poisons_the_device(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, KIB)
    neighbour = drv.alloc(0, 4 * KIB)  # the bytes the overrun would have hit
    drv.fill(neighbour, 0x11, 4 * KIB, s)
    drv.launch(FILL_F32, *launch_shape(1024), [ptr, 1.0, 1024], s)  # 4 KiB into a 1 KiB buffer
    assert_poisoned(drv, s)


def test_the_same_fill_in_bounds_runs(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, KIB)
    drv.launch(FILL_F32, *launch_shape(256), [ptr, 1.5, 256], s)
    assert floats(drv, ptr, 256, s) == [1.5] * 256
    drv.free(0, ptr)


def test_the_alignment_padding_is_outside_the_allocation(drv: xa.HostDriver) -> None:
    """1000 bytes are allocated (1024 reserved): the 1024th byte is out of bounds, as
    compute-sanitizer reports it against the requested size."""
    s = drv.create_stream(0)
    ptr = drv.alloc(0, 1000)
    drv.launch(FILL_F32, 1, 256, [ptr, 1.0, 250], s)
    assert floats(drv, ptr, 250, s) == [1.0] * 250
    drv.launch(FILL_F32, 1, 256, [ptr, 1.0, 256], s)
    assert_poisoned(drv, s)


@pytest.mark.parametrize("offset", [-4, 4], ids=["starts-before", "runs-into-the-next-allocation"])
def test_a_read_outside_its_buffer_poisons(drv: xa.HostDriver, offset: int) -> None:
    s = drv.create_stream(0)
    x, neighbour, out = (drv.alloc(0, 4 * KIB) for _ in range(3))
    assert neighbour == x + 4 * KIB  # adjacent: the overrun lands in live memory, still caught
    drv.launch(SCALE_ADD_F32, 1, 256, [out, x + offset, 2.0, 0.0, KIB], s)
    assert_poisoned(drv, s)


def test_a_kernel_on_memory_freed_before_it_ran_poisons(drv: xa.HostDriver) -> None:
    s, other = drv.create_stream(0), drv.create_stream(0)
    ptr = drv.alloc(0, KIB)
    drv.free_async(ptr, other)
    s.wait(other.record_event())  # the kernel is ordered after the free took effect
    drv.launch(FILL_F32, 1, 256, [ptr, 1.0, 256], s)
    assert_poisoned(drv, s)


def test_stream_ordered_free_after_the_kernel_keeps_its_memory_until_it_ran(drv: xa.HostDriver) -> None:
    """The kernel is enqueued before the free on the same stream, and the memory is handed out
    again (on that stream) before either ran: legal in CUDA, so nothing is reported."""
    s = drv.create_stream(0)
    src = drv.alloc_async(4 * KIB, s)
    out = drv.alloc_async(4 * KIB, s)
    drv.fill(src, 0, 4 * KIB, s)
    gate = hold(drv, s)
    drv.launch(SCALE_ADD_F32, 1, 256, [out, src, 1.0, 3.0, KIB], s)
    drv.free_async(src, s)
    again = drv.alloc_async(KIB, s)  # reuses the start of src's range before its free ran
    later = drv.alloc_async(KIB, s)  # and the next KiB of it
    assert src <= again < later < src + 4 * KIB
    gate.set()
    assert floats(drv, out, KIB, s) == [3.0] * KIB
    drv.launch(FILL_F32, 1, 256, [again, 2.0, 256], s)
    assert floats(drv, again, 256, s) == [2.0] * 256
    drv.launch(FILL_F32, 1, 256, [again, 2.0, 257], s)  # src's range is gone now: past `again`
    assert_poisoned(drv, s)


def test_a_negative_count_is_an_illegal_address(drv: xa.HostDriver) -> None:
    def backwards(mem: Any, grid: Any, block: Any, ptr: int) -> None:
        mem.array(ptr, -1, np.uint8)

    kernel = xa.Kernel(name="k", source="", params=("ptr",), host=backwards)
    s = drv.create_stream(0)
    drv.launch(kernel, 1, 1, [drv.alloc(0, 64)], s)
    assert_poisoned(drv, s)


def test_sum_with_a_block_larger_than_its_shared_memory_poisons(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    out, x = drv.alloc(0, 8), drv.alloc(0, KIB)
    drv.fill(out, 0, 8, s)
    drv.fill(x, 0, KIB, s)
    drv.launch(SUM_F32, 1, 256, [out, x, 256], s)
    s.synchronize()
    drv.launch(SUM_F32, 1, 512, [out, x, 256], s)
    assert_poisoned(drv, s)


def test_a_refused_launch_changes_nothing(drv: xa.HostDriver) -> None:
    """Refused before the gate: no work enqueued and no injected fault counted."""
    s = drv.create_stream(0)
    ptr = drv.alloc(0, KIB)
    drv.inject_fault(0, "error")
    for grid, args in ((0, [ptr, 1.0, 256]), (1, [ptr, 1.0, 2.5])):
        with pytest.raises((DriverError, InvalidRequest)):
            drv.launch(FILL_F32, grid, 256, args, s)
    with pytest.raises(DriverError, match="injected"):
        drv.fill(ptr, 0, KIB, s)  # the fault was still pending: the refused launches passed no gate
    drv.launch(FILL_F32, 1, 256, [ptr, 4.0, 256], s)
    assert floats(drv, ptr, 256, s) == [4.0] * 256


def test_allocation_records_answer_nested_and_adjacent_ranges() -> None:
    records = Allocations()
    assert not records.covers(0, 1)
    records.add(0, 4096)  # freed on a stream, not yet released
    records.add(0, 1024)  # its start handed out again
    records.add(1024, 1024)  # and the next KiB
    assert records.covers(0, 4096) and records.covers(1536, 2560)
    assert not records.covers(1536, 2561) and not records.covers(4095, 2)
    records.remove(0, 4096)
    assert records.covers(0, 1024) and records.covers(1536, 512)
    assert not records.covers(512, 1024), "two adjacent allocations are not one"
    assert len(records) == 2
    records.remove(0, 1024)
    records.remove(1024, 1024)
    assert len(records) == 0 and not records.covers(0, 1)
    with pytest.raises(KeyError):
        records.remove(0, 1024)


def test_an_out_of_bounds_kernel_reaches_the_supervisor_as_context_poisoned(host_driver: xa.HostDriver) -> None:
    hook: list[tuple[int, str, str | None]] = []

    def on_poisoned(device_id: int, error: BaseException) -> None:
        hook.append((device_id, type(error).__name__, getattr(error, "code", None)))

    device = xa.DeviceActor.start(0, host_driver, supervisor=xa.Supervisor(on_poisoned=on_poisoned))
    try:
        kernels, copy = xa.KernelActor.start(device), xa.CopyActor.start(device)
        small, other = device.ask(xa.Allocate(KIB)), device.ask(xa.Allocate(KIB))
        kernels.ask(xa.Launch(FILL_F32, 1, 256, [xa.Out(small), 2.0, 256]))  # in bounds: fine
        assert np.frombuffer(copy.ask(xa.CopyToHost(small)), np.float32).tolist() == [2.0] * 256
        kernels.ask(xa.Launch(FILL_F32, 4, 256, [xa.Out(small), 1.0, 1024]))  # 3 KiB past the end
        with pytest.raises(xa.ContextPoisoned) as info:
            copy.ask(xa.CopyToHost(small))  # ordered after the kernel's write: it meets the fault
        assert info.value.code == ILLEGAL_ADDRESS
        deadline = time.monotonic() + 5
        while device.ask(xa.GetStats()).status != "poisoned":
            assert time.monotonic() < deadline, device.ask(xa.GetStats())
            time.sleep(0.01)
        for ref in (small, other):
            with pytest.raises(xa.GpuRefStale) as stale:
                ref.access()
            assert stale.value.reason == "context poisoned"
        assert hook == [(0, "ContextPoisoned", ILLEGAL_ADDRESS)]
        with pytest.raises(xa.ContextPoisoned):
            device.ask(xa.Allocate(64))
        assert device.is_alive()
    finally:
        pykka.ActorRegistry.stop_all()
