"""``CopyActor.start(ref)`` and ``KernelActor.start(ref)`` on an isolated device, on the host driver:
the parent gets an ``IsolatedLibrary`` ref whose work runs on a real library actor in the device
process; bad input is refused and changes nothing; the ref survives a child restart, answers what
was in flight with a typed error and re-creates its child actor; a stopped device answers
``DeviceUnavailable``. Every test checks that no child process outlives it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault
from xlog_actors.actors.isolated._library import IsolatedLibrary
from xlog_actors.driver.kernel_library import FILL_F32, SCALE_ADD_F32

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_process")]

@pytest.fixture
def device() -> pykka.ActorRef[Any]:
    return xa.DeviceActor.start(0, "host", supervisor=xa.Supervisor(max_restarts=3), isolate=True)


def f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.float32)


def test_copies_and_kernels_run_in_the_device_process(device: pykka.ActorRef[Any]) -> None:
    copier, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    assert copier.actor_class is IsolatedLibrary and kernels.actor_class is IsolatedLibrary
    x, y = device.ask(xa.Allocate(64)), device.ask(xa.Allocate(64))
    values = np.arange(16, dtype=np.float32)
    assert copier.ask(xa.CopyToDevice(x, values)) is None
    assert f32(copier.ask(xa.CopyToHost(x))).tolist() == values.tolist()
    assert copier.ask(xa.CopyToHost(x, nbytes=8)) == values[:2].tobytes()
    copier.ask(xa.CopyToDevice(y, memoryview(values.tobytes())))  # a view crosses as its bytes
    copier.ask(xa.CopyToDevice(y, b"\x00" * 8))  # bytes too
    assert f32(copier.ask(xa.CopyToHost(y)))[:3].tolist() == [0.0, 0.0, 2.0]
    kernels.ask(xa.Launch(SCALE_ADD_F32, 1, 16, [xa.Out(y), xa.In(x), 2.0, 1.0, 16]))
    assert f32(copier.ask(xa.CopyToHost(y))).tolist() == (values * 2 + 1).tolist()
    kernels.ask(xa.Launches([xa.Launch(FILL_F32, 1, 16, [xa.Out(x), 3.0, 16])] * 2))
    copier.ask(xa.CopyDeviceToDevice(x, y))
    assert f32(copier.ask(xa.CopyToHost(y))).tolist() == [3.0] * 16
    copier.ask(xa.Fill(y, 0))
    assert copier.ask(xa.CopyToHost(y)) == bytes(64)
    copier.tell(xa.Fill(y, 1))  # a told message is served too, in order
    assert copier.ask(xa.CopyToHost(y, nbytes=2)) == b"\x01\x01"
    copier.stop()  # its actor in the child is stopped; the device serves on
    assert xa.CopyActor.start(device).ask(xa.CopyToHost(y, nbytes=1)) == b"\x01"


def test_bad_input_is_refused_and_changes_nothing(
    device: pykka.ActorRef[Any], foreign: tuple[xa.GpuRef, xa.PinnedBuffer]
) -> None:
    copier, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 7))
    other_ref, pinned = foreign
    refused = [
        (copier, xa.CopyToDevice(ref, pinned), "PinnedBuffer cannot cross"),
        (copier, xa.CopyToHost(ref, out=pinned), "pinned memory cannot cross"),
        (copier, xa.CopyDeviceToDevice(other_ref, ref), "not a handle of isolated device 0"),
        (kernels, xa.Launch(FILL_F32, 1, 16, [xa.Out(other_ref), 1.0, 16]), "not a handle of isolated device 0"),
        (copier, xa.Fill(ref, 300), "Fill.byte"),  # judged by the actor in the child
        (copier, xa.CopyToDevice(ref, bytes(65)), "do not fit"),
        (copier, xa.Launch(FILL_F32, 1, 16, [xa.Out(ref), 1.0, 16]), "does not understand Launch"),
        (kernels, xa.Launch(FILL_F32, 1, 16, [ref, 1.0, 16]), "wrap a GpuRef"),
        (kernels, xa.Launch(xa.Kernel("k", "", ("ptr",), lambda *a: None), 1, 1, [xa.Out(ref)]), "must pickle"),
        (copier, xa.CopyToDevice(ref, np.zeros((4, 4), np.float32)[:, :2]), "C-contiguous"),
    ]
    for actor, message, match in refused:
        with pytest.raises(xa.InvalidRequest, match=match):
            actor.ask(message)
    assert other_ref.access().nbytes == 64
    copier.tell(xa.Fill(ref, 300))  # told: logged, and the actor lives on
    assert copier.ask(xa.CopyToHost(ref)) == b"\x07" * 64  # no bytes moved
    stats = device.ask(xa.GetStats())
    assert (stats.bytes_outstanding, stats.live_blocks, stats.generation) == (64, 1, 0)
    with pytest.raises(xa.InvalidRequest, match="track must be a bool"):
        xa.CopyActor.start(device, track=1)
    with pytest.raises(xa.InvalidRequest, match="takes device and track"):
        xa.KernelActor.start(device, True, True)


def test_a_released_handle_is_stale(device: pykka.ActorRef[Any]) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    ref.release()
    with pytest.raises(xa.GpuRefStale) as info:
        copier.ask(xa.Fill(ref, 1))
    assert info.value.reason == "released"


def test_the_refs_survive_a_restart_and_in_flight_work_gets_a_typed_error(device: pykka.ActorRef[Any]) -> None:
    copier, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    old = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(old, 5))
    device.tell(ChildFault("exit", hold=3))
    in_flight = [
        copier.ask(xa.CopyToHost(old), block=False),
        kernels.ask(xa.Launch(FILL_F32, 1, 16, [xa.Out(old), 1.0, 16]), block=False),
        copier.ask(xa.Fill(old, 1), block=False),  # the third: the fault strikes
    ]
    for future in in_flight:
        with pytest.raises(xa.DeviceUnavailable):
            future.get(timeout=30)
    with pytest.raises(xa.GpuRefStale) as info:
        copier.ask(xa.Fill(old, 1))
    assert info.value.reason == "context rebuilt"
    new = device.ask(xa.Allocate(64))
    assert new.generation == 1
    kernels.ask(xa.Launch(FILL_F32, 1, 16, [xa.Out(new), 4.0, 16]))  # re-created in the new child
    assert f32(copier.ask(xa.CopyToHost(new))).tolist() == [4.0] * 16


def test_a_sticky_error_in_flight_answers_context_poisoned(device: pykka.ActorRef[Any]) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    device.tell(ChildFault("sticky", hold=1))
    with pytest.raises(xa.GpuRefStale) as info:
        copier.ask(xa.CopyToHost(ref), timeout=30)
    assert info.value.reason == "context poisoned"
    assert len(copier.ask(xa.CopyToHost(device.ask(xa.Allocate(8))))) == 8  # served by the new child


def test_a_stopped_device_answers_with_a_typed_error(device: pykka.ActorRef[Any]) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    device.stop()
    with pytest.raises(xa.DeviceUnavailable, match="stopped"):
        copier.ask(xa.Fill(ref, 1))
    with pytest.raises(xa.InvalidRequest, match="stopped IsolatedDevice"):
        xa.KernelActor.start(device)


def test_past_the_restart_intensity_library_work_answers_device_unavailable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = xa.DeviceActor.start(0, "host", supervisor=xa.Supervisor(max_restarts=0), isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    with pytest.raises(xa.DeviceUnavailable):
        device.ask(ChildFault("exit"))
    with pytest.raises(xa.DeviceUnavailable, match="stopped for good"):
        copier.ask(xa.Fill(ref, 1))
    caplog.clear()
    copier.stop()  # its stop, told to a device stopped for good, is nothing to complain of
    device.ask(xa.GetStats())  # the told stop was served before this
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records


@pytest.mark.parametrize("track", [True, False])
def test_a_copy_in_the_child_waits_for_a_slow_kernel_of_another_actor(slow_kernels: Any, track: bool) -> None:
    device = xa.DeviceActor.start(0, "host", isolate=True)
    kernels = xa.KernelActor.start(device, track=track)
    copier = xa.CopyActor.start(device, track=track)
    ref = device.ask(xa.Allocate(4096))
    copier.ask(xa.Fill(ref, 0))
    copier.ask(xa.CopyToHost(ref, nbytes=1))  # the fill is done before the kernel is launched
    kernels.ask(xa.Launch(slow_kernels.SLOW_FILL_U8, 1, 1, [xa.Out(ref), 9, 4096]))
    seen = copier.ask(xa.CopyToHost(ref))  # at once: another actor, another stream
    if track:
        assert seen == b"\x09" * 4096  # ordered behind the kernel's write
    else:
        assert seen == bytes(4096)  # the control: without tracking it reads before the write


@pytest.mark.gpu
def test_copies_and_kernels_run_in_the_gpu_device_process(slow_kernels: Any) -> None:
    device = xa.DeviceActor.start(0, "cuda", isolate=True)
    kernels, copier = xa.KernelActor.start(device), xa.CopyActor.start(device)
    x, y = device.ask(xa.Allocate(1 << 20)), device.ask(xa.Allocate(1 << 20))
    values = np.arange(1 << 18, dtype=np.float32)
    copier.ask(xa.CopyToDevice(x, values))
    kernels.ask(xa.Launch(SCALE_ADD_F32, 1024, 256, [xa.Out(y), xa.In(x), 2.0, 1.0, 1 << 18]))
    assert np.array_equal(f32(copier.ask(xa.CopyToHost(y))), values * 2 + 1)
    # One thread writes 1 MiB: slow enough that a copy not ordered behind it would see zeros.
    copier.ask(xa.Fill(x, 0))
    kernels.ask(xa.Launch(slow_kernels.SLOW_FILL_U8, 1, 1, [xa.Out(x), 9, 1 << 20]))
    assert copier.ask(xa.CopyToHost(x)) == b"\x09" * (1 << 20)
    assert device.ask(xa.GetStats()).driver == "cuda"


def test_a_request_the_device_process_cannot_read_is_refused_and_the_device_serves_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel whose host function lives in a module the device process cannot import pickles in
    the parent but not in the child: the launch is answered with an ``InvalidRequest`` naming the
    module, and the same child serves on (no restart, nothing leaked). Fails when the whole frame
    is one pickle: its failed read in the child ends the child, and the launch meets its death."""
    device = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    kernels, copier = xa.KernelActor.start(device), xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 7))
    (tmp_path / "parent_only_kernels.py").write_text(
        "def host(mem, grid, block, out):\n    mem.array(out, 1, 'uint8')[0] = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the child was spawned without it
    import parent_only_kernels  # type: ignore[import-not-found]

    kernel = xa.Kernel(name="xlog_parent_only", params=("ptr",), host=parent_only_kernels.host, source="")
    with pytest.raises(xa.InvalidRequest, match="parent_only_kernels"):
        kernels.ask(xa.Launch(kernel, 1, 1, [xa.Out(ref)]))
    assert copier.ask(xa.CopyToHost(ref, nbytes=2)) == b"\x07\x07"  # nothing ran
    stats = device.ask(xa.GetStats())
    assert (stats.generation, stats.restarts, stats.live_blocks) == (0, 0, 1)
    device.stop()
