"""GpuRef and DeviceState on the host driver.

Every test stops the actors it starts (``stop_all`` fixture) and the ``host_driver`` fixture
closes its driver.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref
from typing import Any, cast

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.errors import STALE_REASONS

pytestmark = pytest.mark.usefixtures("stop_actors")


@pytest.fixture
def device(host_device: pykka.ActorRef[Any]) -> pykka.ActorRef[Any]:
    return host_device


def reason_of(ref: xa.GpuRef) -> str:
    with pytest.raises(xa.GpuRefStale) as info:
        ref.access()
    assert info.value.reason in STALE_REASONS
    return info.value.reason


# -- DeviceState ------------------------------------------------------------------------------


def test_device_state_counters_and_flags() -> None:
    state = xa.DeviceState(3)
    assert (state.device_id, state.generation, state.accepting_ops) == (3, 0, True)
    assert state.bump_generation() == 1
    assert state.bump_generation() == 2
    assert state.generation == 2
    state.begin_shutdown()
    assert state.accepting_ops is False
    state.begin_shutdown()  # idempotent
    assert state.accepting_ops is False


def test_bump_generation_is_thread_safe() -> None:
    state = xa.DeviceState(0)
    seen: list[int] = []

    def bump() -> None:
        for _ in range(1000):
            seen.append(state.bump_generation())

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state.generation == 8000
    assert sorted(seen) == list(range(1, 8001))


# -- the handle as a value --------------------------------------------------------------------


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_not_constructible_directly() -> None:
    with pytest.raises(TypeError):
        xa.GpuRef()
    gc.collect()  # a half-made handle must not fail in __del__


def test_immutable(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(1024))
    for name in ("_block", "_generation", "_released", "_last_write", "nbytes", "generation", "anything"):
        with pytest.raises(AttributeError):
            setattr(ref, name, 1)
        with pytest.raises(AttributeError):
            delattr(ref, name)
    with pytest.raises(AttributeError):
        object.__setattr__(ref, "new_attribute", 1)  # slotted: no __dict__ to sneak into
    assert ref.access().nbytes == 1024


def test_copy_returns_same_object_and_pickle_refused_without_shared_memory(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(512))
    assert copy.copy(ref) is ref
    assert copy.deepcopy(ref) is ref
    assert copy.deepcopy({"a": [ref]})["a"][0] is ref
    # The fixture's host driver keeps device memory private: export (pickling) is refused, and
    # nothing was pinned for it (tests/actors/test_shared_ref.py covers the shared driver).
    with pytest.raises(xa.InvalidRequest, match="shared=True"):
        pickle.dumps(ref)


def test_facts(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(1000, tag=xa.AllocTag("weights")))
    assert len(ref) == ref.nbytes == 1000
    assert ref.tag == xa.AllocTag("weights") and isinstance(ref.tag, xa.AllocTag)
    assert ref.generation == 0
    assert ref.device_id == 0
    assert ref.alloc_stream == xa.StreamId.DEFAULT
    assert ref.last_write_stream is None
    block = ref.access()
    assert isinstance(block, xa.DeviceBlock)
    assert block.device_ordinal == 0 and block.nbytes == 1000
    assert ref.raw_device_ptr() == block.ptr
    assert "nbytes=1000" in repr(ref)


def test_cuda_array_interface_absent_on_host_driver(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(64))
    assert not hasattr(ref, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="CUDA driver"):
        ref.__dlpack__()


# -- access(): the five reasons and their order ----------------------------------------------


def test_reason_released_and_release_idempotent(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(4096))
    other = device.ask(xa.Allocate(4096))
    assert device.ask(xa.GetStats()).bytes_outstanding == 8192
    ref.release()
    ref.release()
    assert reason_of(ref) == "released"
    with pytest.raises(xa.GpuRefStale, match="released"):
        ref.raw_device_ptr()
    assert ref.released
    device.ask(xa.Free(ref))  # a released ref: no-op
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 4096 and stats.live_blocks == 1
    assert host_driver.live_allocations(0) == 1
    assert other.access().nbytes == 4096
    del ref
    gc.collect()
    assert device.ask(xa.GetStats()).bytes_outstanding == 4096


def test_release_from_many_threads_frees_once(device: pykka.ActorRef[Any]) -> None:
    refs = device.ask(xa.AllocateMany([256] * 200))
    keep = device.ask(xa.Allocate(256))
    barrier = threading.Barrier(8)

    def release_all() -> None:
        barrier.wait()
        for ref in refs:
            ref.release()

    threads = [threading.Thread(target=release_all) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 256 and stats.live_blocks == 1
    assert keep.access().nbytes == 256


def test_reason_context_rebuilt(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(128))
    assert device.ask(xa.Rebuild("test")) == 1
    assert reason_of(ref) == "context rebuilt"
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        ref.raw_device_ptr()
    assert ref.generation == 0 and ref.device_id == 0
    new = device.ask(xa.Allocate(128))
    assert new.generation == 1 and new.access().nbytes == 128


def test_reason_context_poisoned(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(128))
    host_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(128))
    assert reason_of(ref) == "context poisoned"


def test_reason_device_shutting_down_by_begin_shutdown(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(128))
    state = ref.context.state_ref()
    assert isinstance(state, xa.DeviceState) and state.device_id == 0
    state.begin_shutdown()
    assert reason_of(ref) == "device shutting down"


def test_reasons_after_stop_then_collect(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(128))
    state = ref.context.state_ref()
    device.stop()
    assert reason_of(ref) == "device shutting down"  # the state is still reachable (we hold it)
    assert ref.device_id == 0
    del state, device
    gc.collect()
    assert reason_of(ref) == "device state dropped"
    assert ref.device_id is None
    assert ref.nbytes == 128 and len(ref) == 128 and ref.generation == 0  # facts survive
    ref.release()  # nothing to free into any more: a no-op, never an error
    del ref
    gc.collect()


def test_validation_order(host_driver: xa.HostDriver, device: pykka.ActorRef[Any]) -> None:
    released_old = device.ask(xa.Allocate(64))
    released_old.release()
    assert reason_of(released_old) == "released"
    device.ask(xa.Rebuild())
    # generation is checked before released
    assert reason_of(released_old) == "context rebuilt"
    current = device.ask(xa.Allocate(64))
    host_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(64))
    # poisoned is checked before generation
    assert reason_of(released_old) == "context poisoned"
    assert reason_of(current) == "context poisoned"
    state = current.context.state_ref()
    state.begin_shutdown()
    # shutting down is checked before poisoned
    assert reason_of(current) == "device shutting down"
    assert reason_of(released_old) == "device shutting down"


def test_access_revalidates_after_unrelated_token_change(device: pykka.ActorRef[Any]) -> None:
    # A handle of the current generation stays valid however many times others go stale.
    ref = device.ask(xa.Allocate(64))
    for _ in range(3):
        other = device.ask(xa.Allocate(64))
        other.release()
        assert ref.access().nbytes == 64


# -- the shared cell ----------------------------------------------------------------------------


def test_record_write_seen_by_every_holder_across_threads(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(256))
    holders = [ref, copy.copy(ref), copy.deepcopy(ref), [ref][0]]
    seen: list[xa.StreamId | None] = []
    t = threading.Thread(target=lambda: ref.record_write(xa.StreamId(7)))
    t.start()
    t.join()
    t = threading.Thread(target=lambda: seen.append(holders[2].last_write_stream))
    t.start()
    t.join()
    assert seen == [xa.StreamId(7)]
    assert all(h.last_write_stream == 7 for h in holders)
    assert type(ref.last_write_stream) is xa.StreamId
    ref.record_write(3)  # a plain int is accepted and stored as a StreamId
    assert type(holders[1].last_write_stream) is xa.StreamId and holders[1].last_write_stream == 3


# -- lifetime ---------------------------------------------------------------------------------


def test_memory_lives_while_any_holder_can_reach_it(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(2048))
    box = {"ref": ref}
    del ref
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 2048 and stats.live_blocks == 1
    assert box["ref"].access().nbytes == 2048
    box.clear()
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0


def test_dropping_the_last_reference_frees_through_the_device(
    host_driver: xa.HostDriver, device: pykka.ActorRef[Any]
) -> None:
    # Dropped in another thread: the free is handed to the actor, never made there.
    ref = device.ask(xa.Allocate(1 << 20))
    holder = [ref]
    del ref
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0
    assert host_driver.live_allocations(0) == 0
    assert host_driver.mem_info(0)[0] == host_driver.mem_info(0)[1]


def test_a_handle_is_made_only_of_a_handle_class(device: pykka.ActorRef[Any]) -> None:
    # The compiled constructor calls the base's allocator directly; it must refuse any other type.
    from xlog_actors._core.handles import make_handle

    ref = device.ask(xa.Allocate(64))
    with pytest.raises(TypeError, match="not a subclass of HandleCore"):
        make_handle(int, ref.block, ref.context)  # type: ignore[arg-type]
    twin = make_handle(xa.GpuRef, ref.block, ref.context)
    assert type(twin) is xa.GpuRef and twin.generation == ref.generation and twin.access() is ref.block
    twin._mark_released()  # one free for the block: the original's


class _Holder:
    """An object with a ``__dict__`` that refers to itself: garbage only the collector frees."""

    def __init__(self) -> None:
        self.ref: xa.GpuRef | None = None
        self.me = self


def test_a_handle_in_a_reference_cycle_frees_its_block_when_collected(device: pykka.ActorRef[Any]) -> None:
    # The collector clears a cycle's members in the order it meets them: handles made before and
    # after their holders, so that some are met first. A handle must keep its fields until its
    # own drop hands the free over (no_gc_clear), whichever member is cleared first.
    gc.collect()
    gc.disable()
    try:
        for i in range(8):
            if i % 2:
                holder = _Holder()
                holder.ref = device.ask(xa.Allocate(4096))
            else:
                ref = device.ask(xa.Allocate(4096))
                holder = _Holder()
                holder.ref = ref
                del ref
        del holder
        assert device.ask(xa.GetStats()).live_blocks == 8  # the cycles still stand
        gc.collect()
    finally:
        gc.enable()
    stats = device.ask(xa.GetStats())
    assert stats.live_blocks == 0 and stats.bytes_outstanding == 0


class _CycleContext:
    """A context in a reference cycle with its handle: its ``reclaim`` reads its own attribute,
    which the collector clears when it breaks the cycle at it (a ``RemoteContext``'s slots are
    cleared that way), so a hand-over that runs after the clearing finds nothing to queue on."""

    def __init__(self, ctx: Any, frees: list[Any]) -> None:
        self.generation, self.token, self.state_ref = ctx.generation, ctx.token, ctx.state_ref
        self.frees = frees
        self.handle: Any = None

    def reclaim(self, block: Any, wake: bool = False) -> None:
        self.frees.append(block)


def test_a_handle_collected_with_its_context_in_a_cycle_hands_its_free_over(device: pykka.ActorRef[Any]) -> None:
    # The collector runs the handles' finalizer before it clears any member of the cycle: the
    # context the hand-over reads is whole then. Without it the free of every handle here is lost.
    from xlog_actors._core.handles import make_handle

    real = cast(xa.GpuRef, device.ask(xa.Allocate(4096)))
    frees: list[Any] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            ctx = _CycleContext(real.context, frees)
            ctx.handle = make_handle(xa.GpuRef, real.block, ctx)
            del ctx
        gc.collect()
    finally:
        gc.enable()
    assert frees == [real.block] * 4, "a handle's free was lost when its context was collected with it"


def test_a_dropped_handle_stays_dead_when_its_memory_makes_the_next(device: pykka.ActorRef[Any]) -> None:
    # A dropped handle's memory is kept for the next handle: a weak reference to the old handle
    # stays dead, a released handle still held stays refused, and each new handle is fresh.
    client = device.ask(xa.GetClient())
    held = client.allocate(4096)
    client.free(held)
    ref = client.allocate(4096)
    old_id = id(ref)
    seen = weakref.ref(ref)
    client.free(ref)
    del ref
    assert seen() is None
    fresh = [client.allocate(4096) for _ in range(4)]
    assert any(id(r) == old_id for r in fresh), "the dropped handle's memory was not reused"
    assert seen() is None
    for r in fresh:
        assert not r.released and r.last_write_stream is None and r.access() is r.block
    assert reason_of(held) == "released"
    for r in fresh:
        client.free(r)
    assert device.ask(xa.GetStats()).live_blocks == 0


def test_a_dropped_handles_memory_keeps_no_context_alive_and_takes_the_next_ones_fields(
    device: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept for the next handle, a dropped handle's memory holds on to its generation, token and
    # state's cell, not to its context: a rebuilt device's old context goes, and a handle made
    # from that memory in the new context is of the new generation and valid.
    client = device.ask(xa.GetClient())
    ref = client.allocate(4096)
    old_context, old_generation = weakref.ref(ref.context), ref.generation
    client.free(ref)
    del ref
    assert device.ask(xa.Rebuild()) == old_generation + 1
    gc.collect()
    assert old_context() is None, "a pooled handle kept a closed context alive"
    fresh = [client.allocate(4096) for _ in range(4)]

    def slow_path(self: xa.GpuRef, state: Any) -> None:
        raise AssertionError("a fresh handle's token is not its context's: access took the slow path")

    with monkeypatch.context() as patch:
        patch.setattr(xa.GpuRef, "_stale", slow_path)
        for r in fresh:
            assert r.generation == old_generation + 1 and r.access() is r.block and r.context is not None
    for r in fresh:
        client.free(r)
    assert device.ask(xa.GetStats()).live_blocks == 0


def test_a_handle_of_a_subclass_with_a_dict_frees_its_block_when_dropped(device: pykka.ActorRef[Any]) -> None:
    # A subclass that adds to the handle's layout keeps CPython's generic drop, which ends in the
    # core's: its free is handed over all the same.
    from xlog_actors._core.handles import make_handle

    class Annotated(xa.GpuRef):
        pass  # no __slots__: instances have a __dict__

    ref = device.ask(xa.Allocate(4096))
    block, context = ref.block, ref.context
    ref._mark_released()  # the block changes hands: the subclass's handle frees it
    del ref
    sub = make_handle(Annotated, block, context)
    assert type(sub) is Annotated and sub.access() is block
    assert device.ask(xa.GetStats()).live_blocks == 1
    del sub
    stats = device.ask(xa.GetStats())
    assert stats.live_blocks == 0 and stats.bytes_outstanding == 0


class _SlotLifecycle:
    __slots__ = ("_context",)

    def __init__(self) -> None:
        self._context = None

    @property
    def context(self) -> None:
        raise AssertionError("the client reads the slot, not the property")


class _PropertyLifecycle:
    def __init__(self) -> None:
        self.reads = 0

    @property
    def context(self) -> None:
        self.reads += 1
        return None


@pytest.mark.parametrize("lifecycle_type", [_SlotLifecycle, _PropertyLifecycle])
def test_the_client_reads_the_running_context_of_either_lifecycle_shape(lifecycle_type: type) -> None:
    from xlog_actors._core.client_core import ClientCore

    class Client(ClientCore):
        def _allocate_slow(self, nbytes: int, stream: Any, tag: Any) -> str:
            return "slow"

    lifecycle = lifecycle_type()
    cell = type("Cell", (), {"lifecycle": lifecycle})()
    assert Client(cell, xa.GpuRef).allocate(64) == "slow", "no running context: the slow path"
    if isinstance(lifecycle, _PropertyLifecycle):
        assert lifecycle.reads == 1
