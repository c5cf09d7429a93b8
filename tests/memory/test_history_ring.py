"""The compiled ring under MemoryHistory: both stack walks agree and skip the runtime's frames;
stacks and tags are interned (and forgotten by ``clear``); the live-block table stays right
through growth, reused addresses and stale frees; bad input records nothing."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors._core import history_ring
from xlog_actors._core.blocks import make_block
from xlog_actors._core.history_ring import HistoryRing
from xlog_actors.memory import MemoryHistory
from xlog_actors.memory.block import StreamId
from xlog_actors.memory.history import capture_frames


@dataclass
class _Block:
    """A block that is not a ``DeviceBlock``: the ring reads its attributes."""

    ptr: Any
    device_ordinal: Any = 0
    alloc_stream: Any = StreamId(0)
    nbytes: Any = 256
    tag: Any = xa.AllocTag.UNTAGGED
    generation: Any = 1


def _block(ptr: int, generation: int = 1, device: int = 0, tag: str = "t") -> xa.DeviceBlock:
    return make_block(ptr, device, StreamId(0), 256, 256, xa.AllocTag(tag), generation)


@pytest.fixture(params=["interpreter records", "frame objects"])
def walk(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "interpreter records" and not history_ring.FAST_FRAME_WALK:
        pytest.skip("this interpreter's stacks are walked through frame objects only (CPython 3.11 to 3.13 have both)")
    history_ring._force_frame_objects(request.param == "frame objects")
    try:
        yield request.param
    finally:
        history_ring._force_frame_objects(False)


def _recorded_here(history: MemoryHistory, block: Any) -> tuple[Any, int]:
    history.record_alloc(block)
    line = sys._getframe().f_lineno - 1
    return capture_frames(sys._getframe(), 4), line  # the same stack, this frame a line further


def test_both_walks_keep_the_callers_frames_as_capture_frames_does(walk: str) -> None:
    history = MemoryHistory(max_frames=4)
    expected, line = _recorded_here(history, _block(0x1000))
    events = history.events()
    assert [(f["name"], f["line"]) for f in events[0]["frames"][:1]] == [("_recorded_here", line)]
    entries, _live, _n, _cap = history.entries()
    assert [code for code, _ in entries[0][7]] == [code for code, _ in expected]
    assert entries[0][7][1:] == expected[1:]  # the outer frames are at the same instruction


def _deep(n: int, history: MemoryHistory, block: Any) -> None:
    if n:
        _deep(n - 1, history, block)
    else:
        history.record_alloc(block)


def test_a_stack_deeper_than_the_c_buffer_is_kept_up_to_max_frames(walk: str) -> None:
    history = MemoryHistory(max_frames=80)  # more than the 64 frames walked into the C stack
    _deep(100, history, _block(0x1000))
    frames = history.events()[0]["frames"]
    assert len(frames) == 80 and {f["name"] for f in frames} == {"_deep"}


def test_a_stack_seen_again_is_the_same_interned_tuple(walk: str) -> None:
    history = MemoryHistory()
    for i in range(3):
        history.record_alloc(_block(0x1000 + 0x100 * i))  # one call site, three events
    history.record_alloc(_block(0x2000))  # another line
    entries = history.entries()[0]
    assert entries[0][7] is entries[1][7] is entries[2][7]
    assert entries[3][7] is not entries[0][7] and entries[3][7][0][0] is entries[0][7][0][0]


def test_many_distinct_stacks_grow_the_table() -> None:
    history = MemoryHistory(max_frames=1)
    namespace: dict[str, Any] = {}
    for i in range(300):  # 300 code objects: the stack table grows several times
        exec(f"def site_{i}(h, b):\n    h.record_alloc(b)\n", namespace)
    for i in range(300):
        namespace[f"site_{i}"](history, _block(0x10000 + 0x100 * i))
    for i in range(300):  # seen again: interned, not added
        namespace[f"site_{i}"](history, _block(0x10000 + 0x100 * i, generation=2))
    names = [e["frames"][0]["name"] for e in history.events()]
    assert names == [f"site_{i}" for i in range(300)] * 2
    entries = history.entries()[0]
    assert all(entries[i][7] is entries[i + 300][7] for i in range(300))


def test_live_blocks_through_growth_reuse_and_stale_frees() -> None:
    history = MemoryHistory(max_entries=50)
    blocks = [_block(0x100000 + 0x1000 * i, device=i % 2) for i in range(1000)]
    for b in blocks:
        history.record_alloc(b)
    for b in blocks[::2]:
        history.record_free(b)
    assert history.live_blocks == 500
    assert sorted(s["address"] for s in history.snapshot()["segments"]) == sorted(b.ptr for b in blocks[1::2])
    # an address handed out again: the stale free (old generation) leaves the new block live
    again = _block(blocks[1].ptr, generation=7, device=blocks[1].device_ordinal)
    history.record_alloc(again)  # its old free went unrecorded: the new block takes its place
    history.record_free(blocks[1])
    assert history.live_blocks == 500
    assert [s for s in history.snapshot()["segments"] if s["address"] == again.ptr][0]["device"] == 1
    # the same address on another device is another block
    history.record_alloc(_block(again.ptr, generation=8, device=0))
    assert history.live_blocks == 501
    assert history.forget_device(1, "device stopped") == 500
    assert history.live_blocks == 1 and history.events()[-1]["note"] == "device stopped"
    assert history.recorded == 1000 + 500 + 3 + 500


def test_clear_forgets_the_interned_tags_and_stacks() -> None:
    history = MemoryHistory()
    history.record_alloc(_block(0x1000, tag="a"))
    history.record_alloc(_block(0x2000, tag="b"))
    history.clear()
    assert (len(history), history.recorded, history.live_blocks) == (0, 0, 0)
    history.record_alloc(_block(0x3000, tag="b"))
    history.record_alloc(_block(0x4000, tag="a"))
    assert [e["tag"] for e in history.events()] == ["b", "a"]
    assert history.snapshot()["xlog_actors"]["tags"] == ["a", "b"]


def test_resize_of_a_wrapped_ring_keeps_the_newest() -> None:
    history = MemoryHistory(max_entries=5)
    for i in range(8):
        history.record_alloc(_block(0x1000 * (i + 1)))
    history.resize(3)
    assert [e["addr"] for e in history.events()] == [0x6000, 0x7000, 0x8000]
    history.resize(10)
    history.record_alloc(_block(0x9000))
    assert [e["addr"] for e in history.events()] == [0x6000, 0x7000, 0x8000, 0x9000]
    assert history.max_entries == 10 and history.live_blocks == 9


def test_an_asked_from_stack_is_recorded_and_interned() -> None:
    history = MemoryHistory()
    origin = capture_frames(sys._getframe())
    with history.asked_from(origin):
        history.record_alloc(_block(0x1000))
        history.record_free(_block(0x1000))
    history.record_alloc(_block(0x2000))
    entries = history.entries()[0]
    assert entries[0][7] is origin and entries[1][7] is origin
    assert entries[2][7] != origin  # outside: this thread's own stack


def test_a_block_of_another_type_is_read_by_attribute() -> None:
    history = MemoryHistory()
    history.record_alloc(_Block(0x1000, device_ordinal=1, alloc_stream=StreamId(3), nbytes=64))
    event = history.events()[0]
    assert (event["addr"], event["device"], event["stream"], event["size"]) == (0x1000, 1, 3, 64)


@pytest.mark.parametrize("bad", [
    _Block(None), _Block(-1), _Block(0x1000, device_ordinal="0"), _Block(0x1000, nbytes="64"),
    _Block(0x1000, generation=None), object(),
])
def test_a_bad_block_records_nothing(bad: Any) -> None:
    history = MemoryHistory()
    history.record_alloc(_block(0x1000))
    with pytest.raises((TypeError, OverflowError, AttributeError)):
        history.record_alloc(bad)
    with pytest.raises((TypeError, OverflowError, AttributeError)):
        history.record_free(bad)
    assert (len(history), history.recorded, history.live_blocks) == (1, 1, 1)


def test_the_raw_ring_refuses_bad_bounds_and_use_before_init() -> None:
    for bounds in ((0, 8), (10, 0), (-1, 8)):
        with pytest.raises(ValueError, match="positive"):
            HistoryRing(*bounds, {}, lambda name: False)
    ring = HistoryRing(4, 2, {}, lambda name: False)
    with pytest.raises(ValueError, match="once"):
        ring.__init__(4, 2, {}, lambda name: False)  # type: ignore[misc]
    with pytest.raises(ValueError, match="positive"):
        ring.resize(0)
    assert ring.max_entries == 4 and ring.max_frames == 2
    bare = HistoryRing.__new__(HistoryRing)
    with pytest.raises(ValueError, match="not initialised"):
        bare.record_alloc(_block(0x1000))
    with pytest.raises(xa.InvalidRequest, match="max_entries"):
        MemoryHistory(4).resize(0)
