"""A CopyActor copies between blocks of two isolated devices (each in its own process): the
source crosses as a SharedGpuRef, the copy runs on the destination's device after the source's
last write (an interprocess event), and replies once it landed. On the host driver the two
devices are two emulated ordinals; on CUDA, the first two GPUs (skipped with the reason on fewer)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault

MIB = 1 << 20


def _cuda_count() -> int:
    try:
        driver = xa.open_driver("cuda")
    except xa.DeviceUnavailable:
        return 0
    try:
        return driver.device_count()
    finally:
        driver.close()


@pytest.fixture(params=[pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[pykka.ActorRef[Any]]]]:
    kind = request.param
    if kind == "cuda" and (count := _cuda_count()) < 2:
        pytest.skip(f"needs two CUDA devices; this machine has {count}")
    # ipc_pool: a CUDA child's async blocks must come from an IPC-capable pool to cross processes.
    devices = [xa.DeviceActor.start(k, kind, isolate=True, hot_spare=False, ipc_pool=True) for k in (0, 1)]
    yield kind, devices
    pykka.ActorRegistry.stop_all()


def test_a_copy_between_two_isolated_devices_is_ordered_after_the_source_write(
    pair: tuple[str, list[pykka.ActorRef[Any]]],
) -> None:
    _, (dev0, dev1) = pair
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    nbytes = 32 * MIB
    src, dst = dev0.ask(xa.Allocate(nbytes)), dev1.ask(xa.Allocate(nbytes))
    for value in (7, 9):
        copy0.ask(xa.Fill(src, value))  # replies once enqueued: the write may still be running
        copy1.ask(xa.CopyDeviceToDevice(src, dst))  # waits for it in the other process
        got = copy1.ask(xa.CopyToHost(dst))
        assert got == bytes([value]) * nbytes, value
    # the destination's write is tracked on its device: a copy there on another stream sees it
    copy1b = xa.CopyActor.start(dev1)
    again = dev1.ask(xa.Allocate(nbytes))
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    copy1b.ask(xa.CopyDeviceToDevice(dst, again))
    assert copy1b.ask(xa.CopyToHost(again, 16)) == bytes([9]) * 16


def test_cross_process_copy_refuses_what_it_cannot_do(pair: tuple[str, list[pykka.ActorRef[Any]]]) -> None:
    _, (dev0, dev1) = pair
    copy1 = xa.CopyActor.start(dev1)
    big, small = dev0.ask(xa.Allocate(8192)), dev1.ask(xa.Allocate(4096))
    with pytest.raises(xa.InvalidRequest, match="does not fit"):
        copy1.ask(xa.CopyDeviceToDevice(big, small))
    ours = dev1.ask(xa.Allocate(8192))
    with pytest.raises(xa.InvalidRequest, match="not a handle of isolated device 1"):
        copy1.ask(xa.CopyDeviceToDevice(ours, big))  # a push: the copy runs on the destination's device
    src = dev0.ask(xa.Allocate(4096))
    with contextlib.suppress(xa.GpuRefStale, xa.DeviceUnavailable):
        dev0.ask(ChildFault("exit"))
    with pytest.raises(xa.GpuRefStale):
        copy1.ask(xa.CopyDeviceToDevice(src, small))  # its process is gone: the handle is stale
    fresh = dev0.ask(xa.Allocate(4096))
    xa.CopyActor.start(dev0).ask(xa.Fill(fresh, 3))
    copy1.ask(xa.CopyDeviceToDevice(fresh, small))
    assert copy1.ask(xa.CopyToHost(small)) == b"\x03" * 4096
