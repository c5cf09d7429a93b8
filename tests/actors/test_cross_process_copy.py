"""A CopyActor copies between blocks of two isolated devices (each in its own process): the
source crosses as a SharedGpuRef, the copy runs on the destination's device after the source's
last write (an interprocess event), and replies once it landed. On the host driver the two
devices are two emulated ordinals; on CUDA, the first two GPUs (skipped with the reason on fewer)."""

from __future__ import annotations

import contextlib
import gc
import time
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


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The exports asked of an isolated device's process (a round trip each), counted in the parent."""
    from xlog_actors.actors.isolated import RemoteContext

    asked: list[object] = []
    real = RemoteContext.export

    def counting(self: RemoteContext, ref: Any) -> Any:
        asked.append(ref)
        return real(self, ref)

    monkeypatch.setattr(RemoteContext, "export", counting)
    return asked


def test_copies_of_an_unchanged_source_ask_its_process_for_one_export(
    pair: tuple[str, list[pykka.ActorRef[Any]]], exports: list[object]
) -> None:
    """The copy actor keeps the export of a source of another isolated device while that device
    gets no library work: its event still marks the source's last write. A write on the source's
    device (here a Fill) makes the next copy ask for a fresh export, which orders it after that
    write."""
    _, (dev0, dev1) = pair
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    nbytes = 4096
    src, dst = dev0.ask(xa.Allocate(nbytes)), dev1.ask(xa.Allocate(nbytes))
    copy0.ask(xa.Fill(src, 7))
    for _ in range(5):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(exports) == 1
    sent, answered = src.context.work.mark()
    assert sent == answered >= 1, "the Fill was counted as sent and answered before its reply"
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x07" * nbytes
    copy0.ask(xa.Fill(src, 9))  # library work on the source's device: the kept export is not its last write
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(exports) == 2 and copy1.ask(xa.CopyToHost(dst)) == b"\x09" * nbytes
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(exports) == 2
    src.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(exports) == 2


def test_a_copy_actor_keeps_the_exports_of_a_bounded_number_of_sources(
    pair: tuple[str, list[pykka.ActorRef[Any]]], exports: list[object]
) -> None:
    from xlog_actors.actors.isolated._library import KEPT_EXPORTS

    _, (dev0, dev1) = pair
    copy1 = xa.CopyActor.start(dev1)
    dst = dev1.ask(xa.Allocate(4096))
    sources = [dev0.ask(xa.Allocate(4096)) for _ in range(KEPT_EXPORTS + 1)]
    for src in sources:
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(exports) == KEPT_EXPORTS + 1
    copy1.ask(xa.CopyDeviceToDevice(sources[-1], dst))
    assert len(exports) == KEPT_EXPORTS + 1, "the latest is kept"
    copy1.ask(xa.CopyDeviceToDevice(sources[0], dst))
    assert len(exports) == KEPT_EXPORTS + 2, "the least recently used was dropped for the bound"


def test_an_asker_of_an_isolated_devices_copy_actor_spins_for_its_reply_as_for_an_in_process_one(
    pair: tuple[str, list[pykka.ActorRef[Any]]],
) -> None:
    """A copy replies once landed: an asker that slept through it would pay a wake-up on top
    (``hot_waits``); it spins first, as an in-process library actor's asker does."""
    from xlog_actors.actors.hot_waits import SpinningFuture

    _, (_, dev1) = pair
    copy1 = xa.CopyActor.start(dev1)
    ref = dev1.ask(xa.Allocate(4096))
    future = copy1.ask(xa.Fill(ref, 1), block=False)
    assert isinstance(future, SpinningFuture)
    future.get(timeout=30.0)


def test_stopped_isolated_devices_leave_no_export_table_for_the_collector() -> None:
    # An exported handle makes its device's export table (a shared segment and a sweeper thread),
    # which lives as long as the device's state. Once the devices stop, nothing may hold that
    # state in a reference cycle: the table goes by reference counting alone, the collector off.
    from xlog_actors.actors import export_table

    before = {table.name for table in list(export_table._tables.values())}
    gc.disable()
    try:
        devices = [xa.DeviceActor.start(k, "host", isolate=True, hot_spare=False, ipc_pool=True) for k in (0, 1)]
        copy1 = xa.CopyActor.start(devices[1])
        src, dst = devices[0].ask(xa.Allocate(64)), devices[1].ask(xa.Allocate(64))
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
        made = {table.name for table in list(export_table._tables.values())} - before
        assert made, "the copy exported its source: its device has a table"
        del src, dst, copy1, devices
        pykka.ActorRegistry.stop_all()
        deadline = time.monotonic() + 5.0
        while made & {table.name for table in list(export_table._tables.values())}:
            assert time.monotonic() < deadline, "an export table outlived its stopped device until a collection"
            time.sleep(0.02)
    finally:
        gc.enable()
