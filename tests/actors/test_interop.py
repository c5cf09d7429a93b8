"""Zero-copy export of a GpuRef: ``__cuda_array_interface__`` (v3) and DLPack."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.interop import consumer_stream_handle, foreign_stream_handle

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "interop_scenarios.py"
TRACKED = pytest.mark.parametrize(
    "tracked", ["tracked", pytest.param("untracked", marks=pytest.mark.concurrent_streams)]
)


def test_the_host_driver_exports_nothing() -> None:
    driver = xa.HostDriver(memory_per_device=16 << 20)
    try:
        device = xa.DeviceActor.start(0, driver)
        ref = device.ask(xa.Allocate(64))
        assert not hasattr(ref, "__cuda_array_interface__")
        with pytest.raises(AttributeError, match="only offered on the CUDA driver"):
            ref.__dlpack__()
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def test_consumer_stream_rules() -> None:
    assert consumer_stream_handle(None) == 1  # legacy default stream
    assert consumer_stream_handle(-1) is None  # no synchronization asked
    assert consumer_stream_handle(2) == 2
    assert consumer_stream_handle(0x7F00_1234) == 0x7F00_1234
    with pytest.raises(xa.InvalidRequest):
        consumer_stream_handle(0)
    with pytest.raises(xa.InvalidRequest):
        consumer_stream_handle("1")


@pytest.fixture
def cuda_device() -> Iterator[tuple[pykka.ActorRef, pykka.ActorRef]]:
    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    copy = xa.CopyActor.start(device)
    yield device, copy
    pykka.ActorRegistry.stop_all()
    driver.close()


@pytest.mark.gpu
def test_cuda_array_interface_v3_with_the_last_write_stream(cuda_device) -> None:  # type: ignore[no-untyped-def]
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(4096))
    copy.ask(xa.Fill(ref, 7))
    cai = ref.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (4096,) and cai["typestr"] == "|u1"
    assert cai["data"] == (ref.raw_device_ptr(), False)
    stream = ref.context.runtime.stream_pool.resolve(ref.last_write_stream)
    assert cai["stream"] == stream.handle


@pytest.mark.gpu
def test_cuda_core_sees_the_same_bytes_through_both_protocols(cuda_device) -> None:  # type: ignore[no-untyped-def]
    from cuda.core.utils import StridedMemoryView

    device, copy = cuda_device
    ref = device.ask(xa.Allocate(4096))
    copy.ask(xa.Fill(ref, 9))
    for view in (
        StridedMemoryView.from_dlpack(ref, stream_ptr=-1),
        StridedMemoryView.from_cuda_array_interface(ref, stream_ptr=-1),
    ):
        assert view.ptr == ref.raw_device_ptr()
        assert view.shape == (4096,) and view.dtype == np.dtype(np.uint8)
        assert view.device_id == 0 and view.is_device_accessible


def _run_scenario(library: str, name: str, *args: str) -> None:
    """Run one of ``interop_scenarios.py`` in a fresh process (why: that module's docstring)."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed (it is not a dependency)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS), name, *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"{name}{args}: exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "held" in proc.stdout


@pytest.mark.gpu
def test_torch_reads_and_writes_a_gpuref_without_a_copy() -> None:
    _run_scenario("torch", "torch_reads_without_a_copy")


@pytest.mark.gpu
def test_cupy_reads_a_gpuref_without_a_copy() -> None:
    _run_scenario("cupy", "cupy_reads_without_a_copy")


@pytest.mark.gpu
@TRACKED
def test_torch_waits_for_the_last_write(tracked: str) -> None:
    """The last write is still queued behind a slow kernel when PyTorch takes the handle through
    DLPack: correct when the producer orders torch's stream, zeros when it does not."""
    _run_scenario("torch", "torch_waits_for_the_last_write", tracked)


@pytest.mark.gpu
@TRACKED
@pytest.mark.parametrize("protocol", ["cuda_array_interface", "dlpack"])
def test_cupy_waits_for_the_last_write(tracked: str, protocol: str) -> None:
    """As for PyTorch, through CuPy and each of the two protocols."""
    _run_scenario("cupy", "cupy_waits_for_the_last_write", tracked, protocol)


@pytest.mark.gpu
def test_a_tensor_keeps_the_memory_alive() -> None:
    _run_scenario("torch", "torch_keeps_the_memory_alive")


@pytest.mark.gpu
@TRACKED
@pytest.mark.parametrize("which", ["side", "default"])
def test_library_actors_wait_for_a_declared_torch_write(tracked: str, which: str) -> None:
    """``record_foreign_write``: PyTorch writes behind a slow kernel on its own stream, a
    CopyActor reads at once on another: correct when declared, stale when not."""
    _run_scenario("torch", "actors_wait_for_a_torch_write", tracked, which)


def test_foreign_stream_handle_rules() -> None:
    class CoreLike:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x1234)

    class TorchLike:
        cuda_stream = 0x5678

    class CupyLike:
        ptr = 0x9ABC

    assert foreign_stream_handle(CoreLike()) == 0x1234
    assert foreign_stream_handle(TorchLike()) == 0x5678
    assert foreign_stream_handle(CupyLike()) == 0x9ABC
    assert foreign_stream_handle(0) == 0  # the legacy default stream, as PyTorch's default names it
    assert foreign_stream_handle(0xDEAD) == 0xDEAD
    for bad in (-1, True, "0x10", None, 1.0):
        with pytest.raises(xa.InvalidRequest, match="expected a CUDA stream"):
            foreign_stream_handle(bad)


def test_record_foreign_write_is_only_offered_on_cuda() -> None:
    driver = xa.HostDriver(memory_per_device=16 << 20)
    try:
        device = xa.DeviceActor.start(0, driver)
        ref = device.ask(xa.Allocate(64))
        with pytest.raises(AttributeError, match="only offered on the CUDA driver"):
            ref.record_foreign_write(0)
        assert ref.last_write_stream is None  # nothing recorded
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


@pytest.mark.gpu
def test_record_foreign_write_refuses_bad_input_and_changes_nothing(cuda_device) -> None:  # type: ignore[no-untyped-def]
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(ref, 1))
    before = ref.last_write_stream
    with pytest.raises(xa.InvalidRequest):
        ref.record_foreign_write("not a stream")
    assert ref.last_write_stream == before
    stale = device.ask(xa.Allocate(64))
    stale.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        stale.record_foreign_write(0)
    ref.record_foreign_write(0)  # a real one: the legacy default stream
    assert ref.last_write_stream == xa.StreamId.DEFAULT
    assert copy.ask(xa.CopyToHost(ref, nbytes=4)) == b"\x01" * 4


@pytest.mark.gpu
def test_torch_lives_through_a_rebuild() -> None:
    _run_scenario("torch", "torch_lives_through_a_rebuild")


@pytest.mark.gpu
def test_cupy_lives_through_a_rebuild() -> None:
    _run_scenario("cupy", "cupy_lives_through_a_rebuild")


@pytest.mark.gpu
def test_a_stale_handle_exports_nothing(cuda_device) -> None:  # type: ignore[no-untyped-def]
    device, _copy = cuda_device
    stale = device.ask(xa.Allocate(64))
    device.ask(xa.Rebuild())
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        stale.__dlpack__()
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        stale.__cuda_array_interface__  # noqa: B018 - the attribute access itself must raise
    released = device.ask(xa.Allocate(64))
    released.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        released.__dlpack__()
