"""The importing process's cache of cross-process copy sources (``actors/import_cache.py``): a
second copy of the same exported allocation reads through the mapping the first one opened; a
block freed and reallocated gets a new key; a rebuild of the owner drops the cache and its old
handles stay ``GpuRefStale``; the bound and the reuse limit hold.

The owner is a device of a ``shared=True`` host driver in this process, and every copy's source is
a fresh pickle round trip of its handle (what a copy asked of an isolated device's copy actor
gets: one export per copy); the copy actor of a second device pulls it. Opens are counted at the
host driver's ``open_memory`` (the mapping a handle makes on its first read).
"""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import import_cache, shared_ref
from xlog_actors.actors.export_table import ExportTable
from xlog_actors.actors.shared_ref import SharedGpuRef

NBYTES = 4096


@pytest.fixture
def devices() -> Iterator[tuple[pykka.ActorRef[Any], pykka.ActorRef[Any]]]:
    drv = xa.HostDriver(device_count=2, memory_per_device=16 << 20, shared=True)
    import_cache.clear()
    yield xa.DeviceActor.start(0, drv), xa.DeviceActor.start(1, drv)
    import_cache.clear()
    import_cache.configure()
    pykka.ActorRegistry.stop_all()
    drv.close()


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    made: list[object] = []
    real = shared_ref.open_memory

    def counting(export: Any) -> memoryview:
        made.append(export)
        return real(export)

    monkeypatch.setattr(shared_ref, "open_memory", counting)
    return made


def _copy(copy: pykka.ActorRef[Any], src: xa.GpuRef, dst: xa.GpuRef) -> tuple[int, int]:
    """Copy a fresh export of ``src`` into ``dst``; the export's (slot, serial)."""
    shared = pickle.loads(pickle.dumps(src))
    assert isinstance(shared, SharedGpuRef)
    copy.ask(xa.CopyDeviceToDevice(shared, dst))
    return shared.export.slot, shared.export.serial


def _table(ref: xa.GpuRef) -> ExportTable:
    state = ref.context.state_ref()
    assert state is not None
    return ExportTable.of(state)


def test_a_second_copy_of_the_same_source_opens_no_new_mapping(devices: Any, opens: list[object]) -> None:
    dev0, dev1 = devices
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    before = import_cache.stats()
    keys = set()
    for value in (7, 9, 11):
        copy0.ask(xa.Fill(src, value))
        keys.add(_copy(copy1, src, dst))
        assert copy1.ask(xa.CopyToHost(dst)) == bytes([value]) * NBYTES, "each copy waits for its own export's write"
    assert len(opens) == 1
    assert len(keys) == 1, "the cached count keeps the slot and its serial"
    got = import_cache.stats()
    assert (got.opened - before.opened, got.reused - before.reused, got.size) == (1, 2, 1)


def test_a_source_freed_and_reallocated_is_never_read_through_the_old_mapping(
    devices: Any, opens: list[object]
) -> None:
    dev0, dev1 = devices
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    dst = dev1.ask(xa.Allocate(NBYTES))
    src = dev0.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 7))
    old_key = _copy(copy1, src, dst)
    table = _table(src)
    # The owner drops its handle: the cached entry's count keeps the block (the owner cannot free
    # it, so no other allocation can take its place while the entry lives).
    del src
    gc.collect()
    assert dev0.ask(xa.GetStats()).live_blocks == 1
    new = dev0.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(new, 9))
    assert _copy(copy1, new, dst) != old_key
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x09" * NBYTES
    # Dropped from the cache, the old block is freed; a block allocated in its place is a new key.
    import_cache.clear()
    gc.collect()
    assert table.wait_unpinned(10.0)
    assert dev0.ask(xa.GetStats()).live_blocks == 1
    again = dev0.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(again, 5))
    assert _copy(copy1, again, dst) != old_key
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x05" * NBYTES
    assert len(opens) == 3


def test_an_owner_rebuild_drops_the_cache_and_its_old_handles_stay_stale(devices: Any, opens: list[object]) -> None:
    dev0, dev1 = devices
    copy1 = xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    _copy(copy1, src, dst)
    old = pickle.loads(pickle.dumps(src))  # a handle of the old generation, arriving late
    before = import_cache.stats()
    assert before.size == 1
    dev0.ask(xa.Rebuild("test"))
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        copy1.ask(xa.CopyDeviceToDevice(old, dst))
    fresh = dev0.ask(xa.Allocate(NBYTES))
    xa.CopyActor.start(dev0).ask(xa.Fill(fresh, 3))
    _copy(copy1, fresh, dst)  # its lookup drops the old generation's entry first
    got = import_cache.stats()
    assert (got.size, got.evicted - before.evicted) == (1, 1)
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x03" * NBYTES
    assert len(opens) == 2


def test_the_bound_evicts_the_least_recently_used_entry(devices: Any, opens: list[object]) -> None:
    dev0, dev1 = devices
    import_cache.configure(capacity=2)
    copy1 = xa.CopyActor.start(dev1)
    dst = dev1.ask(xa.Allocate(NBYTES))
    a, b, c = (dev0.ask(xa.Allocate(NBYTES)) for _ in range(3))
    for ref in (a, b, a, c):  # c evicts b, the least recently used
        _copy(copy1, ref, dst)
    assert import_cache.stats().size == 2 and len(opens) == 3
    _copy(copy1, a, dst)
    assert len(opens) == 3, "a was used more recently than b"
    _copy(copy1, b, dst)
    assert len(opens) == 4
    assert import_cache.stats().size == 2


def test_an_entry_serves_a_bounded_number_of_copies_then_lets_its_count_go(devices: Any, opens: list[object]) -> None:
    dev0, dev1 = devices
    import_cache.configure(reuse_max=3)
    copy1 = xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    table = _table(src)
    for _ in range(4):  # one open, then three reuses: the third is the entry's last
        _copy(copy1, src, dst)
    assert len(opens) == 1 and import_cache.stats().size == 0
    gc.collect()
    assert table.wait_unpinned(10.0), "no count is left: the owner lets the export's keep-alives go"
    _copy(copy1, src, dst)
    assert len(opens) == 2
