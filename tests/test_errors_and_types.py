"""The value types, the error hierarchy, and every bad input the errors are raised for.

Every bad input must raise its typed error *and* leave the resource and the driver exactly as they
were: each test snapshots bytes_outstanding, the resource's own counters, mem_info and the driver's
live allocations before the bad call and compares after it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors import (
    Access,
    AllocTag,
    BlockId,
    BlockState,
    DeviceBlock,
    Generation,
    StreamId,
    StreamPool,
)
from xlog_actors.errors import (
    STALE_REASONS,
    BudgetExceeded,
    ContextPoisoned,
    CorruptionDetected,
    DeviceUnavailable,
    DriverError,
    GpuRefStale,
    InvalidRequest,
    OutOfMemory,
    ResourceError,
    StreamMisuse,
    UseAfterFree,
    XlogError,
)
from xlog_actors.memory.block import make_block
from xlog_actors.memory.stack import build_resource

BAD_SIZES = [0, -1, 1.5, True, False, None, "4", 4.0]
STACKS = ["async", "direct"]


# -- value types ---------------------------------------------------------------------------------
def test_stream_id() -> None:
    assert issubclass(StreamId, int)
    assert StreamId.DEFAULT == StreamId(0) == 0
    assert type(StreamId.DEFAULT) is StreamId
    assert hash(StreamId(3)) == hash(3)


def test_alloc_tag() -> None:
    assert issubclass(AllocTag, str)
    assert AllocTag.UNTAGGED == AllocTag("untagged") == "untagged"
    assert type(AllocTag.UNTAGGED) is AllocTag


def test_access_reads_and_writes() -> None:
    assert {a.name for a in Access} == {"READ", "WRITE", "READ_WRITE"}
    assert (Access.READ.reads, Access.READ.writes) == (True, False)
    assert (Access.WRITE.reads, Access.WRITE.writes) == (False, True)
    assert (Access.READ_WRITE.reads, Access.READ_WRITE.writes) == (True, True)


def test_block_state_members() -> None:
    assert {s.name for s in BlockState} == {"LIVE", "RETIRED", "FREED"}


def test_generation_is_strictly_increasing_across_threads() -> None:
    per_thread: list[list[int]] = [[] for _ in range(8)]
    barrier = threading.Barrier(8)

    def draw(out: list[int]) -> None:
        barrier.wait()
        for _ in range(2000):
            out.append(Generation.next())

    threads = [threading.Thread(target=draw, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [g for out in per_thread for g in out]
    assert all(type(g) is Generation for g in everything)
    assert len(set(everything)) == len(everything), "two threads drew the same generation"
    for out in per_thread:
        assert out == sorted(out) and len(set(out)) == len(out), (
            "not strictly increasing in a thread"
        )
    assert Generation.next() > max(everything)


def test_generations_are_made_by_the_cheap_copy_and_behave_as_ints() -> None:
    # The compiled core builds a Generation by copying an int's body into the subclass (see
    # blocks.pyx); it checks itself against the type call on import and would fall back.
    from xlog_actors._core import blocks

    assert blocks._GENERATION_BY_COPY, "the copy disagreed with the type call on this Python"
    g = Generation.next()
    assert type(g) is Generation and repr(g) == f"Generation({int(g)})"
    assert Generation.next() > g and hash(g) == hash(int(g)) and {g: 1}[int(g)] == 1


def _block(**over: Any) -> DeviceBlock:
    fields: dict[str, Any] = {
        "ptr": 0x1000,
        "device_ordinal": 0,
        "alloc_stream": StreamId.DEFAULT,
        "nbytes": 64,
        "align": 256,
        "tag": AllocTag.UNTAGGED,
        "generation": Generation.next(),
        "state": BlockState.LIVE,
    }
    fields.update(over)
    return DeviceBlock(**fields)


def test_device_block_is_a_frozen_slotted_dataclass() -> None:
    names = [f.name for f in dataclasses.fields(DeviceBlock)]
    assert names == [
        "ptr",
        "device_ordinal",
        "alloc_stream",
        "nbytes",
        "align",
        "tag",
        "generation",
        "state",
    ]
    block = _block()
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.ptr = 0x2000  # type: ignore[misc]
    assert not hasattr(block, "__dict__")
    assert hasattr(DeviceBlock, "__slots__")
    assert block == dataclasses.replace(block)
    assert hash(block) == hash(dataclasses.replace(block))


def test_make_block_equals_the_dataclass_constructor() -> None:
    gen = Generation.next()
    a = make_block(0x100, 1, StreamId(2), 10, 256, AllocTag("t"), gen)
    b = DeviceBlock(0x100, 1, StreamId(2), 10, 256, AllocTag("t"), gen, BlockState.LIVE)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.nbytes = 11  # type: ignore[misc]


def test_block_id_from_block() -> None:
    block = _block(ptr=0x4000, device_ordinal=1)
    bid = BlockId.from_block(block)
    assert (bid.ptr, bid.generation, bid.device_ordinal) == (0x4000, block.generation, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bid.ptr = 1  # type: ignore[misc]


# -- the error hierarchy -----------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, bases",
    [
        (ResourceError, (XlogError,)),
        (InvalidRequest, (ResourceError, ValueError)),
        (OutOfMemory, (ResourceError, MemoryError)),
        (BudgetExceeded, (OutOfMemory,)),
        (UseAfterFree, (ResourceError,)),
        (StreamMisuse, (ResourceError,)),
        (DriverError, (ResourceError,)),
        (ContextPoisoned, (XlogError,)),
        (GpuRefStale, (XlogError,)),
        (DeviceUnavailable, (XlogError,)),
        (CorruptionDetected, (ResourceError,)),
    ],
)
def test_error_hierarchy(cls: type, bases: tuple[type, ...]) -> None:
    for base in bases:
        assert issubclass(cls, base), f"{cls.__name__} must subclass {base.__name__}"
    assert getattr(xa, cls.__name__) is cls, "every error is exported from xlog_actors"


def test_error_attributes() -> None:
    assert OutOfMemory("x", requested=12).requested == 12
    budget = BudgetExceeded("x", requested=5, limit=4, outstanding=1)
    assert (budget.requested, budget.limit, budget.outstanding) == (5, 4, 1)
    assert UseAfterFree("x", generation=7).generation == 7
    assert DriverError("x").code is None
    assert DriverError("x", code="CUDA_ERROR_INVALID_VALUE").code == "CUDA_ERROR_INVALID_VALUE"
    assert (
        ContextPoisoned("x", code="CUDA_ERROR_ILLEGAL_ADDRESS").code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    )
    block = _block()
    assert CorruptionDetected("x", block=block).block is block
    assert set(STALE_REASONS) == {
        "device state dropped",
        "device shutting down",
        "context rebuilt",
        "context poisoned",
        "released",
    }
    for reason in STALE_REASONS:
        assert GpuRefStale(reason).reason == reason  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GpuRefStale("gone fishing")  # type: ignore[arg-type]


# -- bad inputs leave state unchanged ------------------------------------------------------------
class Setup:
    """Two devices, each with a stream pool and the resource stack under test, plus one live block
    on each so "unchanged" is checked against non-trivial state."""

    def __init__(self, driver: xa.HostDriver, description: str) -> None:
        self.driver = driver
        self.pools = [StreamPool(driver, o) for o in (0, 1)]
        self.res = [build_resource(description, driver, o, self.pools[o]) for o in (0, 1)]
        self.blocks = [r.allocate(1000, tag=AllocTag("keep")) for r in self.res]
        for r in self.res:
            r.reap_pending()

    def state(self) -> list[dict[str, Any]]:
        out = []
        for o, r in enumerate(self.res):
            r.reap_pending()  # quiesce: queued frees have run and are no longer counted
            s: dict[str, Any] = {
                "bytes_outstanding": r.bytes_outstanding(),
                "mem_info": self.driver.mem_info(o),
                "driver_live": self.driver.live_allocations(o),
            }
            for diag in (
                "live_bytes",
                "pending_free_bytes",
                "pending_per_stream_total",
                "events_created",
            ):
                if hasattr(r, diag):
                    s[diag] = getattr(r, diag)()
            if hasattr(r, "pending_use_event_count"):
                s["events_on_kept"] = r.pending_use_event_count(self.blocks[o].ptr)
            out.append(s)
        return out

    def close(self) -> None:
        for r, b in zip(self.res, self.blocks, strict=False):
            r.deallocate(b)
            r.reap_pending()
            assert r.bytes_outstanding() == 0
        for p in self.pools:
            p.close()


@pytest.fixture(params=STACKS)
def setup(request: pytest.FixtureRequest, host_driver: xa.HostDriver) -> Iterator[Setup]:
    s = Setup(host_driver, request.param)
    yield s
    s.close()


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
def test_bad_size_is_invalid_request_and_changes_nothing(setup: Setup, bad: object) -> None:
    before = setup.state()
    with pytest.raises(InvalidRequest):
        setup.res[0].allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # InvalidRequest is a ValueError, for callers that catch that
        setup.res[0].allocate(bad, StreamId.DEFAULT, AllocTag("bad"))  # type: ignore[arg-type]
    assert setup.state() == before


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
def test_bad_size_at_the_driver(host_driver: xa.HostDriver, bad: object) -> None:
    stream = host_driver.create_stream(0)
    before = (host_driver.mem_info(0), host_driver.live_allocations(0))
    with pytest.raises(InvalidRequest):
        host_driver.alloc(0, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        host_driver.alloc_async(bad, stream)  # type: ignore[arg-type]
    assert (host_driver.mem_info(0), host_driver.live_allocations(0)) == before


def test_out_of_memory_is_typed_and_the_resource_stays_usable(setup: Setup) -> None:
    before = setup.state()
    too_big = 2 * setup.driver.mem_info(0)[1]
    with pytest.raises(OutOfMemory) as info:
        setup.res[0].allocate(too_big)
    assert info.value.requested == too_big
    assert isinstance(info.value, MemoryError)
    assert setup.state() == before
    block = setup.res[0].allocate(4096)
    setup.res[0].deallocate(block)
    assert setup.state() == before


@pytest.mark.parametrize("ordinal", [2, 3, -1, 16, True, 1.0, "0"], ids=repr)
def test_ordinal_out_of_range(host_driver: xa.HostDriver, ordinal: object) -> None:
    before = [(host_driver.mem_info(o), host_driver.live_allocations(o)) for o in (0, 1)]
    for call in (
        lambda: host_driver.alloc(ordinal, 64),  # type: ignore[arg-type]
        lambda: host_driver.mem_info(ordinal),  # type: ignore[arg-type]
        lambda: host_driver.create_stream(ordinal),  # type: ignore[arg-type]
        lambda: StreamPool(host_driver, ordinal),  # type: ignore[arg-type]
        lambda: xa.DirectCudaResource(host_driver, ordinal).allocate(64),  # type: ignore[arg-type]
        lambda: xa.XlogDeviceRuntime.try_get(ordinal, host_driver),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidRequest):
            call()
    pool0 = StreamPool(host_driver, 0)
    with pytest.raises(InvalidRequest):
        xa.AsyncCudaResource(host_driver, ordinal, pool0)  # type: ignore[arg-type]
    pool0.close()
    assert [(host_driver.mem_info(o), host_driver.live_allocations(o)) for o in (0, 1)] == before


def test_block_of_another_device_is_invalid_request(setup: Setup) -> None:
    res0 = setup.res[0]
    foreign = setup.blocks[1]  # live on device 1
    before = setup.state()
    with pytest.raises(InvalidRequest):
        res0.deallocate(foreign)
    if res0.supports_block_use_tracking():
        for hook in (
            lambda: res0.prepare_block_use(
                BlockId.from_block(foreign), StreamId.DEFAULT, Access.READ
            ),
            lambda: res0.finish_block_use(
                BlockId.from_block(foreign), StreamId.DEFAULT, Access.WRITE
            ),
            lambda: res0.record_block_use(foreign, StreamId.DEFAULT),
        ):
            with pytest.raises(InvalidRequest):
                hook()
    assert setup.state() == before


def test_unknown_block_is_use_after_free_with_generation(setup: Setup) -> None:
    res = setup.res[0]
    bogus = _block(ptr=0xDEAD_BEEF_00, nbytes=16)
    before = setup.state()
    with pytest.raises(UseAfterFree) as info:
        res.deallocate(bogus)
    assert info.value.generation == bogus.generation
    if res.supports_block_use_tracking():
        for access in Access:
            with pytest.raises(UseAfterFree) as info:
                res.prepare_block_use(BlockId.from_block(bogus), StreamId.DEFAULT, access)
            assert info.value.generation == bogus.generation
            with pytest.raises(UseAfterFree):
                res.finish_block_use(BlockId.from_block(bogus), StreamId.DEFAULT, access)
        with pytest.raises(UseAfterFree):
            res.record_block_use(bogus, StreamId.DEFAULT)
    assert setup.state() == before


def test_stale_generation_is_use_after_free_and_the_live_block_survives(setup: Setup) -> None:
    res = setup.res[0]
    live = setup.blocks[0]
    stale = dataclasses.replace(live, generation=Generation.next())  # same address, other life
    before = setup.state()
    with pytest.raises(UseAfterFree) as info:
        res.deallocate(stale)
    assert info.value.generation == stale.generation
    if res.supports_block_use_tracking():
        with pytest.raises(UseAfterFree):
            res.prepare_block_use(BlockId.from_block(stale), StreamId.DEFAULT, Access.WRITE)
        with pytest.raises(UseAfterFree):
            res.finish_block_use(BlockId.from_block(stale), StreamId.DEFAULT, Access.WRITE)
        with pytest.raises(UseAfterFree):
            res.record_block_use(stale, StreamId.DEFAULT)
    assert setup.state() == before


def test_double_free_is_use_after_free(setup: Setup) -> None:
    res = setup.res[0]
    block = res.allocate(512)
    res.deallocate(block)
    before = setup.state()
    with pytest.raises(UseAfterFree) as info:
        res.deallocate(block)
    assert info.value.generation == block.generation
    assert setup.state() == before


def test_unknown_stream_is_stream_misuse(host_driver: xa.HostDriver) -> None:
    # Only a resource with a stream pool can know which streams exist: AsyncCudaResource.
    s = Setup(host_driver, "async")
    res = s.res[0]
    kept = BlockId.from_block(s.blocks[0])
    before = s.state()
    for sid in (StreamId(999), StreamId(1)):  # 1 is never acquired from this pool
        with pytest.raises(StreamMisuse):
            res.allocate(64, sid)
        for access in Access:
            with pytest.raises(StreamMisuse):
                res.prepare_block_use(kept, sid, access)
            with pytest.raises(StreamMisuse):
                res.finish_block_use(kept, sid, access)
        with pytest.raises(StreamMisuse):
            res.record_block_use(s.blocks[0], sid)
    assert s.state() == before
    s.close()


def test_tracking_hooks_on_direct_are_unsupported_and_the_block_stays_live(
    host_driver: xa.HostDriver,
) -> None:
    s = Setup(host_driver, "direct")
    res = s.res[0]
    block = s.blocks[0]
    assert not res.supports_block_use_tracking()
    before = s.state()
    for hook in (
        lambda: res.record_block_use(block, StreamId.DEFAULT),
        lambda: res.prepare_block_use(BlockId.from_block(block), StreamId.DEFAULT, Access.READ),
        lambda: res.finish_block_use(BlockId.from_block(block), StreamId.DEFAULT, Access.WRITE),
    ):
        with pytest.raises(StreamMisuse) as info:
            hook()
        assert "unsupported" in str(info.value)
    assert s.state() == before
    s.close()  # the block is still live: deallocate works


def test_bad_driver_arguments(host_driver: xa.HostDriver) -> None:
    drv = host_driver
    stream = drv.create_stream(0)
    ptr = drv.alloc(0, 256)
    before = (drv.mem_info(0), drv.live_allocations(0))
    with pytest.raises(DriverError) as info:
        drv.free(0, ptr + 256)
    assert info.value.code is not None
    with pytest.raises(DriverError):
        drv.free_async(ptr + 256, stream)
    with pytest.raises(InvalidRequest):
        drv.fill(ptr, 256, 16, stream)
    with pytest.raises(InvalidRequest):
        drv.copy_to_host(ptr, 0, stream)
    with pytest.raises(InvalidRequest):
        drv.inject_fault(0, "meteor")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        drv.inject_fault(0, "oom", after_calls=-1)
    assert (drv.mem_info(0), drv.live_allocations(0)) == before
    drv.free(0, ptr)
