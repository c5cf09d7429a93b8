"""BatchGraph.derive on both drivers: a graph of the same stages bound otherwise, recorded as its
own device graph on the same stream; each replays its own arrangement, the two stay ordered by
their stream and tracked, and bad input is refused with nothing recorded and nothing changed."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.messages import AllocatePinned
from xlog_actors.driver.kernel_library import SCALE_ADD_F32, launch_shape

N = 1 << 12  # float32 elements per buffer


def _pinned(device: pykka.ActorRef[Any], value: float = 0.0, n: int = N) -> xa.PinnedBuffer:
    buf = cast(xa.PinnedBuffer, device.ask(AllocatePinned(4 * n)))
    buf.array(np.float32)[:] = value
    return buf


def _values(buf: xa.PinnedBuffer) -> set[float]:
    return set(buf.array(np.float32).tolist())


class _Job:
    """``lanes`` lanes, lane k: host_in[k] (holding k + 1) -> inp[k], out[k] = 2 * inp[k] + 1,
    out[k] -> host_out[k]."""

    def __init__(self, device: pykka.ActorRef[Any], lanes: int = 1) -> None:
        self.device = device
        self.inp = [cast(xa.GpuRef, device.ask(xa.Allocate(4 * N))) for _ in range(lanes)]
        self.out = [cast(xa.GpuRef, device.ask(xa.Allocate(4 * N))) for _ in range(lanes)]
        self.host_in = [_pinned(device, k + 1.0) for k in range(lanes)]
        self.host_out = [_pinned(device) for _ in range(lanes)]
        grid, block = launch_shape(N)
        self.graph = xa.BatchGraph.record(device, [[
            xa.CopyToDevice(self.inp[k], self.host_in[k]),
            xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(self.out[k]), xa.In(self.inp[k]), 2.0, 1.0, N]),
            xa.CopyToHost(self.out[k], out=self.host_out[k]),
        ] for k in range(lanes)])


def _spy(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``driver.record_graph`` calls from now on (in a one-element list)."""
    calls = [0]
    real = driver.record_graph

    def spy(ordinal: int, steps: Any, lanes: Any = None) -> Any:
        calls[0] += 1
        return real(ordinal, steps, lanes)

    monkeypatch.setattr(driver, "record_graph", spy)
    return calls


def test_each_derived_graph_replays_its_own_arrangement_on_the_same_stream(device: pykka.ActorRef[Any]) -> None:
    job = _Job(device)
    inputs = [job.host_in[0], _pinned(device, 5.0), _pinned(device, 7.0)]
    outputs = [job.host_out[0], _pinned(device), _pinned(device)]
    derived = [job.graph] + [job.graph.derive({job.host_in[0]: inputs[k], job.host_out[0]: outputs[k]})
                             for k in (1, 2)]
    assert {g.stream_id for g in derived} == {job.graph.stream_id}
    for rounds in range(2):
        for k in (2, 0, 1):
            inputs[k].array(np.float32)[:] = 10.0 * rounds + k
            derived[k].replay().wait()
            assert _values(outputs[k]) == {2.0 * (10.0 * rounds + k) + 1}
            assert job.out[0].last_write_stream == job.graph.stream_id
    derived[0].close()  # closing one leaves the others
    derived[1].replay().wait()
    assert not derived[1].closed
    for g in derived[1:]:
        g.close()


def test_a_derived_graph_starts_from_the_bindings_of_now(device: pykka.ActorRef[Any]) -> None:
    job = _Job(device)
    other = _pinned(device, 4.0)
    job.graph.replay({job.host_in[0]: other}).wait()
    twin = job.graph.derive({})
    job.host_out[0].array(np.float32)[:] = 0
    twin.replay().wait()
    assert _values(job.host_out[0]) == {9.0}, "the derived graph read the recorded input, not the bound one"
    back = job.graph.derive({job.host_in[0]: job.host_in[0]})  # bound back to the recorded one
    back.replay().wait()
    assert _values(job.host_out[0]) == {3.0}


def test_replays_of_a_graph_and_its_derived_one_stay_in_stream_order(device: pykka.ActorRef[Any]) -> None:
    """The derived graph writes what the first one read: on the one stream, each replay sees the
    one before it, many times over without waiting in between."""
    job = _Job(device)
    grid, block = launch_shape(N)
    host = _pinned(device, 1.0)
    acc = cast(xa.GpuRef, device.ask(xa.Allocate(4 * N)))
    step = xa.BatchGraph.record(device, [
        xa.CopyToDevice(acc, host),
        xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(acc), xa.In(acc), 1.0, 1.0, N]),
        xa.CopyToHost(acc, out=host),
    ])
    other = step.derive({})
    done = None
    for k in range(20):
        done = (step if k % 2 else other).replay()
    assert done is not None
    done.wait()
    assert _values(host) == {21.0}
    job.graph.close()


def test_bad_derivations_are_refused_and_record_nothing(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    device = xa.DeviceActor.start(0, driver)
    try:
        job = _Job(device)
        calls = _spy(driver, monkeypatch)
        bigger = cast(xa.GpuRef, device.ask(xa.Allocate(4 * N + 256)))
        released = cast(xa.GpuRef, device.ask(xa.Allocate(4 * N)))
        released.release()
        cases: list[tuple[dict[Any, Any], type[Exception], str]] = [
            ({job.out[0]: bigger}, xa.InvalidRequest, "keep their sizes"),
            ({job.out[0]: released}, xa.GpuRefStale, "GpuRef stale"),
            ({job.host_in[0]: _pinned(device, n=N // 2)}, xa.InvalidRequest, "keep their sizes"),
            ({job.host_in[0]: b"pageable"}, xa.InvalidRequest, "PinnedBuffer"),
            ({bigger: job.out[0]}, xa.InvalidRequest, "no stage"),
        ]
        for bind, error, words in cases:
            with pytest.raises(error, match=words):
                job.graph.derive(bind)
        assert calls[0] == 0, "a refused derivation recorded a graph"
        job.graph.replay().wait()
        assert _values(job.host_out[0]) == {3.0}, "a refused derivation changed the graph"
        job.inp[0].release()  # a stale handle the graph names: refused before recording
        with pytest.raises(xa.GpuRefStale):
            job.graph.derive({})
        assert calls[0] == 0
        job.graph.close()
        with pytest.raises(xa.InvalidRequest, match="closed"):
            job.graph.derive({})
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_derivation_that_would_cross_lanes_is_refused(device: pykka.ActorRef[Any]) -> None:
    job = _Job(device, lanes=2)
    with pytest.raises(xa.InvalidRequest, match="lane"):
        job.graph.derive({job.out[1]: job.out[0]})
    job.graph.replay().wait()
    assert _values(job.host_out[0]) == {3.0} and _values(job.host_out[1]) == {5.0}


def test_after_a_rebuild_deriving_is_stale(device: pykka.ActorRef[Any]) -> None:
    job = _Job(device)
    derived = job.graph.derive({})
    device.ask(xa.Rebuild("test: rebuild before deriving"))
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        job.graph.derive({})
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        derived.replay()
    assert job.graph.closed and derived.closed
