"""CopyActor and KernelActor: correct results with no explicit synchronization, typed errors for
bad requests, and the hazard their tracking prevents."""

from __future__ import annotations

import threading
import time

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.driver.kernel_library import (
    AXPY_F32,
    FILL_F32,
    SCALE_ADD_F32,
    SUM_F32,
    launch_shape,
)


def _alloc_f32(device: pykka.ActorRef, n: int) -> xa.GpuRef:
    return device.ask(xa.Allocate(4 * n, tag=xa.AllocTag("test")))


def test_copy_round_trip_across_two_copy_actors(device: pykka.ActorRef) -> None:
    writer, reader = xa.CopyActor.start(device), xa.CopyActor.start(device)
    data = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    ref = device.ask(xa.Allocate(data.nbytes))
    writer.ask(xa.CopyToDevice(ref, data))
    assert ref.last_write_stream == writer.proxy().stream_id.get()
    assert reader.ask(xa.CopyToHost(ref)) == data.tobytes()
    assert reader.ask(xa.CopyToHost(ref, nbytes=10)) == data[:10].tobytes()


def test_fill_and_device_to_device(device: pykka.ActorRef) -> None:
    a, b = xa.CopyActor.start(device), xa.CopyActor.start(device)
    src, dst = device.ask(xa.Allocate(4096)), device.ask(xa.Allocate(8192))
    a.ask(xa.Fill(src, 0x5A))
    a.ask(xa.Fill(dst, 0x01))
    b.ask(xa.CopyDeviceToDevice(src, dst))
    out = a.ask(xa.CopyToHost(dst))
    assert out[:4096] == b"\x5a" * 4096 and out[4096:] == b"\x01" * 4096


def test_kernel_library_matches_host_reference(device: pykka.ActorRef) -> None:
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    n = 10_000
    x = (np.arange(n) % 97).astype(np.float32)
    y0 = (np.arange(n) % 13).astype(np.float32)
    rx, ry, rout, rsum = (_alloc_f32(device, n) for _ in range(3)), None, None, None
    rx, ry, rout = list(rx)
    rsum = device.ask(xa.Allocate(8))
    grid, block = launch_shape(n)
    copy.ask(xa.CopyToDevice(rx, x))
    copy.ask(xa.CopyToDevice(ry, y0))
    kernels.ask(xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(rout), xa.In(rx), 2.5, -1.0, n]))
    kernels.ask(xa.Launch(AXPY_F32, grid, block, [xa.InOut(ry), xa.In(rx), 0.5, n]))
    copy.ask(xa.Fill(rsum, 0))
    kernels.ask(xa.Launch(SUM_F32, grid, 256, [xa.Out(rsum), xa.In(rx), n]))
    scale_add = np.float32(2.5) * x + np.float32(-1.0)
    axpy = np.float32(0.5) * x + y0
    assert np.frombuffer(copy.ask(xa.CopyToHost(rout)), np.float32).tolist() == scale_add.tolist()
    assert np.frombuffer(copy.ask(xa.CopyToHost(ry)), np.float32).tolist() == axpy.tolist()
    assert np.frombuffer(copy.ask(xa.CopyToHost(rsum)), np.float64)[0] == float(x.sum(dtype=np.float64))
    kernels.ask(xa.Launch(FILL_F32, grid, block, [xa.Out(rout), 7.0, n]))
    assert set(np.frombuffer(copy.ask(xa.CopyToHost(rout)), np.float32).tolist()) == {7.0}
    assert rout.last_write_stream == kernels.proxy().stream_id.get()


@pytest.mark.parametrize(
    "track", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)], ids=["tracked", "untracked"]
)
def test_slow_writer_hazard_through_library_actors(driver: xa.Driver, track: bool) -> None:
    """A copy queued behind slow work on the writer's stream, read by a kernel on another
    stream: correct with tracking, stale without (the test proves it can fail)."""
    device = xa.DeviceActor.start(0, driver)
    try:
        writer = xa.CopyActor.start(device, track=track)
        kernels = xa.KernelActor.start(device, track=track)
        reader = xa.CopyActor.start(device, track=track)
        n = 1 << 16
        src, out = _alloc_f32(device, n), _alloc_f32(device, n)
        reader.ask(xa.Fill(src, 0))
        reader.ask(xa.CopyToHost(src, nbytes=4))  # the zero fill is complete
        ctx = src.context
        slow = ctx.runtime.stream_pool.resolve(writer.proxy().stream_id.get())
        driver.sleep(slow, 200_000)
        writer.ask(xa.CopyToDevice(src, np.full(n, 2.0, np.float32)))
        grid, block = launch_shape(n)
        kernels.ask(xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(src), 3.0, 0.0, n]))
        got = np.frombuffer(reader.ask(xa.CopyToHost(out)), np.float32)
        if track:
            assert (got == 6.0).all()
        else:
            assert not (got == 6.0).all(), "without tracking the kernel read before the slow copy landed"
    finally:
        pykka.ActorRegistry.stop_all()


def test_library_actors_on_the_untracked_direct_stack_stay_correct(driver: xa.Driver) -> None:
    device = xa.DeviceActor.start(0, driver, resource="direct")
    try:
        writer, kernels, reader = xa.CopyActor.start(device), xa.KernelActor.start(device), xa.CopyActor.start(device)
        n = 1 << 14
        src, out = _alloc_f32(device, n), _alloc_f32(device, n)
        slow = src.context.runtime.stream_pool.resolve(writer.proxy().stream_id.get())
        driver.sleep(slow, 100_000)
        writer.ask(xa.CopyToDevice(src, np.full(n, 1.5, np.float32)))
        grid, block = launch_shape(n)
        kernels.ask(xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(src), 2.0, 1.0, n]))
        assert (np.frombuffer(reader.ask(xa.CopyToHost(out)), np.float32) == 4.0).all()
    finally:
        pykka.ActorRegistry.stop_all()


def test_bad_requests_get_typed_errors_and_the_actors_live_on(device: pykka.ActorRef) -> None:
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    ref = device.ask(xa.Allocate(64))
    bad = [
        (copy, xa.CopyToDevice(ref, b"x" * 65), xa.InvalidRequest),
        (copy, xa.CopyToDevice(ref, b""), xa.InvalidRequest),
        (copy, xa.CopyToHost(ref, nbytes=0), xa.InvalidRequest),
        (copy, xa.CopyToHost(ref, nbytes=65), xa.InvalidRequest),
        (copy, xa.Fill(ref, 256), xa.InvalidRequest),
        (copy, xa.CopyToHost("not a ref"), xa.InvalidRequest),  # type: ignore[arg-type]
        (copy, xa.CopyDeviceToDevice(ref, ref), xa.InvalidRequest),
        (copy, "what?", xa.InvalidRequest),
        (kernels, xa.Launch(FILL_F32, 1, 1, [xa.Out(ref), 1.0]), xa.InvalidRequest),
        (kernels, xa.Launch(FILL_F32, 1, 1, [ref, 1.0, 16]), xa.InvalidRequest),
        (kernels, xa.Launch(FILL_F32, 1, 1, [1, 1.0, 16]), xa.InvalidRequest),
        (kernels, xa.Launch(FILL_F32, 1, 1, [xa.Out(ref), xa.In(ref), 16]), xa.InvalidRequest),
        (kernels, xa.Launch("fill", 1, 1, []), xa.InvalidRequest),  # type: ignore[arg-type]
    ]
    for actor, message, error in bad:
        with pytest.raises(error):
            actor.ask(message)
    copy.ask(xa.Fill(ref, 3))
    assert copy.ask(xa.CopyToHost(ref)) == b"\x03" * 64
    assert device.ask(xa.GetStats()).live_blocks == 1


def test_a_handle_of_another_device_is_refused() -> None:
    driver = xa.HostDriver(device_count=2, memory_per_device=16 << 20)
    try:
        d0, d1 = xa.DeviceActor.start(0, driver), xa.DeviceActor.start(1, driver)
        copy0 = xa.CopyActor.start(d0)
        other = d1.ask(xa.Allocate(64))
        with pytest.raises(xa.InvalidRequest, match="device 1"):
            copy0.ask(xa.Fill(other, 1))
        mine = d0.ask(xa.Allocate(64))
        copy0.ask(xa.Fill(mine, 9))
        assert copy0.ask(xa.CopyToHost(mine)) == b"\x09" * 64
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def test_stale_handles_after_rebuild_and_library_actors_follow(device: pykka.ActorRef) -> None:
    copy = xa.CopyActor.start(device)
    old = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(old, 1))
    old_stream = copy.proxy().stream_id.get()
    assert device.ask(xa.Rebuild("test")) == 1
    with pytest.raises(xa.GpuRefStale) as info:
        copy.ask(xa.Fill(old, 2))
    assert info.value.reason == "context rebuilt"
    new = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(new, 4))
    assert copy.ask(xa.CopyToHost(new)) == b"\x04" * 64
    assert new.generation == 1
    assert copy.proxy().stream_id.get() is not None and old_stream is not None


@pytest.mark.parametrize("resource", ["async", "direct"])
def test_work_racing_rebuilds_never_touches_freed_memory(driver: xa.Driver, resource: str) -> None:
    """Four copy actors keep filling and reading back their own large blocks while the device is
    rebuilt twelve times under them. A rebuild frees every block of the old generation (and
    gives the pool's memory back), so work that slipped onto a retired stream after the
    rebuild's synchronize would run on freed memory: on a GPU an illegal address, which poisons
    the process. Every piece of work must instead be correct or answer GpuRefStale."""
    device = xa.DeviceActor.start(0, driver, resource=resource)
    try:
        copies = [xa.CopyActor.start(device) for _ in range(4)]
        n = 4 << 20
        stop = threading.Event()
        outcomes: list[str] = []
        errors: list[BaseException] = []

        def work(k: int) -> None:
            byte = 16 + k
            while not stop.is_set():
                try:
                    src, dst = device.ask(xa.AllocateMany([n, n]))
                    copies[k].ask(xa.Fill(src, byte))
                    copies[k].ask(xa.CopyDeviceToDevice(src, dst))
                    got = copies[k].ask(xa.CopyToHost(dst, nbytes=4096))
                    assert got == bytes([byte]) * 4096, sorted(set(got))
                    outcomes.append("ok")
                except xa.GpuRefStale:
                    outcomes.append("stale")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for expected in range(1, 13):
            time.sleep(0.02)
            assert device.ask(xa.Rebuild("race")) == expected
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = device.ask(xa.GetStats())
        assert stats.status == "running" and stats.generation == 12, stats
        assert outcomes.count("ok") > 0, outcomes
        fresh = device.ask(xa.Allocate(64))
        copies[0].ask(xa.Fill(fresh, 3))
        assert copies[0].ask(xa.CopyToHost(fresh)) == b"\x03" * 64
    finally:
        pykka.ActorRegistry.stop_all()


def test_inputs_stay_alive_until_the_work_is_done(driver: xa.Driver) -> None:
    """Dropping a handle right after a copy into it was enqueued frees it only after the copy
    ran: the reallocated address is not overwritten by the late copy."""
    device = xa.DeviceActor.start(0, driver)
    try:
        writer, reader = xa.CopyActor.start(device), xa.CopyActor.start(device)
        ref = device.ask(xa.Allocate(1 << 16))
        slow = ref.context.runtime.stream_pool.resolve(writer.proxy().stream_id.get())
        driver.sleep(slow, 150_000)
        writer.ask(xa.CopyToDevice(ref, b"\x77" * (1 << 16)))
        del ref  # the free is queued behind the copy's write event
        fresh = device.ask(xa.Allocate(1 << 16))
        reader.ask(xa.Fill(fresh, 0x11))
        import time

        time.sleep(0.3)
        assert reader.ask(xa.CopyToHost(fresh)) == b"\x11" * (1 << 16)
    finally:
        pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize(("fault", "status", "reason"), [
    ("context_lost", "running", "context rebuilt"),
    ("sticky", "poisoned", "context poisoned"),
])
def test_a_context_failure_met_by_a_library_actor_reaches_the_supervisor(fault: str, status: str, reason: str) -> None:
    driver = xa.HostDriver(memory_per_device=16 << 20)
    hook: list[tuple[int, str]] = []
    try:
        device = xa.DeviceActor.start(
            0, driver, supervisor=xa.Supervisor(on_poisoned=lambda d, e: hook.append((d, type(e).__name__)))
        )
        copy = xa.CopyActor.start(device)
        copy.proxy().stream_id.get()  # on_start (and its attach) ran before the fault
        ref = device.ask(xa.Allocate(4096))
        driver.inject_fault(0, fault)  # type: ignore[arg-type]
        with pytest.raises((xa.ContextLost, xa.ContextPoisoned)):
            copy.ask(xa.Fill(ref, 1))
        import time

        deadline = time.monotonic() + 2
        while device.ask(xa.GetStats()).status != status or (
            fault == "context_lost" and device.ask(xa.GetStats()).generation != 1
        ):
            assert time.monotonic() < deadline, device.ask(xa.GetStats())
            time.sleep(0.01)
        with pytest.raises(xa.GpuRefStale) as info:
            ref.access()
        assert info.value.reason == reason
        if fault == "sticky":
            assert hook == [(0, "ContextPoisoned")]
        else:
            fresh = device.ask(xa.Allocate(4096))
            copy.ask(xa.Fill(fresh, 7))
            assert copy.ask(xa.CopyToHost(fresh, nbytes=4)) == b"\x07" * 4
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
