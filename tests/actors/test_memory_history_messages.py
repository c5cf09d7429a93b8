"""RecordMemoryHistory and GetMemorySnapshot: the asker's stack on each event (the actor serves
the request on its own thread), bad input changing nothing, and recording across a rebuild."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.memory.history import ORIGIN_CAPTURE

pytestmark = pytest.mark.usefixtures("stop_actors")

THIS_FILE = str(Path(__file__).resolve())


def _trace(device: pykka.ActorRef[Any]) -> list[dict[str, Any]]:
    snap = device.ask(xa.GetMemorySnapshot())
    return snap["device_traces"][0] if snap["device_traces"] else []


def _asks(device: pykka.ActorRef[Any], lines: list[int]) -> list[xa.GpuRef]:
    """An Allocate, an AllocateMany of two and a Free, each on a noted line."""
    lines.append(sys._getframe().f_lineno + 1)
    one = device.ask(xa.Allocate(4096, tag=xa.AllocTag("weights")))
    lines.append(sys._getframe().f_lineno + 1)
    many = device.ask(xa.AllocateMany([512, 1024], tag=xa.AllocTag("activations")))
    lines.append(sys._getframe().f_lineno + 1)
    device.ask(xa.Free(many[0]))
    return [one, *many]


def test_off_by_default_and_an_empty_snapshot(host_device: pykka.ActorRef[Any]) -> None:
    device = host_device
    device.ask(xa.Allocate(256))
    snap = device.ask(xa.GetMemorySnapshot())
    assert snap["segments"] == [] and snap["device_traces"] == []
    assert ORIGIN_CAPTURE[0] == 0, "messages capture no stack while nothing records"
    assert xa.Allocate(256).origin is None


def test_each_event_carries_the_askers_stack(host_device: pykka.ActorRef[Any]) -> None:
    device = host_device
    assert device.ask(xa.RecordMemoryHistory()) is None
    lines: list[int] = []
    one, first, second = _asks(device, lines)
    trace = _trace(device)
    assert [(e["action"], e["size"], e["tag"]) for e in trace] == [
        ("alloc", 4096, "weights"), ("alloc", 512, "activations"), ("alloc", 1024, "activations"),
        ("free_requested", 512, "activations"), ("free_completed", 512, "activations"),
    ]
    expected_lines = [lines[0], lines[1], lines[1], lines[2], lines[2]]
    for e, line in zip(trace, expected_lines, strict=True):
        top = e["frames"][0]
        assert (top["filename"], top["line"], top["name"]) == (THIS_FILE, line, "_asks")
    assert trace[0]["addr"] == one.raw_device_ptr()
    # the direct path allocates in the calling thread: its own stack
    client = device.ask(xa.GetClient())
    line = sys._getframe().f_lineno + 1
    ref = client.allocate(128, tag=xa.AllocTag("client"))
    last = _trace(device)[-1]
    assert (last["action"], last["tag"], last["frames"][0]["line"]) == ("alloc", "client", line)
    # a dropped handle is freed by the actor on its own: recorded, with no asker
    address = ref.raw_device_ptr()
    del ref
    gc.collect()
    device.ask(xa.GetStats())
    freed = [e for e in _trace(device) if e["action"] == "free_completed" and e["addr"] == address and e["size"] == 128]
    assert len(freed) == 1 and freed[0]["frames"] == []
    segments = device.ask(xa.GetMemorySnapshot())["segments"]
    assert sorted(s["address"] for s in segments) == sorted([one.raw_device_ptr(), second.raw_device_ptr()])
    del first


def test_bad_requests_change_nothing(host_device: pykka.ActorRef[Any]) -> None:
    device = host_device
    for bad in (xa.RecordMemoryHistory(enabled="yes"), xa.RecordMemoryHistory(enabled=1),  # type: ignore[arg-type]
                xa.RecordMemoryHistory(max_entries=0), xa.RecordMemoryHistory(max_entries=-5),
                xa.RecordMemoryHistory(max_entries=True), xa.RecordMemoryHistory(max_entries=2.5)):  # type: ignore[arg-type]
        with pytest.raises(xa.InvalidRequest, match="RecordMemoryHistory"):
            device.ask(bad)
    device.ask(xa.Allocate(256))
    assert device.ask(xa.GetMemorySnapshot())["device_traces"] == [], "nothing was switched on"
    device.ask(xa.RecordMemoryHistory(max_entries=50))
    held = device.ask(xa.Allocate(256))
    with pytest.raises(xa.InvalidRequest, match="max_entries"):
        device.ask(xa.RecordMemoryHistory(max_entries=0))
    snap = device.ask(xa.GetMemorySnapshot())
    assert snap["xlog_actors"]["max_entries"] == 50 and len(snap["device_traces"][0]) == 1
    with pytest.raises(xa.InvalidRequest, match="origin"):
        device.ask(xa.Allocate(256, origin="not a stack"))  # type: ignore[arg-type]
    assert len(_trace(device)) == 1
    # told, a bad one is dropped and the device lives on
    device.tell(xa.RecordMemoryHistory(enabled="no"))  # type: ignore[arg-type]
    assert device.ask(xa.GetStats()).status == "running"
    assert device.ask(xa.GetMemorySnapshot())["xlog_actors"]["max_entries"] == 50
    assert len(_trace(device)) == 1
    del held


def test_recording_survives_a_rebuild(host_device: pykka.ActorRef[Any]) -> None:
    device = host_device
    device.ask(xa.RecordMemoryHistory())
    before = device.ask(xa.Allocate(4096, tag=xa.AllocTag("old")))
    old_address = before.block.ptr
    device.ask(xa.Rebuild("test"))
    after = device.ask(xa.Allocate(2048, tag=xa.AllocTag("new")))
    client = device.ask(xa.GetClient())
    direct = client.allocate(1024, tag=xa.AllocTag("new"))
    trace = _trace(device)
    assert [(e["action"], e["size"], e["tag"]) for e in trace] == [
        ("alloc", 4096, "old"), ("free_requested", 4096, "old"), ("free_completed", 4096, "old"),
        ("alloc", 2048, "new"), ("alloc", 1024, "new"),
    ]
    assert trace[1]["addr"] == old_address and trace[1]["note"] == "context rebuilt"
    segments = device.ask(xa.GetMemorySnapshot())["segments"]
    assert sorted(s["address"] for s in segments) == sorted([after.raw_device_ptr(), direct.raw_device_ptr()])


def test_off_keeps_what_was_recorded_and_on_again_starts_afresh(host_device: pykka.ActorRef[Any]) -> None:
    device = host_device
    device.ask(xa.RecordMemoryHistory())
    assert ORIGIN_CAPTURE[0] == 1
    keep = device.ask(xa.Allocate(256))
    device.ask(xa.RecordMemoryHistory(enabled=False))
    assert ORIGIN_CAPTURE[0] == 0
    device.ask(xa.Free(keep))  # not recorded: the history is off
    assert [e["action"] for e in _trace(device)] == ["alloc"]
    device.ask(xa.RecordMemoryHistory(max_entries=10))
    assert _trace(device) == []
    held = device.ask(xa.Allocate(256))
    assert [e["action"] for e in _trace(device)] == ["alloc"]
    del held
    device.stop()
    assert ORIGIN_CAPTURE[0] == 0, "a stopped device no longer has messages capture stacks"


def test_the_origin_field_leaves_equality_alone(host_device: pykka.ActorRef[Any]) -> None:
    host_device.ask(xa.RecordMemoryHistory())
    message = xa.Allocate(64)
    assert message.origin is not None and message.origin[0][0].co_name == (
        "test_the_origin_field_leaves_equality_alone"
    )
    assert message == xa.Allocate(64, origin=None)
    assert "origin" not in repr(message)
