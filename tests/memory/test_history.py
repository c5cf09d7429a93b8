"""MemoryHistory: exactly the events asked for, with the asking function on top of each stack; the
ring bound; thread safety; the snapshot in PyTorch's format (read by PyTorch's own viewer code where
PyTorch is installed)."""

from __future__ import annotations

import pickle
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource, MemoryHistory, StreamPool
from xlog_actors.memory.history import capture_frames, frame_line

THIS_FILE = str(Path(__file__).resolve())


def _known_sequence(res: Any, lines: list[int]) -> list[xa.DeviceBlock]:
    """Three allocations and two frees, each on its own line, whose line numbers are noted."""
    lines.append(sys._getframe().f_lineno + 1)
    a = res.allocate(1024, tag=xa.AllocTag("weights"))
    lines.append(sys._getframe().f_lineno + 1)
    b = res.allocate(4096, tag=xa.AllocTag("activations"))
    lines.append(sys._getframe().f_lineno + 1)
    c = res.allocate(512)
    lines.append(sys._getframe().f_lineno + 1)
    res.deallocate(b)
    lines.append(sys._getframe().f_lineno + 1)
    res.deallocate(a)
    return [a, b, c]


def _resource(kind: str, driver: Any) -> tuple[Any, StreamPool]:
    pool = StreamPool(driver, 0)
    res = AsyncCudaResource(driver, 0, pool) if kind == "async" else DirectCudaResource(driver, 0)
    return res, pool


@pytest.mark.parametrize("kind", ["async", "direct"])
def test_a_known_sequence_gives_exactly_its_events_with_the_caller_on_top(host_driver: Any, kind: str) -> None:
    res, pool = _resource(kind, host_driver)
    history = MemoryHistory()
    res.set_history(history)
    lines: list[int] = []
    a, b, c = _known_sequence(res, lines)
    res.set_history(None)
    events = history.events()
    expected = [("alloc", a, "weights"), ("alloc", b, "activations"), ("alloc", c, "untagged"),
                ("free", b, "activations"), ("free", a, "weights")]
    assert [(e["action"], e["addr"], e["size"], e["tag"], e["stream"], e["device"]) for e in events] == [
        (action, blk.ptr, blk.nbytes, tag, int(blk.alloc_stream), 0) for action, blk, tag in expected
    ]
    for event, line in zip(events, lines, strict=True):
        top = event["frames"][0]
        assert (top["filename"], top["line"], top["name"]) == (THIS_FILE, line, "_known_sequence")
        assert event["frames"][1]["name"] == "test_a_known_sequence_gives_exactly_its_events_with_the_caller_on_top"
        assert all(not f["filename"].startswith(str(Path(xa.__file__).parent)) for f in event["frames"])
    times = [e["time_ns"] for e in events]
    assert times == sorted(times)
    res.deallocate(c)
    pool.close()


def test_the_runtime_finds_the_base_under_adaptors_and_skips_their_frames(host_driver: Any) -> None:
    runtime = xa.XlogDeviceRuntime.build(host_driver, 0, "async+stats+budget:16MiB")
    try:
        assert runtime.history is None
        history = MemoryHistory()
        runtime.set_history(history)
        assert runtime.history is history
        assert runtime.base_resource().history is history  # type: ignore[attr-defined]
        lines: list[int] = []
        blocks = _known_sequence(runtime, lines)
        events = history.events()
        assert len(events) == 5
        assert [e["frames"][0]["line"] for e in events] == lines
        assert {e["frames"][0]["name"] for e in events} == {"_known_sequence"}
        with pytest.raises(xa.InvalidRequest, match="MemoryHistory"):
            runtime.set_history(object())  # type: ignore[arg-type]
        assert runtime.history is history, "a refused call changes nothing"
        runtime.set_history(None)
        runtime.deallocate(blocks[2])
        assert len(history) == 5
    finally:
        runtime.close()


def test_the_snapshot_is_in_pytorch_format_and_dump_pickles_it(host_driver: Any, tmp_path: Path) -> None:
    res, pool = _resource("async", host_driver)
    history = MemoryHistory()
    res.set_history(history)
    lines: list[int] = []
    a, b, c = _known_sequence(res, lines)
    snap = history.snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    trace = snap["device_traces"][0]
    assert [e["action"] for e in trace] == ["alloc", "alloc", "alloc", "free_requested", "free_completed",
                                            "free_requested", "free_completed"]
    for e in trace:
        assert set(e) >= {"action", "addr", "size", "stream", "frames", "time_us", "tag"}
        assert isinstance(e["time_us"], int)
        assert set(e["frames"][0]) == {"filename", "line", "name"}
    # the one block still live is the one segment, with one active block
    assert [s["address"] for s in snap["segments"]] == [c.ptr]
    seg = snap["segments"][0]
    assert seg["total_size"] == seg["allocated_size"] == c.nbytes
    assert seg["blocks"] == [{"address": c.ptr, "size": c.nbytes, "requested_size": c.nbytes,
                              "state": "active_allocated", "frames": seg["frames"], "tag": "untagged"}]
    assert snap["xlog_actors"]["tags"] == ["activations", "untagged", "weights"]
    path = tmp_path / "snap.pickle"
    history.dump(path)
    with open(path, "rb") as f:
        assert pickle.load(f) == history.snapshot()
    res.set_history(None)
    res.deallocate(c)
    pool.close()


def test_the_ring_keeps_the_newest_events_and_every_live_block(host_driver: Any) -> None:
    res, pool = _resource("async", host_driver)
    history = MemoryHistory(max_entries=10)
    res.set_history(history)
    kept = res.allocate(256, tag=xa.AllocTag("kept"))  # its allocation leaves the ring
    for i in range(12):
        res.deallocate(res.allocate(512 + 256 * i))
    assert len(history) == 10
    assert history.recorded == 25
    sizes = [e["size"] for e in history.events()]
    assert sizes == [512 + 256 * i for i in range(7, 12) for _ in range(2)]
    snap = history.snapshot()
    assert snap["xlog_actors"]["dropped"] == 15
    assert [s["address"] for s in snap["segments"]] == [kept.ptr]
    history.resize(4)
    assert [e["size"] for e in history.events()] == sizes[-4:]
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(xa.InvalidRequest, match="max_entries"):
            history.resize(bad)  # type: ignore[arg-type]
        with pytest.raises(xa.InvalidRequest):
            MemoryHistory(max_entries=bad)  # type: ignore[arg-type]
    assert history.max_entries == 4 and len(history) == 4
    res.deallocate(kept)
    res.set_history(None)
    pool.close()


def test_many_threads_each_event_recorded_once(host_driver: Any) -> None:
    res, pool = _resource("async", host_driver)
    history = MemoryHistory(max_entries=100_000)
    res.set_history(history)
    threads, rounds = 6, 150
    start = threading.Barrier(threads)

    def _worker(t: int) -> None:
        start.wait()
        for _ in range(rounds):
            res.deallocate(res.allocate(256 * (t + 1), tag=xa.AllocTag(f"t{t}")))

    workers = [threading.Thread(target=_worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    events = history.events()
    assert len(events) == history.recorded == 2 * threads * rounds
    for t in range(threads):
        mine = [e for e in events if e["tag"] == f"t{t}"]
        assert sum(e["action"] == "alloc" for e in mine) == rounds
        assert sum(e["action"] == "free" for e in mine) == rounds
        assert {e["size"] for e in mine} == {256 * (t + 1)}
        assert {e["frames"][0]["name"] for e in mine} == {"_worker"}
    # each thread's events alternate alloc, free at one address: none lost, none doubled
    for t in range(threads):
        actions = [e["action"] for e in events if e["tag"] == f"t{t}"]
        assert actions == ["alloc", "free"] * rounds
    assert history.snapshot()["segments"] == []
    res.set_history(None)
    pool.close()


def test_forget_device_frees_what_a_rebuild_took(host_driver: Any) -> None:
    res, pool = _resource("direct", host_driver)
    history = MemoryHistory()
    res.set_history(history)
    block = res.allocate(1024)
    assert history.forget_device(1, "context rebuilt") == 0  # another device: nothing
    assert history.forget_device(0, "context rebuilt") == 1
    last = history.events()[-1]
    assert (last["action"], last["addr"], last["frames"], last["note"]) == ("free", block.ptr, [], "context rebuilt")
    assert history.snapshot()["segments"] == []
    history.clear()
    assert len(history) == 0 and history.recorded == 0
    res.set_history(None)
    res.deallocate(block)
    pool.close()


def test_capture_frames_is_bounded_and_frame_line_matches_f_lineno() -> None:
    def deep(n: int) -> tuple[Any, int]:
        if n:
            return deep(n - 1)
        frame = sys._getframe()
        return capture_frames(frame, 3), frame.f_lineno

    frames, line = deep(10)
    assert len(frames) == 3
    assert frame_line(*frames[0]) == line
    assert capture_frames(None) == ()


try:
    import torch  # noqa: F401
    from torch.cuda import _memory_viz

    TORCH_REASON = None
except ImportError:
    TORCH_REASON = "PyTorch is not installed"


@pytest.mark.skipif(TORCH_REASON is not None, reason=TORCH_REASON or "")
def test_pytorch_viewer_code_reads_the_snapshot(host_driver: Any, tmp_path: Path) -> None:
    res, pool = _resource("async", host_driver)
    history = MemoryHistory()
    res.set_history(history)
    lines: list[int] = []
    a, b, c = _known_sequence(res, lines)
    path = tmp_path / "snap.pickle"
    history.dump(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    summary = _memory_viz.segsum(snap)  # asserts that every segment adds up
    assert "segments: 1" in summary
    text = _memory_viz.trace(snap)
    assert "7 entries" in text and "del " in text and "free completed" in text
    for page in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap)):
        assert "snapshot.pickle" in page
    res.set_history(None)
    res.deallocate(c)
    pool.close()
