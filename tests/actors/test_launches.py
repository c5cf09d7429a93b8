"""``Launches``: several kernels in one message to a ``KernelActor``: in stream order, tracked
once as a whole, and refused as a whole before anything is enqueued."""

from __future__ import annotations

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.driver.kernel_library import CHECKSUM_U32, FILL_F32, SCALE_ADD_F32, launch_shape
from xlog_actors.errors import DriverError, InvalidRequest


def _f32(copy: pykka.ActorRef, ref: xa.GpuRef) -> np.ndarray:
    return np.frombuffer(copy.ask(xa.CopyToHost(ref)), np.float32)


def test_a_later_launch_reads_what_an_earlier_one_wrote(device: pykka.ActorRef) -> None:
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    n = 4096
    x = (np.arange(n) % 31).astype(np.float32)
    rx, rout = device.ask(xa.Allocate(4 * n)), device.ask(xa.Allocate(4 * n))
    rsum = device.ask(xa.Allocate(8))
    copy.ask(xa.CopyToDevice(rx, x))
    copy.ask(xa.Fill(rsum, 0))
    grid, block = launch_shape(n)
    kernels.ask(xa.Launches([
        xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(rout), xa.In(rx), 2.0, 1.0, n]),
        xa.Launch(CHECKSUM_U32, grid, block, [xa.InOut(rsum), xa.In(rout), n]),
    ]))
    expected = np.float32(2.0) * x + np.float32(1.0)
    assert _f32(copy, rout).tolist() == expected.tolist()
    got_sum = int(np.frombuffer(copy.ask(xa.CopyToHost(rsum)), np.uint64)[0])
    assert got_sum == int(expected.view(np.uint32).astype(np.uint64).sum()) % (1 << 64)
    assert rout.last_write_stream == rsum.last_write_stream == kernels.proxy().stream_id.get()


@pytest.mark.parametrize(
    "track", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)], ids=["tracked", "untracked"]
)
def test_the_sequence_waits_for_a_slow_writer_on_another_stream(driver: xa.Driver, track: bool) -> None:
    """The first launch reads what a slow copy on another stream writes: right with tracking,
    wrong without (the test can fail)."""
    device = xa.DeviceActor.start(0, driver)
    try:
        writer = xa.CopyActor.start(device, track=track)
        kernels = xa.KernelActor.start(device, track=track)
        reader = xa.CopyActor.start(device, track=track)
        n = 1 << 16
        src, mid, out = (device.ask(xa.Allocate(4 * n)) for _ in range(3))
        reader.ask(xa.Fill(src, 0))
        reader.ask(xa.CopyToHost(src, nbytes=4))  # the zero fill is complete
        slow = src.context.runtime.stream_pool.resolve(writer.proxy().stream_id.get())
        driver.sleep(slow, 200_000)
        writer.ask(xa.CopyToDevice(src, np.full(n, 2.0, np.float32)))
        grid, block = launch_shape(n)
        kernels.ask(xa.Launches([
            xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(mid), xa.In(src), 3.0, 0.0, n]),
            xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(mid), 1.0, 1.0, n]),
        ]))
        got = _f32(reader, out)
        if track:
            assert (got == 7.0).all()
        else:
            assert not (got == 7.0).all(), "without tracking the sequence read before the slow copy landed"
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_refused_launch_enqueues_none_of_the_sequence(device: pykka.ActorRef) -> None:
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    n = 1024
    out = device.ask(xa.Allocate(4 * n))
    copy.ask(xa.Fill(out, 0))
    grid, block = launch_shape(n)
    first = xa.Launch(FILL_F32, grid, block, [xa.Out(out), 5.0, n])
    with pytest.raises(InvalidRequest, match=r"Launches\.launches\[1\]\.args"):
        kernels.ask(xa.Launches([first, xa.Launch(FILL_F32, grid, block, [xa.Out(out), 5.0])]))
    with pytest.raises(DriverError) as info:
        kernels.ask(xa.Launches([first, xa.Launch(FILL_F32, 0, block, [xa.Out(out), 5.0, n])]))
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    assert set(_f32(copy, out).tolist()) == {0.0}, "nothing of a refused sequence ran"
    kernels.ask(xa.Launches([first]))
    assert set(_f32(copy, out).tolist()) == {5.0}, "the actor lives on"


@pytest.mark.parametrize(
    "launches", [[], (), None, ["not a launch"]], ids=["empty list", "empty tuple", "none", "junk"]
)
def test_a_malformed_sequence_is_refused(device: pykka.ActorRef, launches: object) -> None:
    kernels = xa.KernelActor.start(device)
    with pytest.raises(InvalidRequest, match="Launches.launches"):
        kernels.ask(xa.Launches(launches))  # type: ignore[arg-type]


def test_a_launch_sent_again_is_checked_again_once_its_arguments_change(device: pykka.ActorRef) -> None:
    """The kernel actor keeps a sent Launch's checked form; a change to its argument list (a
    handle swapped, a bare GpuRef put in) must be seen, not served from what was kept."""
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    n = 1024
    a, b, out = (device.ask(xa.Allocate(4 * n)) for _ in range(3))
    copy.ask(xa.CopyToDevice(a, np.full(n, 1.0, np.float32)))
    copy.ask(xa.CopyToDevice(b, np.full(n, 5.0, np.float32)))
    grid, block = launch_shape(n)
    args: list[object] = [xa.Out(out), xa.In(a), 2.0, 0.0, n]
    launch = xa.Launch(SCALE_ADD_F32, grid, block, args)
    kernels.ask(launch)
    assert set(_f32(copy, out).tolist()) == {2.0}
    args[1] = xa.In(b)
    kernels.ask(launch)
    assert set(_f32(copy, out).tolist()) == {10.0}
    args[1] = b
    with pytest.raises(InvalidRequest, match="wrap a GpuRef"):
        kernels.ask(launch)


def test_a_kernel_actor_keeps_no_handle_of_a_launch_it_served(device: pykka.ActorRef) -> None:
    """Whatever the kernel actor keeps to judge a repeated launch faster, it holds no argument:
    once the asker drops the message and its handles, their memory goes back to the device."""
    import gc
    import time

    kernels = xa.KernelActor.start(device)
    n = 1024
    grid, block = launch_shape(n)
    before = device.ask(xa.GetStats()).bytes_outstanding
    for _ in range(3):
        a, out = device.ask(xa.Allocate(4 * n)), device.ask(xa.Allocate(4 * n))
        launch = xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(a), 2.0, 0.0, n])
        kernels.ask(launch)  # served in this thread
        kernels.ask(launch, timeout=10)  # served on the actor's thread
        del a, out, launch
    gc.collect()
    deadline = time.monotonic() + 60  # a bound against a hang (the sanitizers slow everything)
    while device.ask(xa.GetStats()).bytes_outstanding != before:
        assert time.monotonic() < deadline, "the kernel actor still holds handles of launches it served"
        time.sleep(0.01)
