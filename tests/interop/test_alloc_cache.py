"""The allocator bridge's cache, called as PyTorch calls it (by symbol, here through ctypes)
against a device on the host driver: a free keeps the block per (stream, size class), a later
allocation of that class on that stream takes it back without calling the allocator; other
streams, other sizes and older epochs never get it; a budget refusal of a miss gives the cache
back and tries once more; a rebuild drops it without freeing; flush, close and unregister empty
it, and the tag's bytes return to zero."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core import alloc_bridge
from xlog_actors.interop import DeviceAllocator, as_client

from .test_alloc_bridge import Bridge

MIB = 1 << 20
DEV = 1
S1, S2 = 0x1000, 0x2000  # two foreign streams: the host driver ignores them, the cache must not


class Spied:
    """A device (budget 8 MiB) whose registered ``DeviceAllocator`` records every call the bridge
    makes to it: a cache hit must make none."""

    def __init__(self, device: pykka.ActorRef[Any], allocator: DeviceAllocator) -> None:
        self.device = device
        self.allocator = allocator
        self.calls: list[tuple[str, int, int]] = []
        allocate, free = allocator.allocate, allocator.free

        def spy_allocate(nbytes: int, stream: int) -> int:
            self.calls.append(("allocate", nbytes, stream))
            return allocate(nbytes, stream)

        def spy_free(ptr: int, nbytes: int, stream: int) -> None:
            self.calls.append(("free", nbytes, stream))
            free(ptr, nbytes, stream)

        synchronize = allocator.synchronize

        def spy_synchronize() -> None:
            self.calls.append(("synchronize", 0, 0))
            synchronize()

        allocator.allocate = spy_allocate  # type: ignore[method-assign]
        allocator.free = spy_free  # type: ignore[method-assign]
        allocator.synchronize = spy_synchronize  # type: ignore[method-assign]

    def tag_bytes(self) -> int:
        return int(self.device.ask(xa.GetStats()).report["by_tag"].get("torch", {}).get("nbytes", 0))

    def take_calls(self) -> list[tuple[str, int, int]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def bridge() -> Bridge:
    return Bridge()


@pytest.fixture
def spied(host_driver: xa.HostDriver) -> Iterator[Spied]:
    device = xa.DeviceActor.start(DEV, host_driver, resource="async+budget:8MiB")
    allocator = DeviceAllocator(as_client(device), "torch")
    alloc_bridge.register(DEV, allocator)
    yield Spied(device, allocator)
    alloc_bridge.unregister(DEV)
    device.stop()


def test_size_classes_round_up_by_at_most_a_quarter() -> None:
    assert [alloc_bridge.size_class(n) for n in (1, 512, 513, 4096, 4097, 5121, 1 << 20, (1 << 20) + 1)] == [
        512, 512, 1024, 4096, 5120, 6144, 1 << 20, 1_310_720]
    for n in range(1, 70_000, 37):
        c = alloc_bridge.size_class(n)
        assert n <= c <= max(n + 511, n * 5 // 4) and c % 512 == 0
    with pytest.raises(ValueError, match="positive"):
        alloc_bridge.size_class(0)


def test_a_freed_block_is_handed_out_again_on_its_stream_without_calling_the_allocator(
    spied: Spied, bridge: Bridge
) -> None:
    a = bridge.alloc_or_null(100_000, DEV, S1)
    assert spied.take_calls() == [("allocate", 114_688, S1)]  # the class's size is asked
    bridge.free(a, 100_000, DEV, S1)
    assert spied.take_calls() == []  # kept
    assert alloc_bridge.cache_stats(DEV) | {"epoch": 0} == {
        "hits": 0, "misses": 1, "cached_bytes": 114_688, "cached_blocks": 1, "live_blocks": 0, "limit": None,
        "evicted_blocks": 0, "evicted_bytes": 0, "epoch": 0, "enabled": True}
    assert spied.tag_bytes() == 114_688  # cached bytes stay counted under the tag
    b = bridge.alloc_or_null(110_000, DEV, S1)  # another size of the same class
    assert b == a and spied.take_calls() == []
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["hits"], stats["misses"], stats["cached_blocks"], stats["live_blocks"]) == (1, 1, 0, 1)
    bridge.free(b, 110_000, DEV, S1)
    assert alloc_bridge.empty_cache(DEV) == 114_688
    assert spied.take_calls() == [("free", 114_688, S1)]
    assert spied.tag_bytes() == 0 and spied.allocator.live_blocks == 0


def test_a_cached_block_never_goes_to_another_stream_or_another_class(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, MIB, DEV, S1)
    spied.take_calls()
    b = bridge.alloc_or_null(MIB, DEV, S2)  # same class, other stream: a miss
    assert b != a and spied.take_calls() == [("allocate", MIB, S2)]
    c = bridge.alloc_or_null(MIB // 2, DEV, S1)  # same stream, other class: a miss
    assert c not in (a, b) and spied.take_calls() == [("allocate", MIB // 2, S1)]
    d = bridge.alloc_or_null(MIB, DEV, S1)
    assert d == a and spied.take_calls() == []
    for ptr, n, s in ((b, MIB, S2), (c, MIB // 2, S1), (d, MIB, S1)):
        bridge.free(ptr, n, DEV, s)
    spied.allocator.flush()
    assert spied.tag_bytes() == 0


def test_a_free_on_another_stream_than_the_allocation_s_goes_to_the_allocator(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    spied.take_calls()
    bridge.free(a, MIB, DEV, S2)  # ordered after S2 by the allocator, never cached
    assert spied.take_calls() == [("free", MIB, S2)]
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 0 and spied.tag_bytes() == 0


def test_a_free_with_the_wrong_size_is_refused_and_changes_nothing(
    spied: Spied, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, 12345, DEV, S1)
    assert isinstance(alloc_bridge.last_error(DEV), xa.InvalidRequest) and "12345 bytes" in caplog.text
    stats = alloc_bridge.cache_stats(DEV)
    assert stats["live_blocks"] == 1 and stats["cached_blocks"] == 0 and spied.tag_bytes() == MIB
    bridge.free(a, MIB, DEV, S1)  # the right size is then accepted, and cached
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 1


def test_a_budget_refusal_gives_the_cache_back_and_tries_once_more(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(4 * MIB, DEV, S1)
    bridge.free(a, 4 * MIB, DEV, S1)
    spied.take_calls()
    b = bridge.alloc_or_null(6 * MIB, DEV, S2)  # 4 cached + 6 > 8 MiB: refused, released, retried
    assert b, alloc_bridge.last_error(DEV)
    assert spied.take_calls() == [
        ("allocate", 6 * MIB, S2), ("free", 4 * MIB, S1), ("synchronize", 0, 0), ("allocate", 6 * MIB, S2)]
    assert alloc_bridge.last_error(DEV) is None
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 0 and spied.tag_bytes() == 6 * MIB
    # Still too much with the cache empty: refused once (nothing to give back), with the report.
    assert bridge.alloc_or_null(4 * MIB, DEV, S1) is None
    assert spied.take_calls() == [("allocate", 4 * MIB, S1)]
    error = alloc_bridge.last_error(DEV)
    assert isinstance(error, xa.BudgetExceeded) and "budget of 8.0 MiB" in str(error)
    bridge.free(b, 6 * MIB, DEV, S2)
    spied.allocator.flush()
    assert spied.tag_bytes() == 0


def test_a_rebuild_drops_the_cache_without_freeing_and_forgets_its_blocks(
    spied: Spied, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    cached = bridge.alloc_or_null(MIB, DEV, S1)
    held = bridge.alloc_or_null(2 * MIB, DEV, S1)  # live in the library across the rebuild
    bridge.free(cached, MIB, DEV, S1)
    epoch = alloc_bridge.cache_stats(DEV)["epoch"]
    spied.take_calls()
    with caplog.at_level(logging.WARNING, logger="xlog_actors.interop"):
        spied.device.ask(xa.Rebuild("test"))
        stats = alloc_bridge.cache_stats(DEV)
        assert stats["cached_blocks"] == 0 and stats["epoch"] == epoch + 1
        assert spied.take_calls() == []  # dropped, not freed through the new context
        assert spied.allocator.live_blocks == 1  # the cached block is forgotten, the held one not yet
        fresh = bridge.alloc_or_null(MIB, DEV, S1)  # a miss: the allocator is asked
        assert fresh and spied.take_calls() == [("allocate", MIB, S1)]
    assert "a rebuild freed 1 torch block(s), 2097152 bytes" in caplog.text  # the held one only
    assert spied.allocator.lost_blocks == {held: 2 * MIB}
    bridge.free(held, 2 * MIB, DEV, S1)  # of the old epoch: to the allocator, never cached
    assert spied.take_calls() == [("free", 2 * MIB, S1)]
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 0 and spied.allocator.lost_blocks == {}
    bridge.free(fresh, MIB, DEV, S1)
    spied.allocator.flush()
    assert spied.tag_bytes() == 0 and spied.allocator.live_blocks == 0


def test_close_empties_and_disables_the_cache_and_the_tag_returns_to_zero(spied: Spied, bridge: Bridge) -> None:
    ptrs = [bridge.alloc_or_null(n, DEV, S1) for n in (4096, 65536, MIB)]
    for ptr, n in zip(ptrs[:2], (4096, 65536), strict=True):
        bridge.free(ptr, n, DEV, S1)
    spied.take_calls()
    spied.allocator.close()
    assert sorted(spied.take_calls()) == [("free", 4096, S1), ("free", 65536, S1)]
    assert not alloc_bridge.cache_stats(DEV)["enabled"] and spied.tag_bytes() == MIB
    bridge.free(ptrs[2], MIB, DEV, S1)  # a live block's later free: freed, not cached
    assert spied.take_calls() == [("free", MIB, S1)]
    assert spied.tag_bytes() == 0 and alloc_bridge.cache_stats(DEV)["cached_blocks"] == 0


def test_unregister_gives_the_cache_back(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, MIB, DEV, S1)
    assert spied.tag_bytes() == MIB
    assert alloc_bridge.unregister(DEV)
    assert spied.tag_bytes() == 0 and not alloc_bridge.cache_stats(DEV)["enabled"]
    alloc_bridge.register(DEV, spied.allocator)  # the fixture unregisters it again
    assert alloc_bridge.cache_stats(DEV)["enabled"]


def test_an_unregistered_device_has_no_cache_figures() -> None:
    assert alloc_bridge.cache_stats(255) == {
        "hits": 0, "misses": 0, "cached_bytes": 0, "cached_blocks": 0, "live_blocks": 0, "limit": None,
        "evicted_blocks": 0, "evicted_bytes": 0, "epoch": 0, "enabled": False}
    assert alloc_bridge.empty_cache(255) == 0 and alloc_bridge.disable_cache(255) == 0
    assert alloc_bridge.invalidate(255) == []


def test_the_torch_route_reads_and_empties_its_device_s_cache(spied: Spied, bridge: Bridge) -> None:
    from xlog_actors.interop.torch import TorchRoute

    route = TorchRoute(spied.allocator)
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, MIB, DEV, S1)
    stats = route.cache_stats()
    assert (stats["cached_bytes"], stats["cached_blocks"], stats["misses"]) == (MIB, 1, 1)
    other = TorchRoute(DeviceAllocator(as_client(spied.device), "other"))
    assert other.empty_cache() == 0 and spied.tag_bytes() == MIB  # not the registered allocator: untouched
    assert route.empty_cache() == MIB
    assert spied.tag_bytes() == 0 and route.cache_stats()["cached_blocks"] == 0


def test_a_free_past_the_limit_gives_the_oldest_cached_blocks_back_first(spied: Spied, bridge: Bridge) -> None:
    assert alloc_bridge.set_cache_limit(DEV, 2 * MIB) == 0
    a, b, c = (bridge.alloc_or_null(MIB, DEV, s) for s in (S1, S2, S1))
    bridge.free(a, MIB, DEV, S1)
    bridge.free(b, MIB, DEV, S2)
    spied.take_calls()
    bridge.free(c, MIB, DEV, S1)  # 3 MiB would be cached: the oldest (a, on S1) goes back first
    assert spied.take_calls() == [("free", MIB, S1)]
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["cached_bytes"], stats["cached_blocks"], stats["limit"]) == (2 * MIB, 2, 2 * MIB)
    assert (stats["evicted_blocks"], stats["evicted_bytes"]) == (1, MIB)
    assert spied.tag_bytes() == 2 * MIB  # exactly what the cache holds: nothing leaked, nothing lost
    # The survivors are b (on S2) and c (on S1): each is handed out again on its own stream.
    assert bridge.alloc_or_null(MIB, DEV, S2) == b and bridge.alloc_or_null(MIB, DEV, S1) == c
    assert spied.take_calls() == []
    for ptr, s in ((b, S2), (c, S1)):
        bridge.free(ptr, MIB, DEV, s)
    spied.allocator.flush()
    assert spied.tag_bytes() == 0


def test_a_block_larger_than_the_limit_is_not_cached(spied: Spied, bridge: Bridge) -> None:
    alloc_bridge.set_cache_limit(DEV, MIB)
    small = bridge.alloc_or_null(4096, DEV, S1)
    big = bridge.alloc_or_null(2 * MIB, DEV, S1)
    bridge.free(small, 4096, DEV, S1)
    spied.take_calls()
    bridge.free(big, 2 * MIB, DEV, S1)
    assert spied.take_calls() == [("free", 2 * MIB, S1)]  # straight to the allocator
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["cached_bytes"], stats["evicted_blocks"]) == (4096, 0)  # the small one stays
    alloc_bridge.set_cache_limit(DEV, 0)  # nothing cached from now on: the small one goes back now
    assert spied.take_calls() == [("free", 4096, S1)] and spied.tag_bytes() == 0
    again = bridge.alloc_or_null(4096, DEV, S1)
    bridge.free(again, 4096, DEV, S1)
    assert spied.take_calls() == [("allocate", 4096, S1), ("free", 4096, S1)]
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 0


def test_lowering_the_limit_gives_back_the_oldest_until_the_rest_fits(spied: Spied, bridge: Bridge) -> None:
    sizes = (MIB, 2 * MIB, MIB // 2)
    ptrs = [bridge.alloc_or_null(n, DEV, S1) for n in sizes]
    for ptr, n in zip(ptrs, sizes, strict=True):
        bridge.free(ptr, n, DEV, S1)
    spied.take_calls()
    assert alloc_bridge.set_cache_limit(DEV, 2 * MIB) == 3 * MIB  # the 1 MiB, then the 2 MiB one
    assert spied.take_calls() == [("free", MIB, S1), ("free", 2 * MIB, S1)]
    assert alloc_bridge.cache_stats(DEV)["cached_bytes"] == MIB // 2 == spied.tag_bytes()
    assert alloc_bridge.set_cache_limit(DEV, None) == 0  # no limit again: nothing to give back
    assert alloc_bridge.cache_stats(DEV)["limit"] is None


def test_a_bad_limit_is_refused_and_changes_nothing(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, MIB, DEV, S1)
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError), ("1", TypeError)):
        with pytest.raises(error):
            alloc_bridge.set_cache_limit(DEV, bad)
    with pytest.raises(ValueError, match="no registered allocator"):
        alloc_bridge.set_cache_limit(254, 0)
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["limit"], stats["cached_bytes"]) == (None, MIB) and spied.tag_bytes() == MIB


def test_a_new_registration_starts_without_a_limit(spied: Spied) -> None:
    alloc_bridge.set_cache_limit(DEV, MIB)
    alloc_bridge.unregister(DEV)
    alloc_bridge.register(DEV, spied.allocator)
    assert alloc_bridge.cache_stats(DEV)["limit"] is None


def test_a_budget_refusal_under_a_limit_still_gives_the_cache_back_and_retries(spied: Spied, bridge: Bridge) -> None:
    alloc_bridge.set_cache_limit(DEV, 5 * MIB)
    a = bridge.alloc_or_null(4 * MIB, DEV, S1)
    bridge.free(a, 4 * MIB, DEV, S1)  # fits under the limit: cached
    spied.take_calls()
    b = bridge.alloc_or_null(6 * MIB, DEV, S2)
    assert b and spied.take_calls() == [
        ("allocate", 6 * MIB, S2), ("free", 4 * MIB, S1), ("synchronize", 0, 0), ("allocate", 6 * MIB, S2)]
    bridge.free(b, 6 * MIB, DEV, S2)  # larger than the limit: freed, not cached
    assert spied.take_calls() == [("free", 6 * MIB, S2)]
    spied.allocator.synchronize()
    assert spied.tag_bytes() == 0


def test_an_eviction_the_allocator_refuses_is_logged_and_kept_as_the_last_error(
    spied: Spied, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    alloc_bridge.set_cache_limit(DEV, MIB)
    a, b = (bridge.alloc_or_null(MIB, DEV, S1) for _ in range(2))
    bridge.free(a, MIB, DEV, S1)
    refusal = xa.InvalidRequest("refused for the test")

    def refuse(ptr: int, nbytes: int, stream: int) -> None:
        raise refusal

    spied.allocator.free, keep = refuse, spied.allocator.free  # type: ignore[method-assign]
    bridge.free(b, MIB, DEV, S1)  # evicts a, whose free fails
    spied.allocator.free = keep  # type: ignore[method-assign]
    assert alloc_bridge.last_error(DEV) is refusal and "free of cached" in caplog.text
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["cached_blocks"], stats["cached_bytes"], stats["evicted_blocks"]) == (1, MIB, 1)
    assert spied.allocator.live_blocks == 2  # a is still the allocator's: it was never freed
    spied.allocator.free(a, MIB, S1)
    spied.allocator.flush()
    assert spied.tag_bytes() == 0


def _report_split(device: pykka.ActorRef[Any], tag: str = "torch") -> tuple[int, int]:
    """(bytes of the tag, of which cached) in GetStats' report."""
    report = device.ask(xa.GetStats()).report
    total = int(report["by_tag"].get(tag, {}).get("nbytes", 0))
    return total, int(report["cached"]["by_tag"].get(tag, {}).get("nbytes", 0))


def test_the_memory_report_shows_the_cache_s_share_of_the_tag(spied: Spied, bridge: Bridge) -> None:
    live = bridge.alloc_or_null(2 * MIB, DEV, S1)
    idle = [bridge.alloc_or_null(n, DEV, S1) for n in (MIB, 4096)]
    assert _report_split(spied.device) == (3 * MIB + 4096, 0)  # all in use, nothing cached
    for ptr, n in zip(idle, (MIB, 4096), strict=True):
        bridge.free(ptr, n, DEV, S1)
    # The freed blocks are still the tag's, now as the cache's share, not in use.
    assert _report_split(spied.device) == (3 * MIB + 4096, MIB + 4096)
    cached = spied.device.ask(xa.GetStats()).report["cached"]
    assert (cached["count"], cached["nbytes"]) == (2, MIB + 4096)
    assert cached["by_tag"]["torch"]["count"] == 2
    report = spied.device.ask(xa.GetReport())
    assert report.cached_by_tag["torch"].nbytes == MIB + 4096
    assert "torch: 3 blocks, 3.0 MiB (1.0 MiB in 2 idle in a cache)" in report.format()
    bridge.alloc_or_null(MIB, DEV, S1)  # a hit: back in use
    assert _report_split(spied.device) == (3 * MIB + 4096, 4096)
    assert alloc_bridge.empty_cache(DEV) == 4096
    assert _report_split(spied.device) == (3 * MIB, 0)
    assert spied.device.ask(xa.GetStats()).report["cached"] == {"count": 0, "nbytes": 0, "by_tag": {}}
    bridge.free(live, 2 * MIB, DEV, S1)
    bridge.free(idle[0], MIB, DEV, S1)
    assert _report_split(spied.device) == (3 * MIB, 3 * MIB)
    spied.allocator.flush()
    assert _report_split(spied.device) == (0, 0)  # the tag returns to zero, cache share included


def test_a_closed_or_unregistered_allocator_has_no_share_in_the_report(spied: Spied, bridge: Bridge) -> None:
    a = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(a, MIB, DEV, S1)
    other = DeviceAllocator(as_client(spied.device), "other")  # not registered: shares nothing
    assert _report_split(spied.device) == (MIB, MIB) and _report_split(spied.device, "other") == (0, 0)
    other.close()
    alloc_bridge.unregister(DEV)  # gives the cache back
    assert _report_split(spied.device) == (0, 0)
    alloc_bridge.register(DEV, spied.allocator)
    b = bridge.alloc_or_null(MIB, DEV, S1)
    bridge.free(b, MIB, DEV, S1)
    assert _report_split(spied.device) == (MIB, MIB)
    spied.allocator.close()  # empties and disables the cache, and leaves the device's shares
    assert _report_split(spied.device) == (0, 0)
    assert spied.allocator._cache_share not in spied.device.ask(xa.GetClient())._cell.cache_shares._sources


def test_the_torch_route_sets_and_reads_its_cache_limit(spied: Spied, bridge: Bridge) -> None:
    from xlog_actors.interop.torch import TorchRoute

    route = TorchRoute(spied.allocator)
    assert route.cache_limit is None  # the default: no limit
    ptrs = [bridge.alloc_or_null(MIB, DEV, S1) for _ in range(3)]
    for ptr in ptrs:
        bridge.free(ptr, MIB, DEV, S1)
    assert route.set_cache_limit(MIB) == 2 * MIB and route.cache_limit == MIB
    assert _report_split(spied.device) == (MIB, MIB)
    for bad in (-1, 2.0, False, "1"):
        with pytest.raises(xa.InvalidRequest, match="cache limit"):
            route.set_cache_limit(bad)  # type: ignore[arg-type]
    assert route.cache_limit == MIB and _report_split(spied.device) == (MIB, MIB)  # nothing changed
    assert route.set_cache_limit(None) == 0 and route.cache_limit is None
    alloc_bridge.unregister(DEV)
    with pytest.raises(xa.InvalidRequest, match="no longer registered"):
        route.set_cache_limit(0)
