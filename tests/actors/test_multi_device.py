"""Two devices of one driver: one DeviceActor per ordinal, each with its own context, runtime,
generation and library actors (one actor per ordinal). The same test runs on the host
driver with two emulated devices and, where two GPUs are reachable, on the CUDA driver."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.kernel_library import SCALE_ADD_F32, launch_shape


def _pool_ordinal(driver: xa.Driver, ptr: int) -> int | None:
    """The device whose default memory pool ``ptr`` came from (None on the host driver). Asked of
    CUDA, not of our own bookkeeping. (``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`` is no help here:
    on the H200 pair it answered 0 for allocations of device 1, pool and ``cuMemAlloc`` alike.)"""
    if driver.kind != "cuda":
        return None
    from cuda.bindings import driver as cu

    err, pool = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr)
    assert int(err) == 0, err
    for ordinal in range(driver.device_count()):
        err, dev = cu.cuDeviceGet(ordinal)
        err, default = cu.cuDeviceGetDefaultMemPool(dev)
        if int(default) == int(pool):
            return ordinal
    raise AssertionError(f"{ptr:#x} comes from no device's default pool")


def test_each_device_has_its_own_actor_context_and_generation(two_devices: xa.Driver) -> None:
    driver = two_devices
    dev = [xa.DeviceActor.start(i, driver) for i in (0, 1)]
    copy = [xa.CopyActor.start(d) for d in dev]
    kernels = [xa.KernelActor.start(d) for d in dev]
    n = 1 << 16
    x = np.arange(n, dtype=np.float32)
    refs = [d.ask(xa.Allocate(4 * n)) for d in dev]
    outs = [d.ask(xa.Allocate(4 * n)) for d in dev]
    grid, block = launch_shape(n)
    for i in (0, 1):
        assert refs[i].device_id == i and refs[i].access().device_ordinal == i
        assert _pool_ordinal(driver, refs[i].raw_device_ptr()) in (None, i)
        copy[i].ask(xa.CopyToDevice(refs[i], x))
        kernels[i].ask(xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(outs[i]), xa.In(refs[i]), float(i + 2), 1.0, n]))
    for i in (0, 1):
        got = np.frombuffer(copy[i].ask(xa.CopyToHost(outs[i])), np.float32)
        assert got.tolist() == (np.float32(i + 2) * x + np.float32(1.0)).tolist()
    assert refs[0].context.runtime is not refs[1].context.runtime

    # a handle of one device is refused by the other's actors, and nothing changes
    with pytest.raises(xa.InvalidRequest, match="device 1"):
        copy[0].ask(xa.Fill(refs[1], 9))
    with pytest.raises(xa.InvalidRequest):
        dev[0].ask(xa.Free(refs[1]))
    assert not refs[1].released
    assert [d.ask(xa.GetStats()).bytes_outstanding for d in dev] == [8 * n, 8 * n]

    # rebuilding device 1 leaves device 0, its handles and its generation alone
    assert dev[1].ask(xa.Rebuild("test")) == 1
    assert dev[0].ask(xa.GetStats()).generation == 0
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        refs[1].access()
    got = np.frombuffer(copy[0].ask(xa.CopyToHost(outs[0])), np.float32)
    assert got.tolist() == (np.float32(2) * x + np.float32(1.0)).tolist()
    fresh = dev[1].ask(xa.Allocate(64))
    copy[1].ask(xa.Fill(fresh, 5))
    assert copy[1].ask(xa.CopyToHost(fresh)) == b"\x05" * 64
    assert [d.ask(xa.GetStats()).bytes_outstanding for d in dev] == [8 * n, 64]


def test_both_devices_driven_at_once_from_many_threads(two_devices: xa.Driver) -> None:
    """Eight threads, four per device, allocating through each device's DeviceClient and copying
    through its CopyActor at the same time: every round trip exact, every byte given back."""
    dev = [xa.DeviceActor.start(i, two_devices) for i in (0, 1)]
    copy = [xa.CopyActor.start(d) for d in dev]
    clients = [d.ask(xa.GetClient()) for d in dev]
    errors: list[BaseException] = []

    def work(i: int, seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                data = rng.integers(0, 255, int(rng.integers(1, 1 << 14)), dtype=np.uint8)
                ref = clients[i].allocate(data.nbytes)
                assert ref.device_id == i
                copy[i].ask(xa.CopyToDevice(ref, data))
                assert copy[i].ask(xa.CopyToHost(ref)) == data.tobytes()
                clients[i].free(ref)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k % 2, k)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [d.ask(xa.GetStats()).bytes_outstanding for d in dev] == [0, 0]
