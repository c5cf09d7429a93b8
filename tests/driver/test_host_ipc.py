"""The host driver across processes: shared device memory, exports, emulated interprocess events,
and the shared segments under them. Opening an export in this process maps
the segment a second time, as another process would; tests/actors/test_shared_ref.py runs the
cross-process cases through a spawned peer."""

from __future__ import annotations

import gc
import os
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors.driver.host.ipc import EVENT_SLOTS, HostEventTable, HostIpcEvent, HostMemoryExport, open_memory
from xlog_actors.driver.shared_memory import SHM_DIR, SharedSegment
from xlog_actors.errors import DeviceUnavailable, DriverError, InvalidRequest


@pytest.fixture
def shared() -> Iterator[xa.HostDriver]:
    drv = xa.HostDriver(memory_per_device=1 << 20, shared=True)
    yield drv
    drv.close()


def _segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("xlog-") and f"-{os.getpid()}-" in name}


def test_an_export_is_the_same_bytes_and_its_event_orders_after_the_slow_write(shared: xa.HostDriver) -> None:
    stream = shared.create_stream(0)
    ptr = shared.alloc_async(100, stream)
    shared.sleep(stream, 200_000)
    shared.fill(ptr, 7, 100, stream)
    event = pickle.loads(pickle.dumps(shared.export_event(stream)))
    view = open_memory(pickle.loads(pickle.dumps(shared.export_memory(0, ptr, 100))))
    assert not event.query() and bytes(view[:4]) == b"\0\0\0\0", "the slow fill has not run"
    event.wait(10.0)
    assert event.query() and bytes(view) == b"\x07" * 100
    view[0] = 9  # zero-copy both ways
    back = shared.copy_to_host(ptr, 1, stream)
    stream.synchronize()
    assert back == b"\x09"
    later = shared.export_event(stream)
    assert (later.slot, later.seq) == (event.slot, event.seq + 1), "one counter per stream, in stream order"


def test_exports_are_refused_without_shared_memory() -> None:
    drv = xa.HostDriver(memory_per_device=1 << 20)
    try:
        stream = drv.create_stream(0)
        ptr = drv.alloc(0, 64)
        with pytest.raises(InvalidRequest, match="shared=True"):
            drv.export_memory(0, ptr, 64)
        with pytest.raises(InvalidRequest, match="shared=True"):
            drv.export_event(stream)
        assert "shared" not in repr(drv) and not drv.shared
    finally:
        drv.close()


@pytest.mark.parametrize("shared_arg", [1, "yes", None])
def test_shared_must_be_a_bool(shared_arg: object) -> None:
    with pytest.raises(InvalidRequest, match="shared must be a bool"):
        xa.HostDriver(shared=shared_arg)  # type: ignore[arg-type]


def test_export_of_what_is_not_a_live_allocation_is_refused(shared: xa.HostDriver) -> None:
    ptr = shared.alloc(0, 64)
    for bad_ptr, nbytes in [(ptr + 256, 64), (ptr, 65), (ptr, 0), (ptr, 1.5)]:
        with pytest.raises(DriverError) as info:
            shared.export_memory(0, bad_ptr, nbytes)  # type: ignore[arg-type]
        assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(InvalidRequest):
        shared.export_memory(3, ptr, 64)
    shared.free(0, ptr)
    with pytest.raises(DriverError):
        shared.export_memory(0, ptr, 64)


def test_a_rebuild_gives_a_new_segment_and_unlinks_the_old(shared: xa.HostDriver) -> None:
    ptr = shared.alloc(0, 64)
    export = shared.export_memory(0, ptr, 64)
    view = open_memory(export)
    view[0] = 5
    shared.rebuild_context(0)
    assert not os.path.exists(os.path.join(SHM_DIR, export.segment))
    assert view[0] == 5, "a mapping outlives the name: a late reader never faults"
    with pytest.raises(DeviceUnavailable, match="gone"):
        open_memory(HostMemoryExport(export.segment + "-x", 0, 1))
    fresh = shared.export_memory(0, shared.alloc(0, 64), 64)
    assert fresh.segment != export.segment


def test_close_unlinks_every_segment() -> None:
    before = _segments()
    drv = xa.HostDriver(device_count=2, memory_per_device=1 << 20, shared=True)
    stream = drv.create_stream(1)
    drv.export_event(stream)
    assert len(_segments() - before) == 3  # two memories, one event table
    drv.close()
    assert _segments() == before


def test_an_event_wait_times_out_and_an_abort_ends_it(shared: xa.HostDriver) -> None:
    stream = shared.create_stream(0)
    shared.sleep(stream, 300_000)
    event = shared.export_event(stream)
    with pytest.raises(DeviceUnavailable, match="not reached"):
        event.wait(0.02)

    class Stop(Exception):
        pass

    def abort() -> None:
        raise Stop

    with pytest.raises(Stop):
        event.wait(10.0, abort)
    with pytest.raises(DeviceUnavailable, match="gone"):
        HostIpcEvent("xlog-events-gone", 0, 1).query()


def test_an_event_table_refuses_past_its_slots_and_frees_a_collected_streams_slot(shared: xa.HostDriver) -> None:
    table = HostEventTable(0)
    try:
        table._free = [7]
        stream = shared.create_stream(0)
        assert table.record(stream).slot == 7
        other = shared.create_stream(0)
        with pytest.raises(DriverError, match=f"{EVENT_SLOTS} streams"):
            table.record(other)
        first = table.record(stream)
        stream.close()
        del stream
        handed_on = table.record(other)
        assert handed_on.slot == 7, "a closed, collected stream's slot is handed on"
        assert handed_on.seq > first.seq and first.query(), "a late waiter on the old stream is not stranded"
        other.synchronize()
    finally:
        table.close()


def test_a_stream_collected_inside_a_record_gives_its_slot_back_without_a_deadlock(shared: xa.HostDriver) -> None:
    """The garbage collector runs a collected stream's finalizer on whatever thread allocates: a
    thread inside ``record``, which holds the table's lock, included. The slot must come back
    there without waiting for that lock (which would hang the thread and every later export)."""
    table = HostEventTable(0)
    gc.collect()
    gc.disable()  # the collection below is the only one: inside record, under its lock
    try:
        old = shared.create_stream(0)
        slot = table.record(old).slot
        old.close()
        old.cycle = old  # type: ignore[attr-defined]  # reachable until a collection, no longer
        del old
        stream = shared.create_stream(0)
        enqueue = stream.enqueue

        def collecting_enqueue(op: Any, *, always: bool = False) -> int:
            gc.collect()  # as an allocation inside record may start one
            return enqueue(op, always=always)

        stream.enqueue = collecting_enqueue  # type: ignore[method-assign]
        recorded: list[HostIpcEvent] = []
        thread = threading.Thread(target=lambda: recorded.append(table.record(stream)), daemon=True)
        thread.start()
        thread.join(10.0)
        assert recorded, "record hung on its own lock: the collected stream's finalizer waited for it"
        assert slot in table._free, "the collected stream's slot is free again"
        stream.synchronize()
    finally:
        gc.enable()
        table.close()


def test_an_export_of_a_dead_context_raises_its_error(shared: xa.HostDriver) -> None:
    stream = shared.create_stream(0)
    ptr = shared.alloc(0, 64)
    shared.inject_fault(0, "context_lost")
    with pytest.raises(xa.ContextLost):
        shared.export_memory(0, ptr, 64)
    with pytest.raises(xa.ContextLost):
        shared.export_event(stream)


def test_shared_segment_refuses_bad_names_sizes_and_duplicates() -> None:
    for name in ["", "a/b", "a\0b"]:
        with pytest.raises(InvalidRequest, match="name"):
            SharedSegment.create(name, 8)
    for size in [0, -1, 1.0]:
        with pytest.raises(InvalidRequest, match="size"):
            SharedSegment.create(f"xlog-test-{os.getpid()}-size", size)  # type: ignore[arg-type]
    segment = SharedSegment.create(f"xlog-test-{os.getpid()}-dup", 64)
    try:
        with pytest.raises(InvalidRequest, match="exists"):
            SharedSegment.create(segment.name, 64)
        other = SharedSegment.open(segment.name)
        other.int64s(0, 1)[0] = 42
        assert segment.int64s(0, 1)[0] == 42 and not other.owner
        with other.locked(0, 8):
            other.int64s(0, 1)[0] += 1
        with segment.locked(0, 8):  # the lock was let go
            assert segment.int64s(0, 1)[0] == 43
        other.close()
        other.close()
        assert os.path.exists(os.path.join(SHM_DIR, segment.name)), "only the owner unlinks"
    finally:
        segment.close()
    assert not os.path.exists(os.path.join(SHM_DIR, segment.name))
    with pytest.raises(DeviceUnavailable):
        SharedSegment.open(segment.name)
