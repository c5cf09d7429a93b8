"""The allocator bridge's cache against a model of it, through the exported functions (ctypes),
over a stand-in allocator that hands out aligned pointers and refuses any free it did not hand
out at that size.

The model is the cache's contract: a hit is the newest block kept for the (stream, class), the
allocator's blocks are exactly the live and the cached ones, a limit gives back the oldest
first, a drain gives back everything oldest first, an invalidation forgets without freeing and
starts an epoch whose frees of older blocks go to the allocator. A state machine drives it with
few streams and classes (many hits); a larger run keeps thousands of blocks live, so the
compiled tables grow and delete through long probe chains.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from xlog_actors._core import alloc_bridge

from .test_alloc_bridge import Bridge

DEV = 9  # an ordinal no other test registers
STREAMS = (0, 0x1000, 0x7F00_0000_2000)
#: The first three, in two classes, are the state machine's: few (stream, class) keys, so a key
#: often holds several blocks and the order among them shows.
SIZES = (1, 512, 3000, 70_000, 4097, 1 << 20, (3 << 20) + 5)


class StandIn:
    """An allocator that keeps what it handed out, to check the bridge's frees against. Its
    pointers are 512-byte aligned (the low bits the tables must not rely on are zero) and drawn
    at random from 48 bits: evenly spaced ones would hash to distinct slots and leave the tables'
    collisions and long probe chains untried."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self.blocks: dict[int, int] = {}
        self.calls: list[tuple[str, int, int, int]] = []

    def allocate(self, nbytes: int, stream: int) -> int:
        ptr = self._rng.randrange(1, 1 << 39) << 9
        while ptr in self.blocks:
            ptr = self._rng.randrange(1, 1 << 39) << 9
        self.blocks[ptr] = nbytes
        self.calls.append(("allocate", ptr, nbytes, stream))
        return ptr

    def free(self, ptr: int, nbytes: int, stream: int) -> None:
        if self.blocks.get(ptr) != nbytes:
            raise ValueError(f"free of {ptr:#x} with {nbytes} bytes: not a block of that size")
        del self.blocks[ptr]
        self.calls.append(("free", ptr, nbytes, stream))

    def forget(self, ptr: int) -> None:
        """What an allocator does with a block a rebuild dropped: its memory went with the context."""
        del self.blocks[ptr]

    def take_calls(self) -> list[tuple[str, int, int, int]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    allocator = StandIn()
    alloc_bridge.register(DEV, allocator)
    yield allocator
    alloc_bridge.unregister(DEV)


class CacheModel(RuleBasedStateMachine):
    """One registration of a stand-in allocator; every step compares the bridge with the model.
    Frees on another stream use the third stream, on which nothing is allocated."""

    handed = Bundle("handed")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = StandIn()
        alloc_bridge.register(DEV, self.allocator)
        self.bridge = Bridge()
        self.epoch = 0
        self.live: dict[int, tuple[int, int, int, int]] = {}  # ptr -> class, size asked, stream, epoch
        self.cached: list[tuple[int, int, int]] = []  # (ptr, class, stream), oldest first
        self.limit: int | None = None
        self.hits = self.misses = 0

    def _give_back(self, blocks: list[tuple[int, int, int]]) -> list[tuple[str, int, int, int]]:
        return [("free", ptr, cls, stream) for ptr, cls, stream in blocks]

    def _make_room(self, cls: int) -> list[tuple[int, int, int]]:
        out = []
        while self.limit is not None and sum(c for _, c, _ in self.cached) + cls > self.limit:
            out.append(self.cached.pop(0))
        return out

    @rule(target=handed, size=st.sampled_from(SIZES[:3]), stream=st.sampled_from(STREAMS[:2]))
    def allocate(self, size: int, stream: int) -> int:
        cls = alloc_bridge.size_class(size)
        mine = [b for b in self.cached if b[1] == cls and b[2] == stream]
        ptr = self.bridge.alloc_or_null(size, DEV, stream)
        calls = self.allocator.take_calls()
        if mine:
            assert ptr == mine[-1][0] and calls == []
            self.cached.remove(mine[-1])
            self.hits += 1
        else:
            assert calls == [("allocate", ptr, cls, stream)]
            self.misses += 1
        self.live[ptr] = (cls, size, stream, self.epoch)
        return ptr

    def _free(self, ptr: int, on_another_stream: bool) -> None:
        cls, size, stream, epoch = self.live.pop(ptr)
        on = STREAMS[2] if on_another_stream else stream
        self.bridge.free(ptr, size, DEV, on)
        calls = self.allocator.take_calls()
        if on != stream or epoch != self.epoch or (self.limit is not None and cls > self.limit):
            assert calls == [("free", ptr, cls, on)]
        else:
            evicted = self._make_room(cls)
            self.cached.append((ptr, cls, stream))
            assert calls == self._give_back(evicted)

    @rule(ptr=consumes(handed))
    def free(self, ptr: int) -> None:
        self._free(ptr, False)

    @rule(first=consumes(handed), second=consumes(handed))
    def free_two(self, first: int, second: int) -> None:
        """Two frees in a row: a (stream, class) often gets several blocks, whose order shows."""
        self._free(first, False)
        self._free(second, False)

    @rule(ptr=consumes(handed))
    def free_on_another_stream(self, ptr: int) -> None:
        self._free(ptr, True)

    @rule(ptr=handed)
    def free_with_another_size_is_refused(self, ptr: int) -> None:
        cls, size, stream, _epoch = self.live[ptr]
        logging.disable(logging.ERROR)  # the refusal is logged; the model checks it changed nothing
        try:
            self.bridge.free(ptr, size + 1, DEV, stream)
        finally:
            logging.disable(logging.NOTSET)
        assert self.allocator.take_calls() == []
        assert isinstance(alloc_bridge.last_error(DEV), ValueError)

    @rule(limit=st.one_of(st.none(), st.sampled_from([0, 4096, 1 << 20, 8 << 20])))
    def set_limit(self, limit: int | None) -> None:
        self.limit = limit
        evicted = self._make_room(0)
        assert alloc_bridge.set_cache_limit(DEV, limit) == sum(c for _, c, _ in evicted)
        assert self.allocator.take_calls() == self._give_back(evicted)

    @rule()
    def empty(self) -> None:
        blocks, self.cached = self.cached, []
        assert alloc_bridge.empty_cache(DEV) == sum(c for _, c, _ in blocks)
        assert self.allocator.take_calls() == self._give_back(blocks)

    @precondition(lambda self: len(self.cached) > 0)
    @rule()
    def invalidate(self) -> None:
        dropped, self.cached = self.cached, []
        assert alloc_bridge.invalidate(DEV) == dropped
        for ptr, _cls, _stream in dropped:
            self.allocator.forget(ptr)
        self.epoch += 1
        assert self.allocator.take_calls() == []

    @invariant()
    def figures_agree(self) -> None:
        stats = alloc_bridge.cache_stats(DEV)
        assert (stats["hits"], stats["misses"]) == (self.hits, self.misses)
        assert stats["cached_blocks"] == len(self.cached)
        assert stats["cached_bytes"] == sum(c for _, c, _ in self.cached)
        assert stats["live_blocks"] == len(self.live)
        assert stats["limit"] == self.limit

    @invariant()
    def the_allocator_holds_the_live_and_the_cached_blocks(self) -> None:
        assert set(self.allocator.blocks) == set(self.live) | {p for p, _, _ in self.cached}

    def teardown(self) -> None:
        alloc_bridge.unregister(DEV)


TestCacheModel = CacheModel.TestCase
TestCacheModel.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_hit_is_the_newest_block_kept_for_its_stream_and_class(stand_in: StandIn) -> None:
    """Blocks of one (stream, class) come back newest first (the one most likely still in the
    GPU's caches), and a block of another stream or class freed in between changes nothing."""
    bridge = Bridge()
    first, second, third = (bridge.alloc_or_null(512, DEV, STREAMS[0]) for _ in range(3))
    other_class, other_stream = bridge.alloc_or_null(3000, DEV, STREAMS[0]), bridge.alloc_or_null(1, DEV, STREAMS[1])
    for ptr, size, stream in ((first, 512, 0), (second, 512, 0), (other_class, 3000, 0), (third, 512, 0),
                              (other_stream, 1, STREAMS[1])):
        bridge.free(ptr, size, DEV, stream)
    stand_in.take_calls()
    assert [bridge.alloc_or_null(100, DEV, STREAMS[0]) for _ in range(3)] == [third, second, first]
    assert stand_in.take_calls() == []
    assert alloc_bridge.cache_stats(DEV)["cached_blocks"] == 2


def test_thousands_of_live_and_cached_blocks_keep_every_entry(stand_in: StandIn) -> None:
    """Thousands of blocks live at once, freed in a shuffled order, kept, handed out again and
    freed again: every hit is a block of its (stream, class), no block is handed out twice,
    and the figures end where the model says."""
    bridge, rng = Bridge(), random.Random(5)
    asked = [(rng.choice(SIZES), rng.choice(STREAMS)) for _ in range(6000)]
    live = {bridge.alloc_or_null(n, DEV, s): (n, s) for n, s in asked}
    assert len(live) == len(asked) and alloc_bridge.cache_stats(DEV)["live_blocks"] == len(asked)
    order = list(live)
    rng.shuffle(order)
    for ptr in order:
        bridge.free(ptr, *live[ptr][:1], DEV, live[ptr][1])
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["live_blocks"], stats["cached_blocks"]) == (0, len(asked))
    stand_in.take_calls()
    again = {}
    for n, s in asked:
        ptr = bridge.alloc_or_null(n, DEV, s)
        assert ptr not in again
        cls, (n0, s0) = alloc_bridge.size_class(n), live[ptr]
        assert (alloc_bridge.size_class(n0), s0) == (cls, s)
        again[ptr] = (n, s)
    assert stand_in.take_calls() == []  # every one a hit
    for ptr in list(again)[::2]:
        bridge.free(ptr, again[ptr][0], DEV, again[ptr][1])
    stats = alloc_bridge.cache_stats(DEV)
    assert (stats["live_blocks"], stats["cached_blocks"], stats["hits"]) == (
        len(asked) - len(asked) // 2, len(asked) // 2, len(asked))
    assert alloc_bridge.empty_cache(DEV) == sum(alloc_bridge.size_class(again[p][0]) for p in list(again)[::2])
    assert set(stand_in.blocks) == set(list(again)[1::2])
