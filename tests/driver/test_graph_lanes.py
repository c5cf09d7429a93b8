"""Graph lanes at the driver level, on both drivers: ``check_lanes`` accepts and refuses, a graph
recorded as several lanes runs every step of every lane and says its lanes, and a bad lane list
is refused before anything is recorded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.graph import (
    DeviceToDevice,
    DeviceToHost,
    GraphStep,
    HostToDevice,
    Memset,
    check_lanes,
)

N = 1024  # float32 elements per buffer


@pytest.fixture
def bufs(graph_buffers: Any) -> Any:
    """Four pinned and four device buffers of ``N`` floats, and a stream (tests/driver/conftest.py)."""
    return graph_buffers(4, N)


def _two_lanes(b: Any) -> list[GraphStep]:
    """Lane 0 (3 steps): pinned 0 -> dev 0, dev 1 = 2 * dev 0 + 1, dev 1 -> pinned 1. Lane 1
    (3 steps): dev 2 filled with 0x3f bytes, copied to dev 3, dev 3 -> pinned 2. No lane touches
    what the other does."""
    (a, k, c, d), v = b.dev, b.views
    return [
        HostToDevice(a, v[0]), b.kernel(k, a), DeviceToHost(v[1], k),
        Memset(c, 0x3F, 4 * N), DeviceToDevice(d, c, 4 * N), DeviceToHost(v[2], d),
    ]


def test_check_lanes_accepts_positive_counts_summing_to_the_steps() -> None:
    """None is one lane of every step; a list or tuple of positive ints summing to the steps is
    those lanes, as a tuple."""
    assert check_lanes(None, 5) == (5,)
    assert check_lanes([5], 5) == (5,)
    assert check_lanes([2, 3], 5) == (2, 3)
    assert check_lanes((1, 1, 1, 1, 1), 5) == (1, 1, 1, 1, 1)
    assert isinstance(check_lanes([2, 3], 5), tuple)


@pytest.mark.parametrize(
    "lanes",
    [
        pytest.param([], id="empty-list"),
        pytest.param((), id="empty-tuple"),
        pytest.param([2, 2], id="sum-too-small"),
        pytest.param([3, 3], id="sum-too-large"),
        pytest.param([5, 0], id="a-zero-lane"),
        pytest.param([6, -1], id="a-negative-lane"),
        pytest.param([2.0, 3], id="a-float"),
        pytest.param([True, 4], id="a-bool"),
        pytest.param([np.int64(2), 3], id="a-numpy-int"),
        pytest.param("23", id="a-str"),
        pytest.param({2, 3}, id="a-set"),
        pytest.param(5, id="an-int"),
        pytest.param(iter([2, 3]), id="an-iterator"),
    ],
)
def test_check_lanes_refuses_what_is_not_positive_counts_summing_to_the_steps(lanes: Any) -> None:
    """Each kind of bad lane list (empty, wrong sum, a lane of no steps or of a non-int count, not
    a list or tuple at all) raises InvalidRequest naming the step count."""
    with pytest.raises(xa.InvalidRequest, match="summing to its 5 steps"):
        check_lanes(lanes, 5)


def test_a_graph_of_two_lanes_runs_every_step_of_each(bufs: Any) -> None:
    """Both lanes' results land, on every launch, and after a step of the second lane is
    replaced; the graph says its lanes throughout."""
    bufs.floats(0)[:] = np.arange(N)
    graph = bufs.driver.record_graph(0, _two_lanes(bufs), [3, 3])
    assert graph.lanes == (3, 3)
    for _ in range(2):
        bufs.floats(1)[:] = 0
        bufs.floats(2)[:] = 0
        bufs.run(graph)
        assert bufs.floats(1).tolist() == (np.arange(N, dtype=np.float32) * 2 + 1).tolist()
        assert bytes(bufs.views[2]) == b"\x3f" * (4 * N)
    a, _k, c, _d = bufs.dev
    graph.update(3, Memset(c, 0x01, 4 * N))  # a step of lane 1
    graph.update(1, bufs.kernel(bufs.dev[1], a, 3.0, 0.0))  # a step of lane 0
    bufs.run(graph)
    assert bytes(bufs.views[2]) == b"\x01" * (4 * N)
    assert bufs.floats(1).tolist() == (np.arange(N, dtype=np.float32) * 3).tolist()
    assert graph.lanes == (3, 3), "an update keeps the lanes"
    graph.close()


def test_a_lane_of_every_step_alone_runs_them_all(bufs: Any) -> None:
    """Four lanes of one step each (four fills, each of its own buffer) and a copy back of each
    by a second graph: every fill ran."""
    d, dev = bufs.driver, bufs.dev
    fills = d.record_graph(0, [Memset(p, 10 + i, 4 * N) for i, p in enumerate(dev)], (1, 1, 1, 1))
    assert fills.lanes == (1, 1, 1, 1)
    back = d.record_graph(0, [DeviceToHost(v, p) for v, p in zip(bufs.views, dev, strict=True)], [1, 1, 1, 1])
    bufs.run(fills)
    bufs.run(back)
    for i in range(4):
        assert bytes(bufs.views[i]) == bytes([10 + i]) * (4 * N)
    fills.close()
    back.close()


def test_a_graph_recorded_without_lanes_is_one_lane(bufs: Any) -> None:
    """No lanes, or one lane of every step: ``lanes`` is one count, the number of steps."""
    steps = _two_lanes(bufs)
    plain = bufs.driver.record_graph(0, steps)
    one = bufs.driver.record_graph(0, steps, [6])
    assert plain.lanes == (6,) and one.lanes == (6,)
    bufs.floats(0)[:] = 1.0
    bufs.run(one)
    assert set(bufs.floats(1).tolist()) == {3.0}
    plain.close()
    one.close()


@pytest.mark.parametrize(
    "lanes", [[], [3, 2], [3, 4], [3, 3, 0], [3.0, 3], (6, -0), "33"], ids=lambda lanes: repr(lanes)
)
def test_record_graph_refuses_bad_lanes_and_records_nothing(bufs: Any, lanes: Any) -> None:
    """A bad lane list is InvalidRequest from ``record_graph``, before any graph exists: the steps
    that a good recording then runs are untouched, and their memory is as the test left it."""
    bufs.floats(0)[:] = 1.0
    bufs.floats(1)[:] = -1.0
    with pytest.raises(xa.InvalidRequest, match="lanes"):
        bufs.driver.record_graph(0, _two_lanes(bufs), lanes)
    bufs.stream.synchronize()
    assert set(bufs.floats(1).tolist()) == {-1.0}, "a refused recording ran a step"
    graph = bufs.driver.record_graph(0, _two_lanes(bufs), [3, 3])
    bufs.run(graph)
    assert set(bufs.floats(1).tolist()) == {3.0}
    graph.close()


def test_bad_lanes_are_refused_after_bad_steps_are(bufs: Any) -> None:
    """A malformed step is named as such even beside good lanes; an empty step list is refused
    for its steps whatever the lanes."""
    with pytest.raises(xa.InvalidRequest, match="0..255"):
        bufs.driver.record_graph(0, [Memset(bufs.dev[0], 300, 16)], [1])
    with pytest.raises(xa.InvalidRequest, match="non-empty"):
        bufs.driver.record_graph(0, [], [1])
