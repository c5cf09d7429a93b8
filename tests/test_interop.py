"""Zero-copy export of a GpuRef: ``__cuda_array_interface__`` (v3) and DLPack (issue 5)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.interop import consumer_stream_handle


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
