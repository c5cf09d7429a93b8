"""A graph replay's tracking records one event for all the blocks it used, on both drivers where
it can be seen; the shared event stays with its holders until the last one lets it go, so a
reader of one block still waits for the replay after another block moved on."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.driver.host.stream import HostStream

N = 1 << 12  # bytes per block


def _alloc(device: pykka.ActorRef[Any]) -> xa.GpuRef:
    return cast(xa.GpuRef, device.ask(xa.Allocate(N)))


def test_a_replay_records_one_event_for_every_block_it_wrote(host_device: pykka.ActorRef[Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [_alloc(host_device) for _ in range(6)]
    writer = xa.CopyActor.start(host_device)
    for ref in blocks:  # each block used on another stream first: each has a last write of its own
        writer.ask(xa.Fill(ref, 0))
    graph = xa.BatchGraph.record(host_device, [[xa.Fill(ref, 1)] for ref in blocks])
    graph.replay().wait()  # the first replay moves every block onto the graph's event
    records: list[object] = []
    real = HostStream.record

    def spy(self: HostStream, event: Any) -> None:
        records.append(event)
        real(self, event)

    monkeypatch.setattr(HostStream, "record", spy)
    for _ in range(3):
        records.clear()
        graph.replay().wait()
        # one record for the six blocks' last write, one for the replay's completion
        assert len(records) == 2, f"a replay recorded {len(records)} events for 6 blocks"
    assert all(ref.last_write_stream == graph.stream_id for ref in blocks)


def test_a_shared_event_outlives_the_block_that_let_it_go(host_driver: xa.HostDriver,
                                                          stop_actors: None) -> None:
    """x and y share the replay's event. x is written elsewhere (letting it go), then a new
    block's first use takes an event from the pool. y's reader must still wait for the slow
    replay: had the event gone back to the pool with x, it would be recorded again on the
    allocation stream (at once) and the reader would read y before the replay wrote it."""
    device = xa.DeviceActor.start(0, host_driver)
    x, y = _alloc(device), _alloc(device)
    writer = xa.CopyActor.start(device)
    writer.ask(xa.Fill(x, 0))
    writer.ask(xa.Fill(y, 0))
    writer.ask(xa.CopyToHost(y, nbytes=4))  # both fills landed
    graph = xa.BatchGraph.record(device, [[xa.Fill(x, 1)], [xa.Fill(y, 1)]])
    stream = x.context.runtime.stream_pool.resolve(graph.stream_id)
    host_driver.sleep(stream, 300_000)
    done = graph.replay()
    writer.ask(xa.Fill(x, 2))  # x moves on: waits for the replay, and lets the shared event go
    z = _alloc(device)
    other = xa.CopyActor.start(device)
    other.ask(xa.Fill(z, 3))  # z's first use elsewhere takes an event from the pool
    reader = xa.CopyActor.start(device)
    got = set(np.frombuffer(reader.ask(xa.CopyToHost(y)), np.uint8).tolist())
    done.wait()
    assert got == {1}, "y's reader did not wait for the replay that wrote it"
