"""Driver.record_graph on both drivers: steps run in order on the launch stream, a step replaced
by one of the same shape, refusals that change nothing, and a graph dead with its context."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.graph import (
    DeviceToDevice,
    DeviceToHost,
    HostToDevice,
    KernelStep,
    Memset,
    check_steps,
    same_shape,
)
from xlog_actors.driver.kernel_library import SCALE_ADD_F32

N = 4096


@pytest.fixture
def bufs(graph_buffers: Any) -> Any:
    """Three pinned and three device buffers of ``N`` floats, and a stream (tests/driver/conftest.py)."""
    return graph_buffers(3, N)


def test_steps_run_in_order_and_a_step_is_replaced(bufs: Any) -> None:
    d, (a, b, c) = bufs.driver, bufs.dev
    bufs.floats(0)[:] = np.arange(N)
    graph = d.record_graph(0, [
        HostToDevice(a, bufs.views[0]),
        bufs.kernel(b, a),
        DeviceToDevice(c, b, 4 * N),
        Memset(a, 0, 4 * N),
        DeviceToHost(bufs.views[1], c),
    ])
    graph.launch(bufs.stream)
    bufs.stream.synchronize()
    assert bufs.floats(1).tolist() == (np.arange(N, dtype=np.float32) * 2 + 1).tolist()
    bufs.floats(2)[:] = 10.0
    graph.update(0, HostToDevice(a, bufs.views[2]))
    graph.update(4, DeviceToHost(bufs.views[0], c))
    graph.launch(bufs.stream)
    bufs.stream.synchronize()
    assert set(bufs.floats(0).tolist()) == {21.0}
    assert isinstance(graph.steps[0], HostToDevice) and graph.steps[0].src is bufs.views[2]
    graph.close()
    graph.close()  # idempotent
    with pytest.raises(xa.DriverError, match="closed"):
        graph.launch(bufs.stream)


def test_a_replacement_of_another_shape_is_refused_and_changes_nothing(bufs: Any) -> None:
    d, (a, b, _c) = bufs.driver, bufs.dev
    bufs.floats(0)[:] = 1.0
    graph = d.record_graph(0, [HostToDevice(a, bufs.views[0]), bufs.kernel(b, a), DeviceToHost(bufs.views[1], b)])
    half = bufs.views[2][: 2 * N]
    for index, step, words in [
        (0, HostToDevice(a, half), "bytes differ"),
        (0, DeviceToHost(bufs.views[2], a), "cannot replace"),
        (1, KernelStep(SCALE_ADD_F32, (1, 1, 1), (32, 1, 1), (b, a, 2.0, 1.0, N)), "dimensions"),
        (3, Memset(a, 0, 4), "out of range"),
    ]:
        with pytest.raises(xa.InvalidRequest, match=words):
            graph.update(index, step)
    graph.launch(bufs.stream)
    bufs.stream.synchronize()
    assert set(bufs.floats(1).tolist()) == {3.0}
    graph.close()


def test_malformed_steps_and_pageable_memory_are_refused(bufs: Any) -> None:
    d, a = bufs.driver, bufs.dev[0]
    pageable = memoryview(bytearray(16))
    for steps, words in [
        ([], "non-empty"),
        (["copy"], "expected a graph step"),
        ([Memset(a, 300, 16)], "0..255"),
        ([Memset(a, 1, 0)], "positive"),
        ([DeviceToHost(memoryview(b"ro" * 8), a)], "read-only"),
        ([KernelStep(SCALE_ADD_F32, (1, 1), (32, 1, 1), (a, a, 1.0, 1.0, 4))], "three positive ints"),
        ([HostToDevice(a, pageable)], "pinned"),
    ]:
        with pytest.raises(xa.InvalidRequest, match=words):
            d.record_graph(0, steps)


def test_a_graph_dies_with_its_context(bufs: Any) -> None:
    d = bufs.driver
    graph = d.record_graph(0, [Memset(bufs.dev[0], 1, 16)])
    d.rebuild_context(0)
    fresh = d.create_stream(0)
    try:
        with pytest.raises(xa.DriverError, match="destroyed context"):
            graph.launch(fresh)
        with pytest.raises(xa.DriverError, match="destroyed context"):
            graph.update(0, Memset(bufs.dev[0], 2, 16))
    finally:
        fresh.close()
        graph.close()
        # the rebuild freed every allocation and stream of the old context (pinned memory stays)
        bufs.dev = []
        bufs.stream = d.create_stream(0)


def test_same_shape_and_check_steps() -> None:
    v = memoryview(bytearray(8))
    assert same_shape(Memset(1, 0, 8), Memset(2, 5, 8)) is None
    assert "bytes differ" in (same_shape(Memset(1, 0, 8), Memset(1, 0, 16)) or "")
    assert "cannot replace" in (same_shape(Memset(1, 0, 8), DeviceToDevice(1, 2, 8)) or "")
    assert check_steps([HostToDevice(1, v)]) == (HostToDevice(1, v),)


def test_update_host_replaces_a_host_side_and_refuses_the_rest(bufs: Any) -> None:
    d, (a, b, _c) = bufs.driver, bufs.dev
    bufs.floats(0)[:] = 1.0
    bufs.floats(2)[:] = 4.0
    graph = d.record_graph(0, [HostToDevice(a, bufs.views[0]), bufs.kernel(b, a), DeviceToHost(bufs.views[1], b)])
    graph.update_host(0, bufs.views[2])
    graph.update_host(0, bufs.views[2])  # the same view again: nothing to do
    graph.launch(bufs.stream)
    bufs.stream.synchronize()
    assert set(bufs.floats(1).tolist()) == {9.0}
    for index, view, words in [
        (1, bufs.views[2], "not a copy to or from the host"),
        (0, bufs.views[2][:8], "bytes differ"),
        (2, memoryview(bytes(4 * N)), "read-only"),
        (0, memoryview(bytearray(4 * N)), "pinned"),
        (5, bufs.views[2], "out of range"),
    ]:
        with pytest.raises(xa.InvalidRequest, match=words):
            graph.update_host(index, view)
    bufs.floats(1)[:] = 0
    graph.launch(bufs.stream)
    bufs.stream.synchronize()
    assert set(bufs.floats(1).tolist()) == {9.0}, "a refused update changed the graph"
    graph.close()


def test_swap_host_hands_the_replaced_view_back_and_rebinds_back_and_forth(bufs: Any) -> None:
    """swap_host returns what it replaced (None for no change, and on the host driver, whose
    copies keep their views); a view swapped in before is swapped in again by address only, and
    every launch copies from the view bound at its launch."""
    d, (a, b, _c) = bufs.driver, bufs.dev
    bufs.floats(0)[:] = 1.0
    bufs.floats(2)[:] = 4.0
    graph = d.record_graph(0, [HostToDevice(a, bufs.views[0]), bufs.kernel(b, a), DeviceToHost(bufs.views[1], b)])
    keeps = d.kind == "cuda"
    for _ in range(3):
        for view, want in ((bufs.views[2], 9.0), (bufs.views[0], 3.0)):
            other = bufs.views[0] if view is bufs.views[2] else bufs.views[2]
            assert graph.swap_host(0, view) is (other if keeps else None)
            assert graph.swap_host(0, view) is None  # no change
            assert graph.steps[0] == HostToDevice(a, view)
            graph.launch(bufs.stream)
            bufs.stream.synchronize()
            assert set(bufs.floats(1).tolist()) == {want}
    with pytest.raises(xa.InvalidRequest, match="bytes differ"):
        graph.swap_host(0, bufs.views[2][:8])
    with pytest.raises(xa.InvalidRequest, match="read-only"):
        graph.swap_host(2, memoryview(bytes(4 * N)))
    graph.close(keep=[bufs.views[2]])
