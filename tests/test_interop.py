"""Zero-copy export of a GpuRef: ``__cuda_array_interface__`` (v3) and DLPack (issue 5)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.device_context import DeviceContext
from xlog_actors.actors.interop import consumer_stream_handle

SLOW_US = 200_000
N = 1 << 20
TRACKED = pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])


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
def test_cupy_reads_a_gpuref_without_a_copy(cuda_device) -> None:  # type: ignore[no-untyped-def]
    cp = pytest.importorskip("cupy", reason="CuPy is not installed (it is not a dependency)")
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(1 << 20))
    copy.ask(xa.Fill(ref, 3))
    view = cp.asarray(ref)  # __cuda_array_interface__: CuPy waits on the last write's stream
    assert view.data.ptr == ref.raw_device_ptr()
    assert int(view.sum()) == 3 * (1 << 20)
    from_dlpack = cp.from_dlpack(ref)
    assert from_dlpack.data.ptr == ref.raw_device_ptr()


@pytest.mark.gpu
def test_torch_reads_a_gpuref_without_a_copy(cuda_device) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (it is not a dependency)")
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(1 << 20))
    copy.ask(xa.CopyToDevice(ref, np.full(1 << 20, 5, np.uint8)))
    tensor = torch.from_dlpack(ref)  # DLPack: the producer orders torch's stream after the write
    assert tensor.data_ptr() == ref.raw_device_ptr()
    assert tensor.dtype == torch.uint8 and tensor.numel() == 1 << 20
    assert int(tensor.sum().item()) == 5 * (1 << 20)


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


def _slow_fill(ref: xa.GpuRef, copy: pykka.ActorRef, value: int) -> None:
    """Zero ``ref`` and wait for it, then queue a fill of ``value`` behind a slow kernel on the
    copy actor's stream: a consumer that does not wait for that stream reads zeros."""
    copy.ask(xa.Fill(ref, 0))
    copy.ask(xa.CopyToHost(ref, nbytes=1))  # the zero fill has landed
    ctx = ref.context
    stream = ctx.runtime.stream_pool.resolve(copy.proxy().stream_id.get())
    ctx.driver.sleep(stream, SLOW_US)
    copy.ask(xa.Fill(ref, value))


def _untrack(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a producer that ignores the protocols' stream rules would do: no ``stream`` in the
    CUDA Array Interface and no ordering of the DLPack consumer's stream."""
    monkeypatch.setattr(DeviceContext, "stream_handle", lambda self, sid: None)
    monkeypatch.setattr(xa.CudaDriver, "order_foreign_stream", lambda self, handle, after: None)


@pytest.mark.gpu
@TRACKED
def test_torch_waits_for_the_last_write(cuda_device, monkeypatch, tracked: bool) -> None:  # type: ignore[no-untyped-def]
    """The last write is still queued behind a slow kernel when PyTorch takes the handle through
    DLPack: correct when the producer orders torch's stream, zeros when it does not."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (it is not a dependency)")
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(N))
    if not tracked:
        _untrack(monkeypatch)
    _slow_fill(ref, copy, 5)
    total = int(torch.from_dlpack(ref).sum(dtype=torch.int64).item())
    if tracked:
        assert total == 5 * N
    else:
        assert total != 5 * N, "without ordering torch read before the slow write landed"


@pytest.mark.gpu
@TRACKED
@pytest.mark.parametrize("protocol", ["cuda_array_interface", "dlpack"])
def test_cupy_waits_for_the_last_write(cuda_device, monkeypatch, tracked: bool, protocol: str) -> None:  # type: ignore[no-untyped-def]
    """As for PyTorch, through CuPy and each of the two protocols."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed (it is not a dependency)")
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(N))
    if not tracked:
        _untrack(monkeypatch)
    _slow_fill(ref, copy, 5)
    view = cp.asarray(ref) if protocol == "cuda_array_interface" else cp.from_dlpack(ref)
    total = int(view.sum(dtype=cp.int64))
    if tracked:
        assert total == 5 * N
    else:
        assert total != 5 * N, "without ordering CuPy read before the slow write landed"


@pytest.mark.gpu
def test_a_consumer_keeps_the_memory_alive_and_stale_handles_export_nothing(cuda_device) -> None:  # type: ignore[no-untyped-def]
    """The tensor holds the GpuRef: dropping every other reference frees nothing while torch
    can still read it. After a Rebuild the old handle refuses both protocols."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (it is not a dependency)")
    device, copy = cuda_device
    ref = device.ask(xa.Allocate(N))
    copy.ask(xa.Fill(ref, 4))
    tensor = torch.from_dlpack(ref)
    del ref
    gc.collect()
    device.ask(xa.GetStats())  # drains dropped handles: a freed ref would go back to the pool here
    other = device.ask(xa.Allocate(N))
    copy.ask(xa.Fill(other, 7))
    copy.ask(xa.CopyToHost(other, nbytes=1))
    assert other.raw_device_ptr() != tensor.data_ptr()
    assert device.ask(xa.GetStats()).bytes_outstanding >= 2 * N
    assert int(tensor.sum(dtype=torch.int64).item()) == 4 * N
    del tensor
    stale = device.ask(xa.Allocate(64))
    device.ask(xa.Rebuild())
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        stale.__dlpack__()
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        stale.__cuda_array_interface__  # noqa: B018
