"""The block cache (``async+cache``): reuse on its stream with no driver call, across streams only
once its fence completes, trims, drops, what a budget counts, its figures, its history, and bad
input refused with nothing changed. The hazard tests fail if a kept block is handed out before
the work of its last use is done."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xlog_actors as xa
from xlog_actors._core import alloc_bridge
from xlog_actors._core.ptr_table import fail_a_grow
from xlog_actors.memory.adaptors import MAX_CACHED, BlockCacheResource, size_class
from xlog_actors.memory.block import Access, BlockId, StreamId
from xlog_actors.memory.history import MemoryHistory
from xlog_actors.memory.report import memory_report
from xlog_actors.memory.stack import build_resource, check_description

KiB, MiB = 1 << 10, 1 << 20


class Counting:
    """Counts the host driver's stream-ordered allocations and frees (the calls the compiled core
    makes through the driver's Python methods)."""

    def __init__(self, driver: xa.HostDriver) -> None:
        self.allocs = self.frees = 0
        alloc, free = driver.alloc_async, driver.free_async

        def counted_alloc(*args: Any) -> Any:
            self.allocs += 1
            return alloc(*args)

        def counted_free(*args: Any) -> Any:
            self.frees += 1
            return free(*args)

        driver.alloc_async = counted_alloc  # type: ignore[method-assign]
        driver.free_async = counted_free  # type: ignore[method-assign]


@pytest.fixture
def pool(host_driver: xa.HostDriver) -> Iterator[xa.StreamPool]:
    p = xa.StreamPool(host_driver, 0)
    yield p
    p.close()


@pytest.fixture
def cache(host_driver: xa.HostDriver, pool: xa.StreamPool) -> BlockCacheResource:
    res = build_resource("async+cache", host_driver, 0, pool)
    assert isinstance(res, BlockCacheResource)
    return res


def stream(pool: xa.StreamPool, sid: StreamId) -> Any:
    s = pool.resolve(sid)
    assert s is not None
    return s


def state(res: BlockCacheResource) -> tuple[Any, ...]:
    return (res.bytes_outstanding(), res.figures(), sorted(res.kept_blocks()), len(res.live_blocks()))


# -- sizes ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.integers(1, MAX_CACHED))
def test_size_classes_are_the_allocator_bridges(n: int) -> None:
    assert size_class(n) == alloc_bridge.size_class(n)
    assert n <= size_class(n) <= max(n + 511, n + n // 4)


def test_sizes_above_the_largest_class_pass_through() -> None:
    assert size_class(MAX_CACHED + 1) == MAX_CACHED + 1


# -- reuse ------------------------------------------------------------------------------------
def test_same_stream_reuse_makes_no_driver_call(host_driver: xa.HostDriver, cache: BlockCacheResource) -> None:
    first = cache.allocate(4000)
    cache.deallocate(first)
    calls = Counting(host_driver)
    for size in (4000, 3585, 4096):  # one class
        block = cache.allocate(size, tag=xa.AllocTag("w"))
        assert block.ptr == first.ptr and block.nbytes == size and block.generation > first.generation
        assert cache.bytes_outstanding() == size
        cache.deallocate(block)
    assert (calls.allocs, calls.frees) == (0, 0)
    f = cache.figures()
    assert (f.hits, f.misses, f.cached_blocks, f.cached_bytes) == (3, 1, 1, 4096)
    assert f.hit_rate == 0.75
    assert cache.bytes_outstanding() == 0


def test_device_client_pair_of_a_cached_size_stays_in_the_cache(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver, resource="async+cache")
    try:
        client = device.ask(xa.GetClient())
        client.free(client.allocate(4 * KiB))
        calls = Counting(host_driver)
        for _ in range(50):
            client.free(client.allocate(4 * KiB))
        assert (calls.allocs, calls.frees) == (0, 0)
        stats = device.ask(xa.GetStats())
        assert stats.bytes_outstanding == 0 and stats.report["block_cache"]["hits"] == 50
    finally:
        device.stop()


def test_cross_stream_reuse_waits_for_the_fence(host_driver: xa.HostDriver, cache: BlockCacheResource,
                                               pool: xa.StreamPool) -> None:
    s1, s2 = pool.acquire(), pool.acquire()
    block = cache.allocate(64 * KiB, s1)
    host_driver.sleep(stream(pool, s1), 50_000)  # the last use, still running
    cache.deallocate(block)
    other = cache.allocate(64 * KiB, s2)
    assert other.ptr != block.ptr  # the fence (recorded now, behind the sleep) is not complete
    assert cache.figures().fences == 1
    stream(pool, s1).synchronize()
    again = cache.allocate(64 * KiB, s2)
    assert again.ptr == block.ptr and again.alloc_stream == s2
    f = cache.figures()
    assert (f.hits, f.cross_stream_hits) == (1, 1)
    assert [b.stream for b in cache.live_blocks() if b.ptr == again.ptr] == [s2]
    for b in (other, again):
        cache.deallocate(b)
    assert {sid for _ptr, _cls, sid in cache.kept_blocks()} == {s2}


def _hazard_setup(host_driver: xa.HostDriver, cache: BlockCacheResource, pool: xa.StreamPool) -> tuple[Any, ...]:
    s1, s2 = pool.acquire(), pool.acquire()
    block = cache.allocate(64 * KiB, s1)
    host_driver.sleep(stream(pool, s1), 30_000)
    host_driver.fill(block.ptr, 0xAA, block.nbytes, stream(pool, s1))  # the last use: late
    cache.deallocate(block)
    return s1, s2, block


def test_hazard_a_block_is_not_reused_on_another_stream_under_its_last_use(
    host_driver: xa.HostDriver, cache: BlockCacheResource, pool: xa.StreamPool
) -> None:
    """Fails when a kept block goes to another stream without its fence (the late fill on the
    first stream would land on the new user's bytes)."""
    s1, s2, _block = _hazard_setup(host_driver, cache, pool)
    for _ in range(3):  # also after the fence was recorded and queried
        new = cache.allocate(64 * KiB, s2)
        host_driver.fill(new.ptr, 0x55, new.nbytes, stream(pool, s2))
        stream(pool, s2).synchronize()
        stream(pool, s1).synchronize()
        got = host_driver.copy_to_host(new.ptr, new.nbytes, stream(pool, s2))
        stream(pool, s2).synchronize()
        assert bytes(got) == b"\x55" * new.nbytes, "a late use on another stream overwrote a reused block"
        cache.deallocate(new)


def test_hazard_a_free_orders_the_stream_after_uses_elsewhere(
    host_driver: xa.HostDriver, cache: BlockCacheResource, pool: xa.StreamPool
) -> None:
    """A block written (tracked) on a second stream, freed, and reused at once on its own stream:
    the reuse must come after the other stream's write."""
    s1, s2 = pool.acquire(), pool.acquire()
    block = cache.allocate(64 * KiB, s1)
    bid = BlockId.from_block(block)
    cache.prepare_block_use(bid, s2, Access.WRITE)
    host_driver.sleep(stream(pool, s2), 30_000)
    host_driver.fill(block.ptr, 0xAA, block.nbytes, stream(pool, s2))
    cache.finish_block_use(bid, s2, Access.WRITE)
    cache.deallocate(block)
    new = cache.allocate(64 * KiB, s1)
    assert new.ptr == block.ptr
    assert cache.upstream.pending_use_event_count(new.ptr) == 0  # its tracking starts afresh
    host_driver.fill(new.ptr, 0x55, new.nbytes, stream(pool, s1))
    stream(pool, s1).synchronize()
    stream(pool, s2).synchronize()
    got = host_driver.copy_to_host(new.ptr, new.nbytes, stream(pool, s1))
    stream(pool, s1).synchronize()
    assert bytes(got) == b"\x55" * new.nbytes


def test_a_block_let_go_is_handed_out_again_and_one_still_held_never_changes(cache: BlockCacheResource) -> None:
    """A hit rewrites the block it handed out last only when nobody else holds it: a block kept
    by its user stays as it was (and stale), the next user gets a block of its own."""
    held = cache.allocate(4000)
    before = (held.ptr, held.nbytes, held.generation, held.tag, held.alloc_stream)
    stale_id = BlockId.from_block(held)
    cache.deallocate(held)
    again = cache.allocate(3700, tag=xa.AllocTag("w"))  # the same class, so the same memory
    assert again is not held and again.ptr == held.ptr
    assert (held.ptr, held.nbytes, held.generation, held.tag, held.alloc_stream) == before
    assert again.nbytes == 3700 and again.tag == "w" and again.generation > held.generation
    with pytest.raises(xa.UseAfterFree):
        cache.deallocate(held)
    with pytest.raises(xa.UseAfterFree):
        cache.prepare_block_use(stale_id, StreamId.DEFAULT, Access.READ)
    cache.deallocate(again)
    address, generation, last = again.ptr, again.generation, id(again)
    del again  # nobody holds it now: the next hit hands the same object out, rewritten
    third = cache.allocate(4096)
    assert id(third) == last and third.ptr == address and third.nbytes == 4096
    assert third.generation > generation and third.tag == xa.AllocTag.UNTAGGED
    assert cache.held_size(third.ptr) == 4096 and [b.nbytes for b in cache.live_blocks()] == [4096]
    cache.prepare_block_use(BlockId.from_block(third), StreamId.DEFAULT, Access.WRITE)
    cache.deallocate(third)
    assert cache.held_size(address) is None and cache.bytes_outstanding() == 0


def test_a_hit_renews_a_let_go_generation_in_place_and_the_old_number_stays_refused(
        cache: BlockCacheResource) -> None:
    """A block let go with its generation: the hit writes the next number into that generation
    object itself (see cache_core's ``_alloc_c``); the old number is refused like any stale one.
    A generation someone still holds is never rewritten."""
    from xlog_actors._core import blocks

    assert blocks._GENERATION_IN_PLACE, "the in-place rewrite disagreed with the type call on this Python"
    first = cache.allocate(4096)
    cache.deallocate(first)
    address, old, gen_id = first.ptr, int(first.generation), id(first.generation)
    del first
    second = cache.allocate(4096)
    assert second.ptr == address and id(second.generation) == gen_id  # the same object, renewed
    assert type(second.generation) is xa.Generation and int(second.generation) > old
    assert hash(second.generation) == hash(int(second.generation))
    stale = BlockId(address, xa.Generation(old), second.device_ordinal)
    with pytest.raises(xa.UseAfterFree):
        cache.prepare_block_use(stale, StreamId.DEFAULT, Access.READ)
    with pytest.raises(xa.UseAfterFree):
        cache.deallocate(stale)
    cache.prepare_block_use(BlockId.from_block(second), StreamId.DEFAULT, Access.WRITE)
    cache.finish_block_use(BlockId.from_block(second), StreamId.DEFAULT, Access.WRITE)
    kept_generation = second.generation  # held: the next hit must not touch it
    number = int(kept_generation)
    cache.deallocate(second)
    del second
    third = cache.allocate(4096)
    assert third.ptr == address and third.generation is not kept_generation
    assert int(kept_generation) == number and third.generation > kept_generation
    with pytest.raises(xa.UseAfterFree):
        cache.deallocate(BlockId(address, kept_generation, third.device_ordinal))
    cache.deallocate(third)
    with pytest.raises(xa.UseAfterFree):
        cache.deallocate(third)
    assert cache.bytes_outstanding() == 0


def test_a_renewal_in_place_and_generation_next_count_with_one_number(cache: BlockCacheResource) -> None:
    """The hit's renewal is inlined into the cache (blocks.pxd's ``renew_generation``) and counts
    through the struct ``generation_source()`` gives: the number written in place comes after
    every generation made before it, and the next one made comes after it."""
    first = cache.allocate(4096)
    cache.deallocate(first)
    gen_id = id(first.generation)
    del first
    before = xa.Generation.next()
    second = cache.allocate(4096)
    assert id(second.generation) == gen_id  # renewed in place
    after = xa.Generation.next()
    assert before < second.generation < after
    assert int(second.generation) == before + 1 and int(after) == int(second.generation) + 1
    cache.deallocate(second)


def test_sizes_of_any_int_type_and_the_largest_pass_the_hit_path(cache: BlockCacheResource) -> None:
    class Size(int):
        pass

    block = cache.allocate(Size(1000))
    assert type(block.nbytes) is int and block.nbytes == 1000
    cache.deallocate(block)
    assert cache.allocate(1024).ptr == block.ptr  # one class
    huge = MAX_CACHED + 1  # past the largest class: passes through, and the device refuses it
    with pytest.raises(xa.OutOfMemory):
        cache.allocate(huge)
    with pytest.raises(xa.OutOfMemory):
        cache.allocate(1 << 80)


def test_sizes_on_either_side_of_one_int_digit_share_their_class() -> None:
    # A size that fits one of the int's digits is read in place, a larger one converted: both
    # give the size's class, and a block of one is a hit for the other.
    driver = xa.HostDriver(memory_per_device=4 << 30)
    pool = xa.StreamPool(driver, 0)
    cache = build_resource("async+cache", driver, 0, pool)
    assert isinstance(cache, BlockCacheResource)
    for small, large in (((1 << 30) - 1, 1 << 30), ((1 << 30) - 512, (1 << 30) - 1)):
        assert size_class(small) == size_class(large)
        block = cache.allocate(small)
        assert block.nbytes == small
        cache.deallocate(block)
        again = cache.allocate(large)
        assert again.ptr == block.ptr and again.nbytes == large
        cache.deallocate(again)
        assert cache.allocate(small).ptr == block.ptr
    assert cache.figures().hits == 4
    pool.close()
    driver.close()


def test_many_threads_on_one_client_lose_no_block(host_driver: xa.HostDriver, run_threads: Any) -> None:
    """8 threads allocating and freeing the same size through one client: every pair after the
    first few is a hit, and when they are done every block is kept and none is the user's."""
    device = xa.DeviceActor.start(0, driver=host_driver, resource="async+cache")
    try:
        client = device.ask(xa.GetClient())
        pairs = 2000

        def work() -> None:
            for i in range(pairs):
                ref = client.allocate(4 * KiB, tag=xa.AllocTag("t"))
                if i % 7 == 0:
                    held = ref  # a handle kept a while: the next hits must not change it
                    client.free(client.allocate(4 * KiB))
                    assert held.block.nbytes == 4 * KiB and held.block.tag == "t"
                client.free(ref)

        assert run_threads(work, 8, 60.0) == []
        stats = device.ask(xa.GetStats())
        cache_figures = stats.report["block_cache"]
        assert stats.bytes_outstanding == 0
        assert cache_figures["hits"] + cache_figures["misses"] == 8 * (pairs + (pairs + 6) // 7)
        assert cache_figures["cached_blocks"] == cache_figures["misses"] <= 16
    finally:
        device.stop()


def test_a_slot_table_that_cannot_grow_refuses_the_miss_and_changes_nothing(
    host_driver: xa.HostDriver, cache: BlockCacheResource, run_threads: Any
) -> None:
    """The cache's own address table failing to grow (the upstream's grew): that allocation is
    refused, its block given back upstream, the figures as they were, the lock free."""
    held = [cache.allocate(KiB * (1 + i % 4)) for i in range(32)]  # both tables full to their first growth
    before = (cache.figures(), len(cache.live_blocks()))
    fail_a_grow(1)  # the upstream's grow passes, the cache's fails
    try:
        with pytest.raises(MemoryError):
            cache.allocate(64 * KiB)
    finally:
        fail_a_grow(-1)
    assert (cache.figures(), len(cache.live_blocks())) == (replace(before[0], misses=before[0].misses + 1), before[1])
    cache.reap_pending()
    assert cache.bytes_outstanding() == sum(b.nbytes for b in held)
    assert run_threads(lambda: cache.deallocate(cache.allocate(64 * KiB)), 1, 10.0) == []
    for b in held:
        cache.deallocate(b)
    assert cache.bytes_outstanding() == 0


# -- trims ------------------------------------------------------------------------------------
def test_a_refused_allocation_trims_and_retries_once(host_driver: xa.HostDriver, cache: BlockCacheResource) -> None:
    history = MemoryHistory()
    cache.set_history(history)
    big = cache.allocate(40 * MiB)
    cache.deallocate(big)
    assert cache.cached_bytes() == 40 * MiB
    other = cache.allocate(48 * MiB)  # fits only once the kept 40 MiB went back
    f = cache.figures()
    assert (f.trims, f.trimmed_blocks, f.trimmed_bytes, f.cached_bytes) == (1, 1, 40 * MiB, 0)
    assert [e["action"] for e in history.events()] == ["alloc", "free", "trim", "alloc"]
    cache.deallocate(other)
    with pytest.raises(xa.OutOfMemory) as caught:
        cache.allocate(64 * MiB + 1)  # trimmed again, still too large: the size asked is reported
    assert caught.value.requested == 64 * MiB + 1
    assert cache.bytes_outstanding() >= 0 and cache.cached_bytes() == 0


def test_trim_release_and_drop(host_driver: xa.HostDriver, cache: BlockCacheResource, pool: xa.StreamPool) -> None:
    blocks = [cache.allocate(n, sid) for n in (KiB, 8 * KiB, 8 * KiB) for sid in (StreamId.DEFAULT, pool.acquire())]
    for b in blocks:
        cache.deallocate(b)
    assert cache.trim() == 2 * (KiB + 16 * KiB) and cache.cached_bytes() == 0
    cache.reap_pending()
    assert cache.upstream.bytes_outstanding() == 0
    cache.deallocate(cache.allocate(KiB))
    assert cache.drop() == KiB and cache.upstream.live_bytes() == 0 and cache.figures().dropped_bytes == KiB
    cache.deallocate(cache.allocate(KiB))
    assert cache.release() == KiB and not cache.enabled
    calls = Counting(host_driver)
    cache.deallocate(cache.allocate(KiB))  # released: straight through
    assert (calls.allocs, calls.frees, cache.cached_bytes()) == (1, 1, 0)


def test_a_limit_bounds_what_is_kept(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = build_resource("async+cache:64KiB", host_driver, 0, pool)
    assert res.describe() == "async+cache:64KiB" and res.limit == 64 * KiB
    blocks = [res.allocate(32 * KiB) for _ in range(3)]
    for b in blocks:
        res.deallocate(b)
    assert res.cached_bytes() == 64 * KiB
    res.reap_pending()
    assert res.upstream.bytes_outstanding() == 64 * KiB


def test_a_rebuild_leaves_nothing_kept(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver, resource="async+cache+stats")
    try:
        client = device.ask(xa.GetClient())
        client.free(client.allocate(MiB))
        assert device.ask(xa.GetStats()).report["block_cache"]["cached_bytes"] == MiB
        device.ask(xa.Rebuild("test"))
        stats = device.ask(xa.GetStats())
        assert stats.report["block_cache"]["cached_bytes"] == 0 and stats.bytes_outstanding == 0
        client.free(client.allocate(MiB))
    finally:
        device.stop()


def test_an_orderly_stop_gives_kept_blocks_back(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver, resource="async+cache")
    client = device.ask(xa.GetClient())
    client.free(client.allocate(MiB))
    free_before = host_driver.mem_info(0)[0]
    device.stop()
    assert host_driver.mem_info(0)[0] >= free_before + MiB


# -- what a budget counts, the report, the history ---------------------------------------------
def test_a_budget_above_the_cache_counts_what_the_user_holds(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = build_resource("async+cache+budget:64KiB", host_driver, 0, pool)
    held = res.allocate(40 * KiB)
    kept = res.allocate(20 * KiB)
    res.deallocate(kept)
    assert res.bytes_outstanding() == 40 * KiB and res.cached_bytes() == 20 * KiB
    more = res.allocate(24 * KiB)  # 64 KiB held, with 20 KiB more kept idle
    with pytest.raises(xa.BudgetExceeded):
        res.allocate(KiB)
    for b in (held, more):
        res.deallocate(b)


def test_report_and_history(host_driver: xa.HostDriver, pool: xa.StreamPool) -> None:
    res = build_resource("async+cache+stats", host_driver, 0, pool)
    history = MemoryHistory()
    runtime = xa.XlogDeviceRuntime.with_resource(host_driver, 0, pool, res)
    runtime.set_history(history)
    assert runtime.history is history and runtime.block_cache() is res.upstream
    a = res.allocate(3000, tag=xa.AllocTag("w"))
    res.deallocate(a)
    b = res.allocate(2600, tag=xa.AllocTag("x"))
    assert [e["action"] for e in history.events()] == ["alloc", "free", "cache_hit"]
    assert history.live_blocks == 1
    snap = history.snapshot()
    assert [e["action"] for e in snap["device_traces"][0]][-1] == "alloc"
    assert snap["device_traces"][0][-1]["cache_hit"] is True
    report = memory_report(res)
    assert report.block_cache is not None and report.block_cache.hits == 1
    assert report.bytes_outstanding == 2600 and report.blocks is not None
    assert [(blk.nbytes, str(blk.tag)) for blk in report.blocks] == [(2600, "x")]
    assert "block cache: 0 blocks" in report.format() and "hit rate 50.0%" in report.format()
    assert report.as_dict()["block_cache"]["hit_rate"] == 0.5
    res.deallocate(b)
    runtime.trim_caches()
    assert [e["action"] for e in history.events()][-2:] == ["free", "trim"]
    assert any(e["action"] == "segment_free" for e in history.snapshot()["device_traces"][0])
    runtime.set_history(None)


# -- bad input: typed errors, nothing changed ---------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, "64", 4096.0])
def test_bad_sizes_change_nothing(cache: BlockCacheResource, bad: Any) -> None:
    cache.deallocate(cache.allocate(KiB))
    before = state(cache)
    with pytest.raises(xa.InvalidRequest):
        cache.allocate(bad)
    assert state(cache) == before


def test_bad_streams_and_blocks_change_nothing(host_driver: xa.HostDriver, cache: BlockCacheResource,
                                               pool: xa.StreamPool) -> None:
    live = cache.allocate(KiB)
    kept = cache.allocate(KiB)
    cache.deallocate(kept)
    before = state(cache)
    with pytest.raises(xa.StreamMisuse):
        cache.allocate(KiB, StreamId(999))
    with pytest.raises(xa.UseAfterFree):
        cache.deallocate(kept)  # freed already: its memory is kept, not the user's
    with pytest.raises(xa.UseAfterFree):
        cache.prepare_block_use(BlockId.from_block(kept), StreamId.DEFAULT, Access.READ)
    pool1 = xa.StreamPool(host_driver, 1)
    try:
        foreign = build_resource("async", host_driver, 1, pool1).allocate(KiB)
        with pytest.raises(xa.InvalidRequest):
            cache.deallocate(foreign)
    finally:
        pool1.close()
    assert state(cache) == before
    cache.deallocate(live)


def test_a_closed_or_grown_pool_is_seen_at_once_by_the_hit_and_the_free(
        host_driver: xa.HostDriver, cache: BlockCacheResource, pool: xa.StreamPool) -> None:
    """A stream's lists remember the stream found in the pool's dict while the pool's version is
    unchanged (cache_core's ``_remember``; a close changes it): a stream acquired after, and a
    pool closed after, are seen by the very next call, with the same id passed each time."""
    cache.deallocate(cache.allocate(KiB))
    cache.deallocate(cache.allocate(KiB))  # a hit: the default stream is remembered now
    sid = pool.acquire()  # a new stream: its lists look it up on their first use
    on_new = cache.allocate(KiB, sid)
    cache.deallocate(on_new)
    assert cache.allocate(KiB, sid).alloc_stream == sid
    held = cache.allocate(KiB)
    pool.close()
    with pytest.raises(xa.StreamMisuse):
        cache.allocate(KiB)
    with pytest.raises(xa.StreamMisuse):
        cache.allocate(KiB, sid)
    with pytest.raises(xa.StreamMisuse):
        cache.deallocate(held)  # its stream is gone: refused, the block stays live
    assert cache.held_size(held.ptr) == KiB


def test_each_streams_lists_remember_their_stream_until_the_pool_changes(
        cache: BlockCacheResource, pool: xa.StreamPool) -> None:
    """Hits and frees alternating between two streams each find their stream remembered in its
    lists (``_remember``); a stream acquired meanwhile leaves them as they are; a pool closed
    after is seen by the next free and hit of either stream, whose blocks stay live."""
    s1 = pool.acquire()
    for _ in range(3):
        a, b = cache.allocate(KiB), cache.allocate(KiB, s1)
        cache.deallocate(a)
        cache.deallocate(b)
    a, b = cache.allocate(KiB), cache.allocate(KiB, s1)
    assert cache.cache_statistics()["hits"] == 6 and cache.cache_statistics()["cross_stream_hits"] == 0
    pool.acquire()  # another stream while both blocks are out: theirs stay remembered
    cache.deallocate(b)
    cache.deallocate(a)
    a, b = cache.allocate(KiB), cache.allocate(KiB, s1)
    assert (a.alloc_stream, b.alloc_stream) == (StreamId.DEFAULT, s1)
    cache.deallocate(cache.allocate(KiB, s1))  # a block kept on s1: a hit waits there
    pool.close()
    with pytest.raises(xa.StreamMisuse):
        cache.allocate(KiB, s1)  # the hit itself sees the pool closed (not the upstream's miss)
    with pytest.raises(xa.StreamMisuse):
        cache.deallocate(a)
    with pytest.raises(xa.StreamMisuse):
        cache.deallocate(b)
    assert cache.held_size(a.ptr) == KiB and cache.held_size(b.ptr) == KiB
    assert len(cache.kept_blocks()) == 1


def test_the_pools_version_changes_when_a_stream_leaves_the_pool_only(pool: xa.StreamPool) -> None:
    """What the cache's remembered streams rely on (``StreamsVersion``): acquiring a stream keeps
    the version, closing the pool changes it (to a value it never had), and it is never 0."""
    version = pool.streams_version
    first = version.value
    pool.acquire()
    assert version.value == first != 0
    pool.close()
    assert version.value not in (0, first)
    assert pool.streams_version is version


@pytest.mark.parametrize("description", ["direct+cache", "async+stats+cache", "async+cache+cache", "async+cache:0",
                                         "async+cache:lots", "async+cache:-1"])
def test_bad_descriptions_are_refused_before_anything_is_built(description: str) -> None:
    with pytest.raises(xa.InvalidRequest):
        check_description(description)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "1"])
def test_bad_limits_and_upstreams(host_driver: xa.HostDriver, pool: xa.StreamPool, limit: Any) -> None:
    with pytest.raises(xa.InvalidRequest):
        BlockCacheResource(xa.AsyncCudaResource(host_driver, 0, pool), limit)
    with pytest.raises(xa.InvalidRequest):
        BlockCacheResource(xa.DirectCudaResource(host_driver, 0))
    with pytest.raises(xa.InvalidRequest):
        BlockCacheResource("not a resource")  # type: ignore[arg-type]  # bad on purpose


# -- the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_same_stream_reuse_on_the_gpu() -> None:
    driver = xa.CudaDriver()
    pool = xa.StreamPool(driver, 0)
    try:
        res = build_resource("async+cache", driver, 0, pool)
        block = res.allocate(4 * KiB)
        res.deallocate(block)
        again = res.allocate(4 * KiB)
        assert again.ptr == block.ptr
        res.deallocate(again)
        assert res.trim() == 4 * KiB
        res.reap_pending()
    finally:
        pool.close()
        driver.close()
