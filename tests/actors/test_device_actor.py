"""DeviceActor, its messages and DeviceClient on the host driver."""

from __future__ import annotations

import gc
import queue
import threading
import time
from typing import Any

import pykka
import pytest

import xlog_actors as xa

pytestmark = pytest.mark.usefixtures("stop_actors")


@pytest.fixture
def device(host_device: pykka.ActorRef[Any]) -> pykka.ActorRef[Any]:
    return host_device


def outstanding(device: pykka.ActorRef[Any]) -> int:
    return device.ask(xa.GetStats()).bytes_outstanding


# -- worker actors passing handles ----------------------------------------------------------------


class Writer(pykka.ThreadingActor):
    """Records a write on every handle it is given and hands it on."""

    def __init__(self, stream: int, downstream: pykka.ActorRef[Any]) -> None:
        super().__init__()
        self.stream = xa.StreamId(stream)
        self.downstream = downstream

    def on_receive(self, message: Any) -> Any:
        if message == "ping":
            return None
        ref: xa.GpuRef = message
        ref.access()
        ref.record_write(self.stream)
        return self.downstream.ask(ref)


class Reader(pykka.ThreadingActor):
    """Keeps every handle it is given; answers what it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[xa.GpuRef] = []

    def on_receive(self, message: Any) -> Any:
        if message == "last_writes":
            return [(r.raw_device_ptr(), r.last_write_stream) for r in self.kept]
        if message == "drop":
            self.kept.clear()
            return None
        self.kept.append(message)
        return (message.raw_device_ptr(), message.last_write_stream)


def test_worker_actors_pass_refs_and_share_last_write_stream(device: pykka.ActorRef[Any]) -> None:
    reader = Reader.start()
    writer = Writer.start(5, reader)
    refs = device.ask(xa.AllocateMany([256, 512, 1024]))
    seen = [writer.ask(ref) for ref in refs]
    assert seen == [(r.raw_device_ptr(), xa.StreamId(5)) for r in refs]
    # The caller's handles are the very objects the reader keeps: a write recorded by any holder
    # is seen by all.
    refs[1].record_write(xa.StreamId(9))
    assert reader.ask("last_writes") == [
        (refs[0].raw_device_ptr(), 5),
        (refs[1].raw_device_ptr(), 9),
        (refs[2].raw_device_ptr(), 5),
    ]
    # The memory lives while the reader holds the handles, and goes when it drops them.
    del refs, seen
    gc.collect()
    assert outstanding(device) == 256 + 512 + 1024
    reader.ask("drop")
    # pykka's loop keeps the last message an actor handled alive until its next one: the
    # writer still holds the last handle it forwarded until it handles something else.
    writer.ask("ping")
    gc.collect()
    assert outstanding(device) == 0


# -- Rebuild ------------------------------------------------------------------------------------------


class Listener(pykka.ThreadingActor):
    def __init__(self) -> None:
        super().__init__()
        self.events: queue.Queue[xa.GenerationChanged] = queue.Queue()

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, xa.GenerationChanged):
            self.events.put(message)
        return None


def test_rebuild_makes_old_refs_stale_and_frees_nothing_into_the_new_context(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any]
) -> None:
    listener_ref = Listener.start()
    listener = listener_ref.proxy().events.get()  # the queue object itself (thread-safe)
    device.ask(xa.Subscribe(listener_ref))
    device.ask(xa.Subscribe(listener_ref))  # subscribing twice notifies once
    old = device.ask(xa.AllocateMany([1000, 2000, 3000]))
    assert outstanding(device) == 6000 and host_driver.live_allocations(0) == 3

    generation = device.ask(xa.Rebuild("test"))
    assert generation == 1
    assert listener.get(timeout=2) == xa.GenerationChanged(0, 1, "running")
    for ref in old:
        with pytest.raises(xa.GpuRefStale) as info:
            ref.access()
        assert info.value.reason == "context rebuilt"
    stats = device.ask(xa.GetStats())
    assert (stats.generation, stats.restarts, stats.bytes_outstanding, stats.live_blocks) == (1, 1, 0, 0)

    new = device.ask(xa.AllocateMany([4096, 4096]))
    assert [r.generation for r in new] == [1, 1]
    assert host_driver.live_allocations(0) == 2
    # Old handles go away (dropped, released or Free'd) after the rebuild: nothing is freed
    # into the new context.
    old[0].release()
    device.ask(xa.Free(old[1]))
    del old
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 8192 and stats.live_blocks == 2
    assert host_driver.live_allocations(0) == 2
    assert all(r.access().nbytes == 4096 for r in new)

    assert device.ask(xa.Rebuild()) == 2
    assert listener.get(timeout=2).generation == 2
    assert listener.empty()
    device.ask(xa.Unsubscribe(listener_ref))
    device.ask(xa.Rebuild())
    time.sleep(0.05)
    assert listener.empty()


def test_subscribe_needs_an_actor_ref(device: pykka.ActorRef[Any]) -> None:
    with pytest.raises(xa.InvalidRequest):
        device.ask(xa.Subscribe("not an actor"))  # type: ignore[arg-type]
    assert device.ask(xa.Allocate(8)).nbytes == 8


def test_actor_ref_stays_valid_across_rebuilds(device: pykka.ActorRef[Any]) -> None:
    for expected in range(1, 4):
        assert device.ask(xa.Rebuild()) == expected
        assert device.is_alive()
        assert device.ask(xa.Allocate(64)).generation == expected


# -- one actor per ordinal ------------------------------------------------------------------------


def test_one_actor_per_ordinal(host_driver: xa.HostDriver) -> None:
    dev0 = xa.DeviceActor.start(0, driver=host_driver)
    dev1 = xa.DeviceActor.start(1, driver=host_driver)
    with pytest.raises(xa.InvalidRequest, match="already has a DeviceActor"):
        xa.DeviceActor.start(0, driver=host_driver)
    with pytest.raises(xa.InvalidRequest):
        xa.DeviceActor.start(2, driver=host_driver)
    a = dev0.ask(xa.Allocate(100))
    b = dev1.ask(xa.Allocate(200))
    assert (a.device_id, b.device_id) == (0, 1)
    assert a.access().device_ordinal == 0 and b.access().device_ordinal == 1
    assert a.context.runtime is not b.context.runtime

    # each ordinal has its own generation
    assert dev1.ask(xa.Rebuild()) == 1
    assert dev0.ask(xa.GetStats()).generation == 0
    assert a.access().nbytes == 100
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        b.access()
    b = dev1.ask(xa.Allocate(200))

    # a handle of device 1 given to device 0 is refused, and both live on
    with pytest.raises(xa.InvalidRequest):
        dev0.ask(xa.Free(b))
    assert not b.released and b.access().nbytes == 200
    assert dev0.is_alive() and dev1.is_alive()
    assert dev0.ask(xa.GetStats()).bytes_outstanding == 100
    assert dev1.ask(xa.GetStats()).bytes_outstanding == 200
    with pytest.raises(xa.InvalidRequest):
        dev0.ask(xa.GetClient()).free(b)
    assert not b.released

    # stopping an actor gives its ordinal back
    dev0.stop()
    dev0 = xa.DeviceActor.start(0, driver=host_driver)
    assert dev0.ask(xa.Allocate(1)).device_id == 0
    # another driver's ordinal 0 is another device
    other = xa.HostDriver(device_count=1, memory_per_device=1 << 20)
    try:
        dev_other = xa.DeviceActor.start(0, driver=other)
        dev_other.stop()
    finally:
        other.close()


def test_bad_start_arguments(host_driver: xa.HostDriver) -> None:
    for ordinal in (-1, 16, 1.0, True, "0"):
        with pytest.raises(xa.InvalidRequest):
            xa.DeviceActor.start(ordinal, driver=host_driver)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest):
        xa.DeviceActor.start(0, driver=host_driver, resource=42)  # type: ignore[arg-type]
    # none of the refused starts took the ordinal
    xa.DeviceActor.start(0, driver=host_driver).stop()


# -- bad requests ---------------------------------------------------------------------------------------


BAD_REQUESTS = [
    pytest.param(xa.Allocate(0), xa.InvalidRequest, id="allocate-zero"),
    pytest.param(xa.Allocate(-1), xa.InvalidRequest, id="allocate-negative"),
    pytest.param(xa.Allocate(1.5), xa.InvalidRequest, id="allocate-float"),  # type: ignore[arg-type]
    pytest.param(xa.Allocate(True), xa.InvalidRequest, id="allocate-bool"),
    pytest.param(xa.Allocate(None), xa.InvalidRequest, id="allocate-none"),  # type: ignore[arg-type]
    pytest.param(xa.Allocate("64"), xa.InvalidRequest, id="allocate-str"),  # type: ignore[arg-type]
    pytest.param(xa.Allocate(64, stream=xa.StreamId(99)), xa.StreamMisuse, id="allocate-unknown-stream"),
    pytest.param(xa.AllocateMany([64, 64, 0, 64]), xa.InvalidRequest, id="many-one-bad-size"),
    pytest.param(xa.AllocateMany([64, 1.0]), xa.InvalidRequest, id="many-float"),  # type: ignore[list-item]
    pytest.param(xa.AllocateMany(64), xa.InvalidRequest, id="many-not-a-list"),  # type: ignore[arg-type]
    pytest.param(xa.AllocateMany([64], stream=xa.StreamId(99)), xa.StreamMisuse, id="many-unknown-stream"),
    pytest.param(xa.Free("not a ref"), xa.InvalidRequest, id="free-not-a-ref"),  # type: ignore[arg-type]
    pytest.param("hello", xa.InvalidRequest, id="unknown-message"),
    pytest.param(object(), xa.InvalidRequest, id="unknown-message-object"),
]


@pytest.mark.parametrize(("message", "error"), BAD_REQUESTS)
def test_bad_request_answered_with_its_error_and_actor_lives_on(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any], message: Any, error: type[Exception]
) -> None:
    keep = device.ask(xa.Allocate(4096))
    before = device.ask(xa.GetStats())
    live_before = host_driver.live_allocations(0)
    with pytest.raises(error):
        device.ask(message)
    assert device.is_alive()
    after = device.ask(xa.GetStats())
    assert (after.bytes_outstanding, after.live_blocks, after.generation, after.restarts, after.status) == (
        before.bytes_outstanding,
        before.live_blocks,
        before.generation,
        before.restarts,
        "running",
    )
    assert host_driver.live_allocations(0) == live_before
    assert keep.access().nbytes == 4096
    new = device.ask(xa.Allocate(128))
    assert new.generation == 0 and new.access().nbytes == 128


def test_allocate_many_all_or_none_when_oom_midway(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    keep = device.ask(xa.Allocate(1024))
    for k in (0, 1, 5):
        host_driver.inject_fault(0, "oom", after_calls=k)
        with pytest.raises(xa.OutOfMemory):
            device.ask(xa.AllocateMany([512] * 10))
        stats = device.ask(xa.GetStats())
        assert (stats.bytes_outstanding, stats.live_blocks, stats.generation) == (1024, 1, 0)
        assert host_driver.live_allocations(0) == 1
    # a real OOM midway (the device runs out), not an injected one
    free, _total = host_driver.mem_info(0)
    with pytest.raises(xa.OutOfMemory):
        device.ask(xa.AllocateMany([free // 4] * 5))
    assert outstanding(device) == 1024 and host_driver.live_allocations(0) == 1
    refs = device.ask(xa.AllocateMany([512] * 10))
    assert len(refs) == 10 and outstanding(device) == 1024 + 5120
    assert keep.access().nbytes == 1024


def test_allocate_many_empty_and_tuple(device: pykka.ActorRef[Any]) -> None:
    assert device.ask(xa.AllocateMany([])) == []
    refs = device.ask(xa.AllocateMany((8, 16), tag=xa.AllocTag("t")))
    assert [len(r) for r in refs] == [8, 16] and {r.tag for r in refs} == {"t"}
    assert len({r.raw_device_ptr() for r in refs}) == 2


def test_free_is_idempotent_and_makes_ref_released(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(1 << 16))
    assert device.ask(xa.Free(ref)) is None
    assert device.ask(xa.Free(ref)) is None
    ref.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        ref.access()
    assert outstanding(device) == 0 and host_driver.live_allocations(0) == 0


def test_told_bad_messages_do_not_stop_the_actor(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    device.tell(xa.Allocate(0))
    device.tell(xa.Free(42))  # type: ignore[arg-type]
    device.tell("nonsense")
    stats = device.ask(xa.GetStats())
    assert device.is_alive() and stats.status == "running" and stats.restarts == 0
    # ... and the actor still owns its ordinal
    with pytest.raises(xa.InvalidRequest, match="already has a DeviceActor"):
        xa.DeviceActor.start(0, driver=host_driver)


def test_get_stats(device: pykka.ActorRef[Any]) -> None:
    device.ask(xa.Allocate(100, tag=xa.AllocTag("a")))  # dropped at once
    a = device.ask(xa.Allocate(100, tag=xa.AllocTag("a")))
    b = device.ask(xa.AllocateMany([200, 300], tag=xa.AllocTag("b")))
    stats = device.ask(xa.GetStats())
    assert isinstance(stats, xa.DeviceStats)
    assert (stats.device_id, stats.generation, stats.restarts, stats.status, stats.driver) == (
        0,
        0,
        0,
        "running",
        "host",
    )
    assert stats.bytes_outstanding == 600 and stats.live_blocks == 3
    by_tag = {tag: (g["count"], g["nbytes"]) for tag, g in stats.report["by_tag"].items()}
    assert by_tag == {"a": (1, 100), "b": (2, 500)}
    assert stats.report["by_stream"]["0"]["count"] == 3
    assert stats.mem_total == 64 << 20 and stats.mem_free is not None and stats.mem_free < stats.mem_total
    assert a.nbytes + sum(r.nbytes for r in b) == 600


# -- dropping handles -----------------------------------------------------------------------------------


def test_dropping_10000_refs_from_allocate_many_returns_to_zero(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any]
) -> None:
    refs = device.ask(xa.AllocateMany([256] * 10_000))
    assert outstanding(device) == 256 * 10_000
    del refs
    gc.collect()
    stats = device.ask(xa.GetStats())  # the very next GetStats
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0
    assert host_driver.live_allocations(0) == 0


def test_dropping_10000_refs_from_a_client_returns_to_zero(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any]
) -> None:
    client = device.ask(xa.GetClient())
    refs = [client.allocate(256) for _ in range(5_000)] + client.allocate_many([256] * 5_000)
    assert outstanding(device) == 256 * 10_000
    del refs
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0
    assert host_driver.live_allocations(0) == 0


def test_dropping_right_after_each_ask_is_counted_by_the_next_get_stats(device: pykka.ActorRef[Any]) -> None:
    for _ in range(20):
        device.ask(xa.Allocate(64))  # the reply is dropped at once
        assert outstanding(device) == 0


class Blocker(pykka.ThreadingActor):
    pass


def test_allocate_whose_asker_timed_out_is_reclaimed(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    gate = threading.Event()
    started = threading.Event()
    client = device.ask(xa.GetClient())
    real = client._cell.lifecycle.context.allocate_many  # type: ignore[union-attr]

    def slow_allocate_many(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert gate.wait(5)
        return real(*args, **kwargs)

    # Make the actor busy with an AllocateMany that blocks until we open the gate. Asks are
    # served on the actor's thread here: one served in the asker's (an idle device's inbox does
    # that) is answered before ask returns and cannot be abandoned.
    device.actor_inbox.serve_in_caller((), None)  # type: ignore[attr-defined]
    client._cell.lifecycle.context.allocate_many = slow_allocate_many  # type: ignore[union-attr,method-assign]
    busy = device.ask(xa.AllocateMany([128] * 100), block=False)
    assert started.wait(5)
    with pytest.raises(pykka.Timeout):
        device.ask(xa.Allocate(1 << 20), timeout=0.01)
    with pytest.raises(pykka.Timeout):
        device.ask(xa.AllocateMany([4096] * 50), timeout=0.01)
    gc.collect()
    stats_future = device.ask(xa.GetStats(), block=False)  # queued behind the abandoned asks
    gate.set()
    kept = busy.get(timeout=5)
    stats = stats_future.get(timeout=5)
    assert stats.bytes_outstanding == 128 * 100 and stats.live_blocks == 100
    del kept, busy
    gc.collect()
    assert outstanding(device) == 0
    assert host_driver.live_allocations(0) == 0


# -- DeviceClient -----------------------------------------------------------------------------------------


def test_client_allocates_from_8_threads_and_frees_from_others(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any]
) -> None:
    client = device.ask(xa.GetClient())
    assert isinstance(client, xa.DeviceClient) and client.device_id == 0
    handoff: queue.Queue[xa.GpuRef | None] = queue.Queue()
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    per_thread = 500

    def producer() -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                handoff.put(client.allocate(64 + (i % 7) * 64))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    ptrs: list[int] = []
    freed = [0]

    def consumer() -> None:
        try:
            while (ref := handoff.get()) is not None:
                ptrs.append(ref.raw_device_ptr())
                if freed[0] % 2:
                    client.free(ref)
                    client.free(ref)  # idempotent
                else:
                    ref.release()
                freed[0] += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    consumers = [threading.Thread(target=consumer) for _ in range(4)]
    producers = [threading.Thread(target=producer) for _ in range(8)]
    for t in consumers + producers:
        t.start()
    for t in producers:
        t.join()
    for _ in consumers:
        handoff.put(None)
    for t in consumers:
        t.join()
    assert errors == []
    assert len(ptrs) == 8 * per_thread
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0
    assert host_driver.live_allocations(0) == 0


def test_client_frees_of_one_handle_from_many_threads_free_it_once(device: pykka.ActorRef[Any]) -> None:
    client = device.ask(xa.GetClient())
    refs = client.allocate_many([256] * 100)
    keep = client.allocate(256)
    runtime = client._cell.lifecycle.context.runtime
    real_deallocate = runtime.deallocate
    calls: dict[int, int] = {}

    def counting_deallocate(block: xa.DeviceBlock) -> None:
        # The resource's free: what must happen exactly once per handle, whichever path frees it.
        calls[block.ptr] = calls.get(block.ptr, 0) + 1
        time.sleep(0.0005)  # widen the window in which another thread could free it too
        real_deallocate(block)

    runtime.deallocate = counting_deallocate
    client._cell.lifecycle.context.rebind_runtime()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def free_all() -> None:
        barrier.wait()
        for ref in refs:
            try:
                client.free(ref)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                errors.append(exc)

    threads = [threading.Thread(target=free_all) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(r.released for r in refs)
    assert sorted(calls.values()) == [1] * 100  # one free per handle, whoever won
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 256 and stats.live_blocks == 1
    assert keep.access().nbytes == 256


def _device_client_context(host_driver: xa.HostDriver, resource: str) -> tuple[pykka.ActorRef[Any], Any, Any]:
    """A device on ``resource``, its client and its current context."""
    device = xa.DeviceActor.start(0, driver=host_driver, resource=resource)
    client = device.ask(xa.GetClient())
    return device, client, client._cell.lifecycle.context


@pytest.mark.parametrize("resource", ["async", "async+cache"])
def test_the_context_calls_the_resource_in_c_until_its_calls_are_replaced(
    host_driver: xa.HostDriver, resource: str
) -> None:
    # The stream-ordered resource's methods are Cython functions, the block cache's plain method
    # descriptors: the context recognizes both as unreplaced.
    device, client, ctx = _device_client_context(host_driver, resource)
    assert ctx.runtime_in_c, "the stack's top is the stream-ordered resource or its cache: called in C"
    runtime = ctx.runtime
    real_allocate, seen = runtime.allocate, []

    def counting_allocate(*args: Any) -> Any:
        seen.append(args)
        return real_allocate(*args)

    runtime.allocate = counting_allocate
    client.free(client.allocate(256))
    assert seen == [], "read once, at construction: a replacement waits for rebind_runtime"
    ctx.rebind_runtime()
    assert not ctx.runtime_in_c
    client.free(client.allocate(256))
    assert len(seen) == 1, "after rebind_runtime the replacement is called"
    runtime.allocate = real_allocate
    ctx.rebind_runtime()
    assert ctx.runtime_in_c
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0


@pytest.mark.parametrize("resource", ["async", "async+cache"])
def test_the_context_frees_a_block_once_and_refuses_what_is_not_live(
    host_driver: xa.HostDriver, resource: str
) -> None:
    # With the cache called in C the cache's own table says what is live (the context keeps
    # none); either way a second free, or a free of a block of a former generation, frees nothing.
    device, client, ctx = _device_client_context(host_driver, resource)
    ref = client.allocate(256)
    block = ref.access()
    assert ctx.live_count() == 1 and ctx.live_blocks() == [block]
    assert ctx.free(block) is True
    assert ctx.free(block) is False, "freed already: nothing freed again"
    assert ctx.live_count() == 0 and ctx.live_blocks() == []
    again = client.allocate(256)
    if resource == "async+cache":
        assert again.access().ptr == block.ptr, "the cache hands the same address out again"
    assert ctx.free(block) is False, "the old generation's block is not the live one at its address"
    assert ctx.live_count() == 1
    client.free(again)
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0


def test_rebinding_the_cached_context_keeps_every_live_block_freeable_once(host_driver: xa.HostDriver) -> None:
    # Blocks handed out while the cache said what is live move to the context's table when the
    # cache's methods are replaced, and blocks handed out while replaced are found again after.
    device, client, ctx = _device_client_context(host_driver, "async+cache")
    runtime = ctx.runtime
    before = [client.allocate(512) for _ in range(3)]
    real_deallocate, freed = runtime.deallocate, []

    def counting_deallocate(block: xa.DeviceBlock) -> None:
        freed.append(block.ptr)
        real_deallocate(block)

    runtime.deallocate = counting_deallocate
    ctx.rebind_runtime()
    assert not ctx.runtime_in_c and ctx.live_count() == 3
    during = [client.allocate(512) for _ in range(2)]
    client.free(before[0])
    assert ctx.free(before[0]._block) is False, "freed: not live any more"
    assert freed == [before[0]._block.ptr]
    runtime.deallocate = real_deallocate
    ctx.rebind_runtime()
    assert ctx.runtime_in_c and ctx.live_count() == 4
    for ref in before[1:] + during:
        client.free(ref)
    assert ctx.live_count() == 0
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0


def test_client_live_blocks_never_alias(device: pykka.ActorRef[Any]) -> None:
    client = device.ask(xa.GetClient())
    results: list[list[xa.GpuRef]] = [[] for _ in range(8)]

    def run(out: list[xa.GpuRef]) -> None:
        for i in range(300):
            ref = client.allocate(256)
            if i % 3 == 0:
                client.free(ref)
            else:
                out.append(ref)

    threads = [threading.Thread(target=run, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = [ref for out in results for ref in out]
    assert len({r.raw_device_ptr() for r in live}) == len(live) == 8 * 200
    stats = device.ask(xa.GetStats())
    assert stats.live_blocks == len(live) and stats.bytes_outstanding == 256 * len(live)
    del live, results
    gc.collect()
    assert outstanding(device) == 0


def test_client_follows_rebuild(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    client = device.ask(xa.GetClient())
    old = client.allocate(512)
    assert old.generation == 0
    assert device.ask(xa.Rebuild()) == 1
    new = client.allocate(512)
    assert new.generation == 1 and new.access().nbytes == 512
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        old.access()
    client.free(old)  # an older generation: nothing to free, no error
    assert outstanding(device) == 512 and host_driver.live_allocations(0) == 1
    client.free(new)
    assert outstanding(device) == 0 and host_driver.live_allocations(0) == 0


def test_client_rejects_bad_requests(device: pykka.ActorRef[Any]) -> None:
    client = device.ask(xa.GetClient())
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(xa.InvalidRequest):
            client.allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest):
        client.allocate_many([8, 0])
    with pytest.raises(xa.StreamMisuse):
        client.allocate(8, stream=xa.StreamId(99))
    with pytest.raises(xa.InvalidRequest):
        client.free("nope")  # type: ignore[arg-type]
    assert outstanding(device) == 0
    assert client.allocate(8).nbytes == 8


def test_client_after_stop_is_unavailable(device: pykka.ActorRef[Any]) -> None:
    client = device.ask(xa.GetClient())
    ref = client.allocate(64)
    device.stop()
    with pytest.raises(xa.DeviceUnavailable):
        client.allocate(64)
    with pytest.raises(xa.GpuRefStale, match="device shutting down|device state dropped"):
        ref.access()


def test_a_driver_kind_starts_an_in_process_device_on_the_shared_driver_of_that_kind() -> None:
    """``DeviceActor.start(0, "host")`` as with ``isolate=True``: the process-wide driver of that
    kind, shared by every device started so; an unknown kind is refused and nothing starts."""
    first = xa.DeviceActor.start(0, "host")
    try:
        second_ref = first.ask(xa.Allocate(64))
        assert second_ref.context.driver is xa.driver_of_kind(" HOST ")
        assert xa.driver_of_kind("host") is xa.driver_of_kind("host")
    finally:
        first.stop()
    again = xa.DeviceActor.start(0, "host")
    try:
        assert again.ask(xa.Allocate(64)).context.driver is xa.driver_of_kind("host")
    finally:
        again.stop()
    before = len(pykka.ActorRegistry.get_all())
    with pytest.raises(xa.InvalidRequest, match="unknown driver kind 'gpu'"):
        xa.DeviceActor.start(0, "gpu")
    with pytest.raises(xa.InvalidRequest, match="unknown driver kind"):
        xa.driver_of_kind(3)
    assert len(pykka.ActorRegistry.get_all()) == before
