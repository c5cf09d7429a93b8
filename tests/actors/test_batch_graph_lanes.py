"""BatchGraph lanes, on both drivers: several chains of stages recorded as one graph give every
lane its own result replay after replay, under bindings that move buffers between lanes; a lane
that would write what another lane names is refused at recording (nothing recorded) and at
binding (the graph keeps replaying its previous bindings); a graph of one list is one lane."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import batch_graph, graph_lanes
from xlog_actors.actors.batch_graph import Stage
from xlog_actors.actors.messages import AllocatePinned, Attach
from xlog_actors.driver.kernel_library import AXPY_F32, SCALE_ADD_F32, launch_shape

N = 1 << 10  # float32 elements per buffer


def _alloc(device: pykka.ActorRef[Any]) -> xa.GpuRef:
    return cast(xa.GpuRef, device.ask(xa.Allocate(4 * N)))


def _pinned(device: pykka.ActorRef[Any], values: float | None = None) -> xa.PinnedBuffer:
    buf = cast(xa.PinnedBuffer, device.ask(AllocatePinned(4 * N)))
    if values is not None:
        buf.array(np.float32)[:] = values
    return buf


def _values(buf: xa.PinnedBuffer) -> set[float]:
    return set(buf.array(np.float32).tolist())


class _Lanes:
    """``count`` lanes, lane ``k``: host_in[k] (holding k + 1) -> inp[k], out[k] = 2 * inp[k] + 1,
    out[k] -> host_out[k]; every buffer its lane's own."""

    def __init__(self, device: pykka.ActorRef[Any], count: int) -> None:
        self.device = device
        self.inp = [_alloc(device) for _ in range(count)]
        self.out = [_alloc(device) for _ in range(count)]
        self.host_in = [_pinned(device, k + 1.0) for k in range(count)]
        self.host_out = [_pinned(device, 0.0) for _ in range(count)]

    def lane(self, k: int) -> list[Any]:
        grid, block = launch_shape(N)
        return [
            xa.CopyToDevice(self.inp[k], self.host_in[k]),
            xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(self.out[k]), xa.In(self.inp[k]), 2.0, 1.0, N]),
            xa.CopyToHost(self.out[k], out=self.host_out[k]),
        ]

    def record(self) -> xa.BatchGraph:
        return xa.BatchGraph.record(self.device, [self.lane(k) for k in range(len(self.inp))])

    def clear_outputs(self) -> None:
        for buf in self.host_out:
            buf.array(np.float32)[:] = 0.0


def _streams(device: pykka.ActorRef[Any]) -> int:
    return len(cast(Any, device.ask(Attach())).runtime.stream_pool.ids())


def _spy_lanes(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``lanes`` of every ``driver.record_graph`` call from now on, in order (the graphs
    still recorded by the driver)."""
    asked: list[Any] = []
    real = driver.record_graph

    def spy(ordinal: int, steps: Any, lanes: Any = None) -> Any:
        asked.append(lanes)
        return real(ordinal, steps, lanes)

    monkeypatch.setattr(driver, "record_graph", spy)
    return asked


def test_each_lane_gets_its_own_result_as_inputs_rotate_between_lanes(device: pykka.ActorRef[Any]) -> None:
    """Three lanes, six replays, each binding lane k's input to another lane's recorded input
    (inputs are only read, so lanes may share them): every lane's output is computed from the
    input bound to it at that replay."""
    job = _Lanes(device, 3)
    graph = job.record()
    graph.replay().wait()
    assert [_values(b) for b in job.host_out] == [{3.0}, {5.0}, {7.0}]
    for r in range(1, 7):
        job.clear_outputs()
        sources = [(k + r) % 3 for k in range(3)]
        graph.replay({job.host_in[k]: job.host_in[s] for k, s in enumerate(sources)}).wait()
        assert [_values(b) for b in job.host_out] == [{2.0 * (s + 1) + 1} for s in sources], f"replay {r}"
    job.clear_outputs()
    graph.replay({job.host_in[k]: job.host_in[2] for k in range(3)}).wait()  # one input, every lane
    assert [_values(b) for b in job.host_out] == [{7.0}] * 3
    graph.close()


def test_outputs_swapped_between_lanes_land_swapped(device: pykka.ActorRef[Any]) -> None:
    """Two lanes whose host outputs are bound to each other's in one binding (no lane writes what
    the other then names): each result lands in the other's buffer, and the swap stays."""
    job = _Lanes(device, 2)
    graph = job.record()
    h0, h1 = job.host_out
    for _ in range(2):
        job.clear_outputs()
        graph.replay({h0: h1, h1: h0}).wait()
        assert _values(h0) == {5.0} and _values(h1) == {3.0}
    graph.replay({h0: h0, h1: h1}).wait()
    assert _values(h0) == {3.0} and _values(h1) == {5.0}
    graph.close()


def test_a_handle_that_several_lanes_only_read_is_allowed(device: pykka.ActorRef[Any]) -> None:
    """Lanes may share what they only read: two kernels reading one handle, two copies from one
    pinned buffer, in different lanes, record and replay with each lane's own result."""
    shared, host = _alloc(device), _pinned(device, 4.0)
    outs = [_alloc(device) for _ in range(2)]
    backs = [_pinned(device) for _ in range(2)]
    grid, block = launch_shape(N)
    setup = xa.BatchGraph.record(device, [xa.CopyToDevice(shared, host)])
    setup.replay().wait()
    lanes: list[list[Stage]] = [
        [xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(outs[k]), xa.In(shared), float(k + 1), 0.0, N]),
         xa.CopyToHost(outs[k], out=backs[k])]
        for k in range(2)
    ]
    graph = xa.BatchGraph.record(device, lanes)
    graph.replay().wait()
    assert _values(backs[0]) == {4.0} and _values(backs[1]) == {8.0}
    for buf in backs:
        buf.array(np.float32)[:] = 0.0
    copies: list[list[Stage]] = [[xa.CopyToDevice(outs[k], host), xa.CopyToHost(outs[k], out=backs[k])]
                                 for k in range(2)]
    twice = xa.BatchGraph.record(device, copies)
    assert twice.lanes == (2, 2)
    twice.replay().wait()
    assert _values(backs[0]) == {4.0} and _values(backs[1]) == {4.0}
    for g in (setup, graph, twice):
        g.close()


def test_lanes_stages_and_repr(driver: xa.Driver, device: pykka.ActorRef[Any],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``lanes`` counts each lane's stages, ``stages`` is every lane's stages one lane after the
    other, the repr says the lanes, and the driver's graph is recorded with those lanes."""
    job = _Lanes(device, 3)
    asked = _spy_lanes(driver, monkeypatch)
    lanes = [job.lane(0), job.lane(1)[:2], job.lane(2)[:1]]
    graph = xa.BatchGraph.record(device, lanes)
    assert graph.lanes == (3, 2, 1)
    assert len(graph.stages) == 6
    assert all(a is b for a, b in zip(graph.stages, [s for lane in lanes for s in lane], strict=True))
    assert "stages=6, lanes=3" in repr(graph)
    assert list(asked[-1]) == [3, 2, 1]
    graph.close()
    assert "lanes=3" in repr(graph) and "closed" in repr(graph)


@pytest.mark.parametrize("form", ["flat", "one-list"])
def test_a_graph_of_one_lane_is_unaffected(driver: xa.Driver, device: pykka.ActorRef[Any],
                                           monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """A flat list of stages, or one list of them, is one lane of every stage: ``lanes`` is one
    count, no ``lanes=`` in the repr, the driver's graph recorded without lanes, and bindings
    that within one lane name one buffer twice (an input bound to the buffer its output lands
    in) are not lane conflicts."""
    job = _Lanes(device, 1)
    asked = _spy_lanes(driver, monkeypatch)
    graph = xa.BatchGraph.record(device, job.lane(0) if form == "flat" else [job.lane(0)])
    assert graph.lanes == (3,) and len(graph.stages) == 3
    assert "lanes=" not in repr(graph) and "stages=3" in repr(graph)
    assert asked == [None]
    graph.replay().wait()
    assert _values(job.host_out[0]) == {3.0}
    graph.replay({job.host_in[0]: job.host_out[0]}).wait()  # reads 3.0, writes 7.0 into the same buffer
    assert _values(job.host_out[0]) == {7.0}
    graph.close()


# -- refusals at recording ------------------------------------------------------------------------
def _conflicts(job: _Lanes, other: xa.GpuRef) -> dict[str, list[list[Any]]]:
    """Lane sets of which one lane writes what another names (lane 0 is ``job``'s lane 0)."""
    grid, block = launch_shape(N)
    lane0 = job.lane(0)
    spare = job.host_out[1]
    return {
        "fill-of-an-input-another-lane-reads": [lane0, [xa.Fill(job.inp[0], 0)]],
        "kernel-out-into-an-input-another-lane-reads": [
            lane0, [xa.Launch(SCALE_ADD_F32, grid, block, [xa.Out(job.inp[0]), xa.In(other), 1.0, 0.0, N])]],
        "kernel-inout-of-another-lanes-output": [
            [xa.Launch(AXPY_F32, grid, block, [xa.InOut(job.out[0]), xa.In(other), 1.0, N])], lane0],
        "device-copy-into-another-lanes-input": [lane0, [xa.CopyDeviceToDevice(other, job.inp[0])]],
        "copy-in-to-another-lanes-output": [[xa.CopyToDevice(job.out[0], spare)], lane0],
        "a-read-in-a-later-lane-of-what-an-earlier-writes": [lane0, [xa.CopyToHost(job.out[0], out=spare)]],
        "a-write-in-a-later-lane-of-what-an-earlier-only-reads": [
            [xa.CopyToHost(other, out=spare)], [xa.Fill(other, 0)]],
        "two-lanes-copying-into-one-pinned-buffer": [
            lane0, [xa.CopyToHost(other, out=job.host_out[0])]],
        "copy-out-into-a-pinned-buffer-another-lane-copies-from": [
            lane0, [xa.CopyToHost(other, out=job.host_in[0])]],
    }


CONFLICTS = [
    "fill-of-an-input-another-lane-reads",
    "kernel-out-into-an-input-another-lane-reads",
    "kernel-inout-of-another-lanes-output",
    "device-copy-into-another-lanes-input",
    "copy-in-to-another-lanes-output",
    "a-read-in-a-later-lane-of-what-an-earlier-writes",
    "a-write-in-a-later-lane-of-what-an-earlier-only-reads",
    "two-lanes-copying-into-one-pinned-buffer",
    "copy-out-into-a-pinned-buffer-another-lane-copies-from",
]


@pytest.mark.parametrize("case", CONFLICTS)
def test_a_lane_writing_what_another_names_is_refused_and_nothing_is_recorded(
    driver: xa.Driver, device: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """InvalidRequest at recording, before the graph's stream is taken or the driver asked for a
    graph; the same stages as one lane (ordered) record and run."""
    job = _Lanes(device, 2)
    other = _alloc(device)
    lanes = _conflicts(job, other)[case]
    asked = _spy_lanes(driver, monkeypatch)
    streams = _streams(device)
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        xa.BatchGraph.record(device, lanes)
    assert asked == [], "the driver was asked for a graph"
    assert _streams(device) == streams, "a refused recording took a stream"
    ordered = xa.BatchGraph.record(device, [stage for lane in lanes for stage in lane])
    ordered.replay().wait()
    assert ordered.lanes == (len(ordered.stages),)
    ordered.close()


def test_the_lane_check_is_what_refuses_a_conflict(
    device: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the lane check switched off the conflicting recording is accepted: the refusals above
    come from that check, not from another rule the stages break."""
    job = _Lanes(device, 2)
    other = _alloc(device)
    monkeypatch.setattr(batch_graph, "check_apart", lambda slots: None)
    for case in CONFLICTS:
        xa.BatchGraph.record(device, _conflicts(job, other)[case]).close()


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_an_empty_lane_is_refused_and_nothing_is_recorded(
    device: pykka.ActorRef[Any], empty: Any, where: int
) -> None:
    """An empty lane anywhere is InvalidRequest naming it, with no stream taken; a later good
    recording works."""
    job = _Lanes(device, 2)
    lanes: list[Any] = [job.lane(0), job.lane(1)]
    lanes.insert(where, empty)
    streams = _streams(device)
    with pytest.raises(xa.InvalidRequest, match=f"lane {where} has no stages"):
        xa.BatchGraph.record(device, lanes)
    assert _streams(device) == streams
    graph = job.record()
    graph.replay().wait()
    assert [_values(b) for b in job.host_out] == [{3.0}, {5.0}]
    graph.close()


def test_a_single_empty_lane_is_refused(device: pykka.ActorRef[Any]) -> None:
    """``[[]]``: one lane of no stages is refused as such."""
    with pytest.raises(xa.InvalidRequest, match="lane 0 has no stages"):
        xa.BatchGraph.record(device, [[]])


# -- refusals at binding --------------------------------------------------------------------------
def _refused_binds(job: _Lanes) -> dict[str, dict[Any, Any]]:
    """Bindings that would have one lane write what another names, or name what another writes."""
    return {
        # lane 0's copy back into the buffer lane 1 copies back into
        "output-into-another-lanes-output": {job.host_out[0]: job.host_out[1]},
        # lane 1's copy in from the buffer lane 0 copies back into
        "input-from-another-lanes-output": {job.host_in[1]: job.host_out[0]},
        # lane 0's copy back into the buffer lane 1 copies in from
        "output-into-another-lanes-input": {job.host_out[0]: job.host_in[1]},
        # lane 0's kernel output onto the handle lane 1 reads and writes
        "device-output-onto-another-lanes-input": {job.out[0]: job.inp[1]},
        # lane 1's input handle onto lane 0's output handle
        "device-input-onto-another-lanes-output": {job.inp[1]: job.out[0]},
        # two outputs bound to one new buffer at once
        "two-outputs-into-one-new-buffer": {job.host_out[0]: job.host_in[2], job.host_out[1]: job.host_in[2]},
        # lane 0's copy back and lane 1's copy in bound to one new buffer at once, in either order
        "an-output-and-another-lanes-input-into-one-new-buffer": {
            job.host_out[0]: job.host_in[2], job.host_in[1]: job.host_in[2]},
        "an-input-and-another-lanes-output-into-one-new-buffer": {
            job.host_in[1]: job.host_in[2], job.host_out[0]: job.host_in[2]},
        # a good binding beside a bad one: neither is applied
        "a-good-binding-beside-a-bad-one": {job.host_in[0]: job.host_in[0], job.host_out[1]: job.host_out[0]},
    }


REFUSED_BINDS = [
    "output-into-another-lanes-output",
    "input-from-another-lanes-output",
    "output-into-another-lanes-input",
    "device-output-onto-another-lanes-input",
    "device-input-onto-another-lanes-output",
    "two-outputs-into-one-new-buffer",
    "an-output-and-another-lanes-input-into-one-new-buffer",
    "an-input-and-another-lanes-output-into-one-new-buffer",
    "a-good-binding-beside-a-bad-one",
]


@pytest.mark.parametrize("case", REFUSED_BINDS)
def test_a_binding_across_lanes_is_refused_and_the_previous_bindings_stay(
    device: pykka.ActorRef[Any], case: str
) -> None:
    """Two lanes, lane 0's input bound away from its recorded buffer first; a binding that would
    have the lanes share memory one of them writes is InvalidRequest, and the next replay still
    runs the previous bindings (lane 0 reads the third buffer, every result lands where it did)."""
    job = _Lanes(device, 3)  # lane 2's buffers only serve as spares
    graph = xa.BatchGraph.record(device, [job.lane(0), job.lane(1)])
    graph.replay({job.host_in[0]: job.host_in[2]}).wait()
    assert [_values(b) for b in job.host_out[:2]] == [{7.0}, {5.0}]
    before = [b.array(np.float32).copy() for b in (*job.host_in, job.host_out[2])]
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay(_refused_binds(job)[case])
    job.clear_outputs()
    graph.replay().wait()
    assert [_values(b) for b in job.host_out[:2]] == [{7.0}, {5.0}], "a refused binding changed the graph"
    after = [b.array(np.float32) for b in (*job.host_in, job.host_out[2])]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), "a refused binding wrote a buffer"
    graph.close()


def test_the_bind_check_is_what_refuses_a_binding_across_lanes(
    device: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the binding's lane check switched off, the binding of lane 0's copy back into lane
    1's is accepted, and the two lanes' results then land in one buffer: what the refusal
    prevents."""
    job = _Lanes(device, 2)
    graph = job.record()
    monkeypatch.setattr(graph_lanes.LaneIndex, "check", lambda self, changed, bound: None)
    graph.replay({job.host_out[0]: job.host_out[1]}).wait()
    assert _values(job.host_out[0]) == {0.0}, "lane 0's result did not land in its own buffer"
    assert _values(job.host_out[1]) <= {3.0, 5.0}, "both lanes' results land in one buffer"
    graph.close()


def test_the_bindings_are_judged_by_what_each_lane_names_now(device: pykka.ActorRef[Any]) -> None:
    """Lane 0's output bound to a fresh buffer: lane 1 may then read lane 0's recorded output
    buffer (no lane writes it any more), but not the fresh one (lane 0 writes it now)."""
    job = _Lanes(device, 2)
    fresh = _pinned(device)
    graph = job.record()
    graph.replay({job.host_out[0]: fresh}).wait()
    assert _values(fresh) == {3.0}
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay({job.host_in[1]: fresh})
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay({job.host_out[1]: fresh})
    job.host_out[0].array(np.float32)[:] = 10.0
    graph.replay({job.host_in[1]: job.host_out[0]}).wait()  # lane 1 reads 10.0
    assert _values(job.host_out[1]) == {21.0} and _values(fresh) == {3.0}
    graph.replay({job.host_out[0]: job.host_out[0], job.host_in[1]: job.host_in[1]}).wait()
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay({job.host_in[1]: job.host_out[0]})  # lane 0 writes it again
    graph.replay({job.host_in[1]: fresh}).wait()  # and no lane writes the fresh one any more
    assert _values(job.host_out[1]) == {7.0}
    graph.close()


def test_a_writer_moved_away_and_a_reader_moved_in_by_one_binding_is_allowed(device: pykka.ActorRef[Any]) -> None:
    """One binding moves lane 0's copy back to a fresh buffer and lane 1's copy in onto the
    buffer lane 0 copied back into until then: after it no lane writes what another names, so it
    is accepted, and lane 1 reads what lane 0 left there at the replay before."""
    job = _Lanes(device, 2)
    fresh = _pinned(device)
    graph = job.record()
    graph.replay().wait()
    assert _values(job.host_out[0]) == {3.0}
    graph.replay({job.host_out[0]: fresh, job.host_in[1]: job.host_out[0]}).wait()
    assert _values(fresh) == {3.0} and _values(job.host_out[1]) == {7.0}
    # the writer alone back where lane 1 now reads: refused
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay({job.host_out[0]: job.host_out[0]})
    graph.replay({job.host_out[0]: job.host_out[0], job.host_in[1]: job.host_in[1]}).wait()
    assert _values(job.host_out[0]) == {3.0} and _values(job.host_out[1]) == {5.0}
    graph.close()


def test_lanes_mixed_with_bare_stages_are_refused(device: pykka.ActorRef[Any]) -> None:
    """A list of stages that holds a list among them is neither one lane nor lanes: the list is
    refused as a stage of no known type, and nothing is recorded."""
    ref = _alloc(device)
    streams = _streams(device)
    for stages in ([[xa.Fill(ref, 1)], xa.Fill(ref, 2)], [xa.Fill(ref, 2), [xa.Fill(ref, 1)]]):
        with pytest.raises(xa.InvalidRequest, match="got list"):
            xa.BatchGraph.record(device, cast(Any, stages))
    assert _streams(device) == streams


def test_a_host_binding_replays_as_its_mapping_does(device: pykka.ActorRef[Any]) -> None:
    """Prepared bindings of the three rotations, replayed in turn, several rounds (on CUDA the
    later rounds take the compiled path): each replay gives what the same mapping gives."""
    job = _Lanes(device, 3)
    graph = job.record()
    prepared = [graph.host_binding({job.host_in[k]: job.host_in[(k + r) % 3] for k in range(3)}) for r in range(3)]
    for _ in range(3):
        for r, binding in enumerate(prepared):
            job.clear_outputs()
            graph.replay(binding).wait()
            assert [_values(b) for b in job.host_out] == [{2.0 * ((k + r) % 3 + 1) + 1} for k in range(3)]
    graph.replay({}).wait()  # the last binding stays, as a mapping's does
    assert [_values(b) for b in job.host_out] == [{2.0 * ((k + 2) % 3 + 1) + 1} for k in range(3)]
    assert "3 buffers" in repr(prepared[0])


def test_a_host_binding_refuses_what_a_mapping_refuses(device: pykka.ActorRef[Any]) -> None:
    """Made with an operand no stage names, a handle, a buffer of another size: refused when
    prepared. Replayed on another graph, or after its buffer was released: refused at the
    replay, which changes nothing (the next replay gives the old bindings' bytes)."""
    job = _Lanes(device, 2)
    graph = job.record()
    other = _Lanes(device, 2).record()
    with pytest.raises(xa.InvalidRequest, match="no operand of the graph"):
        graph.host_binding({_pinned(device): job.host_in[0]})
    with pytest.raises(xa.InvalidRequest, match="binds pinned buffers"):
        graph.host_binding(cast(Any, {job.inp[0]: job.inp[1]}))
    small = cast(xa.PinnedBuffer, device.ask(AllocatePinned(8)))
    with pytest.raises(xa.InvalidRequest, match="bytes"):
        graph.host_binding({job.host_in[0]: small})
    swap = graph.host_binding({job.host_in[0]: job.host_in[1], job.host_in[1]: job.host_in[0]})
    with pytest.raises(xa.InvalidRequest, match="another graph"):
        other.replay(swap)
    spare = _pinned(device, 9.0)
    gone = graph.host_binding({job.host_in[0]: spare})
    spare.release()
    with pytest.raises(xa.InvalidRequest, match="released"):
        graph.replay(gone)
    job.clear_outputs()
    graph.replay().wait()
    assert [_values(b) for b in job.host_out] == [{3.0}, {5.0}]
    graph.replay(swap).wait()
    assert [_values(b) for b in job.host_out] == [{5.0}, {3.0}]


def test_a_host_binding_across_lanes_is_refused_at_its_replay(device: pykka.ActorRef[Any]) -> None:
    """A prepared binding is judged against the other bindings at each replay: lane 1's input
    bound to the buffer lane 0 copies into is refused, and the graph keeps its bindings."""
    job = _Lanes(device, 2)
    graph = job.record()
    crossing = graph.host_binding({job.host_in[1]: job.host_out[0]})
    with pytest.raises(xa.InvalidRequest, match="lanes run at the same time"):
        graph.replay(crossing)
    job.clear_outputs()
    graph.replay().wait()
    assert [_values(b) for b in job.host_out] == [{3.0}, {5.0}]


def test_a_host_binding_of_a_closed_graph_is_refused(device: pykka.ActorRef[Any]) -> None:
    """A closed graph prepares nothing."""
    job = _Lanes(device, 1)
    graph = job.record()
    graph.close()
    with pytest.raises(xa.InvalidRequest, match="closed"):
        graph.host_binding({job.host_in[0]: _pinned(device)})
