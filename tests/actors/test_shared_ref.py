"""Handles across processes: a pickled ``GpuRef`` arrives as a
``SharedGpuRef`` to the same memory, stale everywhere at once, ordered after its last write,
alive while any process holds it and freed by its device process only.

Most checks round-trip the pickle in this process (the import maps the segments a second time,
as another process would); the cross-process ones use one spawned peer (``ipc/ipc_peer.py``)
for the whole module, so that the spawn cost is paid once.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.export_table import COUNTS_RANGE, SLOTS, ExportTable
from xlog_actors.actors.isolated import ChildFault
from xlog_actors.actors.shared_ref import SharedGpuRef, export_ref, import_ref
from xlog_actors.driver.fd_passing import served
from xlog_actors.errors import DeviceUnavailable, GpuRefStale, InvalidRequest

PEER_DIR = Path(__file__).resolve().parent / "ipc"
REPLY_TIMEOUT_S = 30.0


@pytest.fixture
def shared_driver() -> Iterator[xa.HostDriver]:
    """A host driver whose device memory lives in shared memory."""
    drv = xa.HostDriver(memory_per_device=16 << 20, shared=True)
    yield drv
    pykka.ActorRegistry.stop_all()
    drv.close()


@pytest.fixture
def device(shared_driver: xa.HostDriver) -> pykka.ActorRef[Any]:
    return xa.DeviceActor.start(0, shared_driver)


def _table(ref: xa.GpuRef) -> ExportTable:
    state = ref.context.state_ref()
    assert state is not None
    return ExportTable.of(state)


def _round_trip(ref: Any) -> SharedGpuRef:
    shared = pickle.loads(pickle.dumps(ref))
    assert isinstance(shared, SharedGpuRef)
    return shared


# -- in this process ---------------------------------------------------------------------------
def test_a_pickled_ref_is_the_same_memory(device: pykka.ActorRef[Any]) -> None:
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096, tag=xa.AllocTag("acts")))
    copy.ask(xa.Fill(ref, 7))
    shared = _round_trip(ref)
    assert (shared.nbytes, shared.tag, shared.generation, shared.device_id) == (4096, "acts", 0, 0)
    assert bytes(shared.view()) == b"\x07" * 4096
    shared.view()[:2] = b"\x01\x02"  # zero-copy both ways
    assert copy.ask(xa.CopyToHost(ref, nbytes=3)) == b"\x01\x02\x07"


def test_every_status_change_makes_imported_handles_stale(device: pykka.ActorRef[Any], shared_driver: Any) -> None:
    ref = device.ask(xa.Allocate(256))
    before = _round_trip(ref)
    device.ask(xa.Rebuild("test"))
    with pytest.raises(GpuRefStale) as info:
        before.access()
    assert info.value.reason == "context rebuilt"
    after = _round_trip(device.ask(xa.Allocate(256)))
    assert after.access() is after and after.generation == 1
    shared_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(256))
    with pytest.raises(GpuRefStale) as info:
        after.access()
    assert info.value.reason == "context poisoned"


def test_a_stopped_device_makes_imported_handles_stale(device: pykka.ActorRef[Any]) -> None:
    shared = _round_trip(device.ask(xa.Allocate(256)))
    device.stop()
    with pytest.raises(GpuRefStale) as info:
        shared.access()
    assert info.value.reason == "device shutting down"


def test_a_stopped_device_s_export_table_goes_without_a_garbage_collection(shared_driver: xa.HostDriver) -> None:
    """Stopping a device frees its state at once (the actor holds no reference cycle), so the
    export table closes then: its segment unlinked, its sweeper thread ended, not at the next
    garbage collection."""
    gc.collect()
    gc.disable()
    try:
        device = xa.DeviceActor.start(0, shared_driver)
        ref = device.ask(xa.Allocate(256))
        table = _table(ref)
        pickle.dumps(ref)  # a count the table pins until the device's generation ends
        name, sweeper = table.name, table._sweeper
        del ref, table
        device.stop()
        deadline = time.monotonic() + 5.0  # the actor's thread drops its last reference as it ends
        while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(f"/dev/shm/{name}"), "the stopped device's export table waits for a collection"
        sweeper.join(5.0)
        assert not sweeper.is_alive()
    finally:
        gc.enable()


def test_a_handle_collected_inside_a_count_section_gives_its_count_back_there(device: pykka.ActorRef[Any]) -> None:
    """The garbage collector runs an imported handle's finalizer on whatever thread allocates: a
    thread inside a section of the counts' range lock (the owner's sweep allocates there) included.
    The count comes back as part of that section instead of waiting for it (which would hang the
    thread, the table's lock it holds, and every later pickle)."""
    ref = device.ask(xa.Allocate(256))
    table = _table(ref)
    held = _round_trip(ref)
    slot = held.export.slot
    box: list[Any] = [held]
    box.append(box)  # a cycle: the handle goes at a collection, not before
    assert table.count(slot) == 1
    gc.collect()
    gc.disable()  # the collection below is the only one: inside the section
    try:
        del held, box

        def section() -> None:
            with table.segment.locked(*COUNTS_RANGE):
                gc.collect()  # as an allocation inside the sweep may start one

        thread = threading.Thread(target=section, daemon=True)
        thread.start()
        thread.join(10.0)
        assert not thread.is_alive(), "the collected handle's finalizer waited for its own thread's section"
    finally:
        gc.enable()
    assert table.count(slot) == 0
    with table.segment.locked(*COUNTS_RANGE):  # let go: another section takes it
        assert table.count(slot) == 0


def test_release_gives_the_count_back_and_forwarding_takes_one(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(256))
    table = _table(ref)
    first = _round_trip(ref)
    slot = first.export.slot
    assert table.count(slot) == 1
    second = _round_trip(first)  # forwarded by the importer
    assert table.count(slot) == 2
    second.release()
    second.release()  # idempotent
    assert second.released and table.count(slot) == 1
    with pytest.raises(GpuRefStale) as info:
        second.access()
    assert info.value.reason == "released"
    with pytest.raises(GpuRefStale):
        pickle.dumps(second)
    assert table.count(slot) == 1, "a refused forward takes nothing"
    del first
    gc.collect()
    assert table.wait_unpinned(10.0)


def test_the_owner_frees_only_after_the_last_import_is_dropped(device: pykka.ActorRef[Any], shared_driver: Any) -> None:
    ref = device.ask(xa.Allocate(1 << 20))
    table = _table(ref)
    shared = _round_trip(ref)
    del ref
    gc.collect()
    device.ask(xa.GetStats())  # drains the frees of dropped handles: none may be this one
    assert shared_driver.live_allocations(0) == 1
    assert table.pinned_count() == 1
    shared.release()
    assert table.wait_unpinned(10.0)
    device.ask(xa.GetStats())
    assert shared_driver.live_allocations(0) == 0


def test_a_late_pickle_of_a_freed_slot_adopts_nothing(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(256))
    table = _table(ref)
    data = pickle.dumps(ref)
    first = pickle.loads(data)
    first.release()
    assert table.wait_unpinned(10.0)
    late = pickle.loads(data)  # the same bytes again: their count was given back already
    assert late.released
    with pytest.raises(GpuRefStale):
        late.access()
    assert table.count(first.export.slot) == 0


def test_a_device_without_shared_memory_refuses_and_pins_nothing(host_device: pykka.ActorRef[Any]) -> None:
    ref = host_device.ask(xa.Allocate(256))
    with pytest.raises(InvalidRequest, match="shared=True"):
        pickle.dumps(ref)
    assert host_device.ask(xa.GetStats()).live_blocks == 1
    pykka.ActorRegistry.stop_all()


def test_a_stale_or_released_ref_is_not_exported(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(256))
    table = _table(ref)
    ref.release()
    with pytest.raises(GpuRefStale):
        export_ref(ref)
    assert table.pinned_count() == 0


def test_the_export_table_bounds_its_slots(device: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ref = device.ask(xa.Allocate(256))
    table = _table(ref)
    monkeypatch.setattr(table, "_free", [])
    other = device.ask(xa.Allocate(256))
    with pytest.raises(InvalidRequest, match=f"{SLOTS} handles"):
        pickle.dumps(other)
    assert table.pinned_count() == 0


def test_an_import_of_a_gone_table_arrives_stale(device: pykka.ActorRef[Any]) -> None:
    """A handle pickled before its owner ended (an isolated device restarting while the message
    was on its way) still unpickles, so the message that carried it arrives; every use of it is
    ``GpuRefStale``, and dropping it gives nothing back to anybody."""
    export = export_ref(device.ask(xa.Allocate(256)))
    bogus = export._replace(table="xlog-refs-gone-0-0", cell="xlog-refs-gone-0-0")
    message = pickle.loads(pickle.dumps(("batch 7", import_ref, bogus)))
    handle = message[1](message[2])
    assert handle.released
    with pytest.raises(xa.GpuRefStale, match="context rebuilt.*owner ended"):
        handle.access()
    with pytest.raises(xa.GpuRefStale):
        pickle.dumps(handle)
    handle.release()
    del handle
    import_ref(export).release()


@pytest.mark.parametrize("drop", ["release", "collect"])
def test_a_handle_drops_its_mapping_before_it_gives_its_count_back(device: pykka.ActorRef[Any], drop: str) -> None:
    """CUDA wants a pool block freed in every importer before its owner frees it: the mapping a
    handle opened goes before its count does, whether it is released or collected."""
    ref = device.ask(xa.Allocate(64))
    table = _table(ref)
    shared = _round_trip(ref)
    slot = shared.export.slot
    seen: list[int] = []

    class Mapping:  # stands in for the CUDA mapping raw_device_ptr() keeps
        def __del__(self) -> None:
            seen.append(table.count(slot))

    shared._opened.append(Mapping())
    if drop == "release":
        shared.release()
    else:
        del shared
        gc.collect()
    assert seen == [1], "the mapping was dropped after the count went back"
    assert table.count(slot) == 0


def _fill_behind_a_sleep(device: pykka.ActorRef[Any], driver: Any) -> tuple[Any, Any]:
    """A handle whose last write (a fill with 3) waits 0.3 s behind a sleep on its copy actor's
    stream, and its import in this process."""
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(256))
    slow = ref.context.runtime.stream_pool.resolve(copy.proxy().stream_id.get())
    driver.sleep(slow, 300_000)
    copy.ask(xa.Fill(ref, 3))
    return ref, _round_trip(ref)


def test_a_wait_for_a_write_that_never_lands_times_out(device: pykka.ActorRef[Any], shared_driver: Any) -> None:
    ref, shared = _fill_behind_a_sleep(device, shared_driver)
    with pytest.raises(DeviceUnavailable, match="not reached"):
        shared.wait_write(timeout_s=0.05)
    assert bytes(shared.view(ordered=False)[:1]) != b"\x03"


def test_a_restart_ends_a_wait_with_stale(device: pykka.ActorRef[Any], shared_driver: Any) -> None:
    ref, shared = _fill_behind_a_sleep(device, shared_driver)
    device.tell(xa.Rebuild("test"))
    with pytest.raises(GpuRefStale) as info:
        shared.wait_write(timeout_s=10.0)
    assert info.value.reason == "context rebuilt"


# -- across processes --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peer() -> Iterator[Connection]:
    """One spawned peer process for the module (see ``ipc/ipc_peer.py``)."""
    sys.path.insert(0, str(PEER_DIR))
    try:
        module = importlib.import_module("ipc_peer")
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=module.serve, args=(theirs,), daemon=True)
        process.start()
    finally:
        sys.path.remove(str(PEER_DIR))
    theirs.close()
    try:
        assert _reply(mine) == "ready"
        yield mine
        mine.send(("stop",))
        assert _reply(mine) == "stopped"
    finally:
        process.join(10.0)
        if process.is_alive():
            process.kill()
            process.join(10.0)


def _reply(conn: Connection) -> Any:
    assert conn.poll(REPLY_TIMEOUT_S), "the peer process did not answer"
    return conn.recv()


@pytest.fixture
def cuda_device() -> Iterator[tuple[Any, pykka.ActorRef[Any]]]:
    """A device on the GPU, on the ``direct`` stack (``cuMemAlloc`` memory: legacy CUDA IPC)."""
    drv = xa.CudaDriver()
    device = xa.DeviceActor.start(0, drv, resource="direct")
    yield drv, device
    pykka.ActorRegistry.stop_all()
    drv.close()


@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)])
def test_cross_process_slow_writer_hazard(
    peer: Connection, device: pykka.ActorRef[Any], shared_driver: Any, ordered: bool
) -> None:
    """The producer's copy waits behind slow work on its stream; the consumer, in another
    process, reads the moment the handle arrives: the right bytes through the interprocess
    event, the old ones without it (the test proves it can fail)."""
    _slow_writer_hazard(peer, device, shared_driver, ordered)


@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)])
def test_cross_process_slow_writer_hazard_on_the_gpu(
    peer: Connection, cuda_device: tuple[Any, pykka.ActorRef[Any]], ordered: bool
) -> None:
    """The same hazard through CUDA IPC: a memory handle and an interprocess event."""
    driver, device = cuda_device
    _slow_writer_hazard(peer, device, driver, ordered)


@pytest.mark.gpu
def test_gpu_exports_interfaces_staleness_and_pool_refusal(
    peer: Connection, cuda_device: tuple[Any, pykka.ActorRef[Any]]
) -> None:
    """On the GPU: the peer's CUDA Array Interface and DLPack device; an import in the owner's
    own process is the same address; a rebuild makes the peer's handle stale; a block of the
    (not IPC-capable) stream-ordered pool is refused, pinning nothing."""
    driver, device = cuda_device
    ref = device.ask(xa.Allocate(4096))
    peer.send(("interfaces", ref))
    assert _reply(peer) == (True, "|u1", (4096,), (2, 0))
    assert _round_trip(ref).raw_device_ptr() == ref.raw_device_ptr()
    peer.send(("hold", ref))
    assert _reply(peer) == ("held", "SharedGpuRef")
    device.ask(xa.Rebuild("test"))
    peer.send(("access",))
    assert _reply(peer) == "context rebuilt"
    peer.send(("drop",))
    assert _reply(peer) == "dropped"
    pooled = xa.DeviceActor.start(1 if driver.device_count() > 1 else 0, xa.CudaDriver(), resource="async")
    try:
        block = pooled.ask(xa.Allocate(4096))
        with pytest.raises(InvalidRequest, match="not IPC-capable"):
            pickle.dumps(block)
        assert _table(block).pinned_count() == 0
    finally:
        pooled.stop()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_fresh_process_s_first_use_of_an_imported_gpu_handle_is_its_address(
    cuda_device: tuple[Any, pykka.ActorRef[Any]]
) -> None:
    """The first CUDA call of a fresh consumer is ``raw_device_ptr()`` (no wait, no interface
    first): the import retains the context and maps the handle (it once deadlocked on its own
    lock there), and the bytes read through that address are the owner's."""
    _driver, device = cuda_device
    ref = device.ask(xa.Allocate(4096))
    copier = xa.CopyActor.start(device)
    try:
        copier.ask(xa.Fill(ref, 7))
        copier.ask(xa.CopyToHost(ref, nbytes=4))
        program = (
            "import pickle, sys\n"
            "from cuda.bindings import driver as cu\n"
            "ref = pickle.loads(sys.stdin.buffer.read())\n"
            "ptr = ref.raw_device_ptr()\n"
            "out = bytearray(4)\n"
            "(err,) = cu.cuMemcpyDtoH(out, ptr, 4)\n"
            "print(int(err), bytes(out).hex())\n"
            "ref.release()\n"
        )
        done = subprocess.run([sys.executable, "-c", program], input=pickle.dumps(ref), capture_output=True,
                              timeout=90, check=False)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        assert done.stdout.decode().split() == ["0", "07070707"]
    finally:
        copier.stop()


@pytest.fixture
def pool_device() -> Iterator[tuple[Any, pykka.ActorRef[Any]]]:
    """A device on the GPU whose ``async`` stack allocates from an IPC-capable pool."""
    drv = xa.CudaDriver(ipc_pool=True)
    device = xa.DeviceActor.start(0, drv, resource="async")
    yield drv, device
    pykka.ActorRegistry.stop_all()
    drv.close()


@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.concurrent_streams)])
def test_cross_process_slow_writer_hazard_on_the_ipc_pool(
    peer: Connection, pool_device: tuple[Any, pykka.ActorRef[Any]], ordered: bool
) -> None:
    """The same hazard for a block of the IPC-capable pool: its export data, the pool's fd from
    the owner's fd server, and the interprocess event of its last write."""
    driver, device = pool_device
    _slow_writer_hazard(peer, device, driver, ordered)


@pytest.mark.gpu
def test_gpu_ipc_pool_bytes_release_order_and_staleness(
    peer: Connection, pool_device: tuple[Any, pykka.ActorRef[Any]]
) -> None:
    """An async-stack block in another process: the right bytes and interfaces; in the owner's
    own process the owner's address; the owner frees only after the peer dropped its import; a
    rebuild makes the peer's handle stale and withdraws the old pool's fd, and blocks of the new
    pool import again (a second pool import in the peer)."""
    from xlog_actors.driver.cuda.pool_ipc import CudaPoolExport

    driver, device = pool_device
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    copy.ask(xa.Fill(ref, 7))
    here = _round_trip(ref)
    assert isinstance(here.export.memory, CudaPoolExport)
    assert here.raw_device_ptr() == ref.raw_device_ptr()
    here.release()
    peer.send(("read", ref, True, 16))
    assert _reply(peer) == b"\x07" * 16
    peer.send(("interfaces", ref))
    assert _reply(peer) == (True, "|u1", (4096,), (2, 0))
    old_key = pickle.loads(pickle.dumps(ref)).export.memory.key

    table = _table(ref)
    peer.send(("hold", ref))
    assert _reply(peer) == ("held", "SharedGpuRef")
    peer.send(("read_held", 4))
    assert _reply(peer) == b"\x07" * 4, "the held handle imported the block"
    del ref
    gc.collect()
    assert device.ask(xa.GetStats()).live_blocks == 1 and table.pinned_count() == 1
    peer.send(("drop",))
    assert _reply(peer) == "dropped"
    assert table.wait_unpinned(10.0)
    assert device.ask(xa.GetStats()).live_blocks == 0, "the owner freed once the peer's import was gone"

    ref = device.ask(xa.Allocate(256))
    copy.ask(xa.Fill(ref, 5))
    peer.send(("hold", ref))
    assert _reply(peer) == ("held", "SharedGpuRef")
    peer.send(("read_held", 4))
    assert _reply(peer) == b"\x05" * 4, "the peer holds an import across the rebuild"
    assert old_key in served().offered()
    device.ask(xa.Rebuild("test"))
    peer.send(("access",))
    assert _reply(peer) == "context rebuilt"
    assert old_key not in served().offered(), "the retired pool's fd is withdrawn"
    peer.send(("drop",))  # the peer frees its import of a block its owner's rebuild freed
    assert _reply(peer) == "dropped"

    fresh = device.ask(xa.Allocate(256))
    xa.CopyActor.start(device).ask(xa.Fill(fresh, 9))
    assert pickle.loads(pickle.dumps(fresh)).export.memory.key != old_key
    peer.send(("read", fresh, True, 8))
    assert _reply(peer) == b"\x09" * 8


def _slow_writer_hazard(peer: Connection, device: pykka.ActorRef[Any], driver: Any, ordered: bool) -> None:
    # The write goes through the driver on a stream of the device's pool, recorded on the handle
    # as a library actor records it: a CopyActor on the ``direct`` stack (the one legacy CUDA IPC
    # exports) synchronizes its stream before it replies, so the consumer could never race it.
    reader = xa.CopyActor.start(device)
    n = 1 << 14
    ref = device.ask(xa.Allocate(4 * n))
    reader.ask(xa.Fill(ref, 0))
    reader.ask(xa.CopyToHost(ref, nbytes=4))  # the zero fill is complete
    # A pinned source: from pageable memory CUDA may return from the copy call only once the
    # stream reached it (after the sleep), and the hazard would never show on a GPU.
    source = device.ask(xa.AllocatePinned(4 * n))
    source.array(np.float32)[:] = 2.0
    pool = ref.context.runtime.stream_pool
    stream_id = pool.acquire()
    slow = pool.resolve(stream_id)
    driver.sleep(slow, 400_000)
    driver.copy_to_device(ref.raw_device_ptr(), source.view(), slow)
    ref.record_write(stream_id)
    peer.send(("read", ref, ordered, 4 * n))
    got = np.frombuffer(_reply(peer), np.float32)
    slow.synchronize()
    if ordered:
        assert (got == 2.0).all()
    else:
        assert not (got == 2.0).all(), "without the event the consumer read before the slow copy landed"


def test_cross_process_lifetime_and_staleness(
    peer: Connection, device: pykka.ActorRef[Any], shared_driver: Any
) -> None:
    """The peer holds the only handle: the owner keeps the memory; a rebuild makes the peer's
    handle stale; dropping it there lets the owner free (its device process, only then)."""
    ref = device.ask(xa.Allocate(1 << 20))
    table = _table(ref)
    peer.send(("hold", ref))
    assert _reply(peer) == ("held", "SharedGpuRef")
    del ref
    gc.collect()
    device.ask(xa.GetStats())
    assert shared_driver.live_allocations(0) == 1 and table.pinned_count() == 1
    peer.send(("access",))
    assert _reply(peer) == "ok"
    peer.send(("drop",))
    assert _reply(peer) == "dropped"
    assert table.wait_unpinned(10.0)
    device.ask(xa.GetStats())
    assert shared_driver.live_allocations(0) == 0

    peer.send(("hold", device.ask(xa.Allocate(256))))
    assert _reply(peer) == ("held", "SharedGpuRef")
    device.ask(xa.Rebuild("test"))
    peer.send(("access",))
    assert _reply(peer) == "context rebuilt"
    peer.send(("drop",))
    assert _reply(peer) == "dropped"


@pytest.mark.gpu
def test_an_isolated_cuda_device_with_the_ipc_pool_hands_its_async_blocks_to_a_third_process(
    peer: Connection,
) -> None:
    """``isolate=True, ipc_pool=True`` on CUDA: a block of the child's async stack, written by the
    child's copy actor, is read by a third process through the pool import; a kill of the child
    makes it stale there."""
    from xlog_actors.driver.cuda.pool_ipc import CudaPoolExport

    device = xa.DeviceActor.start(0, "cuda", resource="async", isolate=True, ipc_pool=True)
    try:
        copy = xa.CopyActor.start(device)
        ref = device.ask(xa.Allocate(4096))
        copy.ask(xa.Fill(ref, 9))
        here = _round_trip(ref)
        assert isinstance(here.export.memory, CudaPoolExport)
        here.release()
        peer.send(("read", ref, True, 16))
        assert _reply(peer) == b"\x09" * 16
        peer.send(("hold", ref))
        assert _reply(peer) == ("held", "SharedGpuRef")
        with pytest.raises(xa.DeviceUnavailable):
            device.ask(ChildFault("kill"))
        peer.send(("access",))
        assert _reply(peer) == "context rebuilt"
        peer.send(("drop",))
        assert _reply(peer) == "dropped"
        fresh = device.ask(xa.Allocate(256))
        assert isinstance(_round_trip(fresh).export.memory, CudaPoolExport)
    finally:
        pykka.ActorRegistry.stop_all()


def test_an_isolated_devices_handles_cross_to_a_third_process(peer: Connection) -> None:
    """A parent-side handle of an isolated device, sent on: the peer sees the child's memory;
    the child keeps it while the peer holds it (after the parent dropped its handle) and frees it
    once the peer drops it; a SIGKILL of the child makes the handle stale in the parent and in the
    peer at once, and the new child's handles export again."""
    device = xa.DeviceActor.start(0, "host", isolate=True)
    try:
        ref = device.ask(xa.Allocate(1 << 20))
        here = _round_trip(ref)
        assert here.export.owner_pid != os.getpid(), "the child holds the memory and the count"
        assert here.export.cell != here.export.table, "the parent's generation cell validates it"
        here.view()[:4] = b"xlog"
        peer.send(("read", ref, True, 4))
        assert _reply(peer) == b"xlog", "parent, child and peer see the same bytes"

        peer.send(("hold", ref))
        assert _reply(peer) == ("held", "SharedGpuRef")
        here.release()
        del ref
        gc.collect()
        assert device.ask(xa.GetStats()).live_blocks == 1, "the child keeps what the peer holds"
        peer.send(("drop",))
        assert _reply(peer) == "dropped"
        deadline = time.monotonic() + 10.0
        while device.ask(xa.GetStats()).live_blocks != 0:  # the child's sweeper, then its actor
            assert time.monotonic() < deadline, "the child never freed the block the peer dropped"
            time.sleep(0.01)

        ref = device.ask(xa.Allocate(256))
        peer.send(("hold", ref))
        assert _reply(peer) == ("held", "SharedGpuRef")
        with pytest.raises(xa.DeviceUnavailable):
            device.ask(ChildFault("kill"))
        peer.send(("access",))
        assert _reply(peer) == "context rebuilt"
        with pytest.raises(GpuRefStale):
            ref.access()
        with pytest.raises(GpuRefStale):
            pickle.dumps(ref)
        peer.send(("drop",))
        assert _reply(peer) == "dropped"
        killed = here.export.owner_pid
        assert not [n for n in os.listdir("/dev/shm") if f"-{killed}-" in n], "the dead child's segments are unlinked"
        fresh = _round_trip(device.ask(xa.Allocate(256)))
        assert fresh.access() is fresh and fresh.generation == 1
    finally:
        pykka.ActorRegistry.stop_all()


# -- the process mode's acceptance, in one test ---------------------------------------------------
_MIB = 1 << 20


def _run_batch(device: Any, copy: Any, kernels: Any, b: int, n: int, fault: Any = None) -> None:
    """Batch ``b`` of the pipeline: copy in, scale-add, copy back, verify. ``fault``: asked of the
    device after the copy in, so the batch is in flight when the child dies."""
    from xlog_actors.driver.kernel_library import SCALE_ADD_F32, launch_shape

    x = (np.arange(n, dtype=np.float32) % 251) + b
    src, out = device.ask(xa.Allocate(4 * n)), device.ask(xa.Allocate(4 * n))
    copy.ask(xa.CopyToDevice(src, x))
    if fault is not None:
        with pytest.raises(GpuRefStale, match="context poisoned"):
            device.ask(fault)
    grid, block = launch_shape(n)
    kernels.ask(xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(out), xa.In(src), 2.0, 1.0, n]))
    got = np.frombuffer(copy.ask(xa.CopyToHost(out)), np.float32)
    assert np.array_equal(got, np.float32(2.0) * x + np.float32(1.0)), f"batch {b} holds wrong bytes"


@pytest.mark.parametrize("kind", [
    "host",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        os.environ.get("XLOG_ACTORS_SANITIZER") == "1",
        reason="plants a real illegal address: the sanitizer reports it")]),
])
def test_process_mode_acceptance_an_illegal_address_mid_pipeline(peer: Connection, kind: str) -> None:
    """The process mode's acceptance as one test: a kernel writes an illegal address in the device
    process while a pipeline runs; the device comes back in a new process with generation + 1;
    the old handles fail in the parent and in a third process; new allocations work; the dead
    process's memory is given back (CUDA: ``cuMemGetInfo`` back to what it read with the device
    up and idle; host: nothing outstanding); every batch finishes, redone or verified."""
    from xlog_actors.actors.isolated import ChildFault as Fault

    device = xa.DeviceActor.start(0, kind, resource="async", isolate=True, ipc_pool=True)
    probe = xa.CudaDriver() if kind == "cuda" else None
    try:
        copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
        _run_batch(device, copy, kernels, -1, 1024)  # the library actors are up in the child
        baseline = None if probe is None else probe.mem_info(0)[0]
        first_pid = _round_trip(device.ask(xa.Allocate(256))).export.owner_pid
        old = device.ask(xa.Allocate(_MIB))
        peer.send(("hold", old))
        assert _reply(peer) == ("held", "SharedGpuRef")
        ballast = device.ask(xa.Allocate(256 * _MIB))  # memory the dead process must give back

        n, batches, redone = 1 << 16, 8, 0
        b = 0
        while b < batches:
            try:
                _run_batch(device, copy, kernels, b, n, Fault("illegal_address") if b == 3 and not redone else None)
            except (GpuRefStale, DeviceUnavailable):
                redone += 1  # the batch in flight when the child died: done again on the new one
                continue
            b += 1
        assert (b, redone) == (batches, 1)

        stats = device.ask(xa.GetStats())
        assert (stats.generation, stats.restarts, stats.status) == (1, 1, "running")
        with pytest.raises(GpuRefStale, match="context poisoned"):
            old.access()
        with pytest.raises(GpuRefStale):
            ballast.access()
        peer.send(("access",))
        assert _reply(peer) in ("context poisoned", "context rebuilt"), "the third process's handle is stale"
        peer.send(("drop",))
        assert _reply(peer) == "dropped"
        fresh = device.ask(xa.Allocate(_MIB))
        assert fresh.generation == 1 and fresh.access().nbytes == _MIB
        assert _round_trip(fresh).export.owner_pid != first_pid, "a new process serves"
        del old, ballast, fresh
        gc.collect()
        deadline = time.monotonic() + 10.0
        while device.ask(xa.GetStats()).bytes_outstanding != 0:
            assert time.monotonic() < deadline, "the new child still holds memory nobody holds"
            time.sleep(0.01)
        if probe is not None:
            assert baseline is not None
            free = probe.mem_info(0)[0]
            # The new child's context and pool replace the old one's; the 256 MiB ballast and the
            # dead context are given back by the driver when the process ends.
            assert abs(free - baseline) < 64 * _MIB, f"free memory {free >> 20} MiB, was {baseline >> 20} MiB"
    finally:
        pykka.ActorRegistry.stop_all()
        if probe is not None:
            probe.close()
