"""A graph's host copies move exactly the bytes asked, whatever their size and alignment, on both
drivers; on CUDA the small ones are copy-kernel nodes (``driver/cuda/graph_copies.py``) and the
large ones memcpy nodes, and rebinding either kind to another view (aligned or not) copies from
or into the new one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xlog_actors.driver.cuda.graph_copies import KERNEL_COPY_MAX, copy_grid
from xlog_actors.driver.graph import DeviceToHost, HostToDevice

SIZES = (4, 20, 4096, 65536 + 4, KERNEL_COPY_MAX, KERNEL_COPY_MAX + 16, 1 << 20)


@pytest.fixture
def mem(graph_buffers: Any) -> Any:
    """Allocations of any size on device 0 and a stream, freed after the test
    (``GraphBuffers`` of tests/driver/conftest.py, with no buffers of its own)."""
    return graph_buffers(0, 0)


def _fill(view: memoryview, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, len(view), dtype=np.uint8)
    np.frombuffer(view, np.uint8)[:] = data
    return data.tobytes()


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
def test_a_host_copy_there_and_back_moves_exactly_its_bytes(mem: Any, nbytes: int, offset: int) -> None:
    src, dst = mem.host(nbytes, offset), mem.host(nbytes + 8, offset)
    want = _fill(src, nbytes)
    sentinel = _fill(dst, 7)[nbytes:]  # the bytes past the copy back stay as they were
    dev = mem.device(nbytes)
    graph = mem.driver.record_graph(0, [HostToDevice(dev, src), DeviceToHost(dst[:nbytes], dev)])
    graph.launch(mem.stream)
    mem.stream.synchronize()
    assert bytes(dst[:nbytes]) == want
    assert bytes(dst[nbytes:]) == sentinel
    graph.close()


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_a_rebound_host_side_copies_from_and_into_the_new_view(mem: Any, offset: int) -> None:
    n = 8192
    a, b = mem.host(n), mem.host(n)
    a2, b2 = mem.host(n, offset), mem.host(n, offset)
    dev = mem.device(n)
    graph = mem.driver.record_graph(0, [HostToDevice(dev, a), DeviceToHost(b, dev)])
    _fill(a, 1)
    before = _fill(b, 3)
    want = _fill(a2, 2)
    graph.update_host(0, a2)
    replaced = graph.swap_host(1, b2)
    assert replaced is (b if mem.driver.kind == "cuda" else None), "the host driver's steps keep their own views"
    graph.launch(mem.stream)
    mem.stream.synchronize()
    assert bytes(b2) == want
    assert bytes(b) == before, "the replaced view was written"
    graph.close()


@pytest.mark.gpu
def test_small_host_copies_are_copy_kernels_and_large_ones_memcpy_nodes(mem: Any) -> None:
    if mem.driver.kind != "cuda":
        pytest.skip("the node kinds are the CUDA driver's; the host driver runs steps in order")
    small, large = KERNEL_COPY_MAX, KERNEL_COPY_MAX + 16
    hs, hl = mem.host(small), mem.host(large)
    ds, dl = mem.device(small), mem.device(large)
    graph: Any = mem.driver.record_graph(0, [HostToDevice(ds, hs), DeviceToHost(hs, ds),
                                            HostToDevice(dl, hl), DeviceToHost(hl, dl)])
    kinds = [node.args is not None for node in graph._nodes]
    assert kinds == [True, True, False, False]
    graph.close()


def test_copy_grid_covers_every_size_with_one_word_a_thread() -> None:
    assert copy_grid(1) == ((1, 1, 1), (256, 1, 1))
    assert copy_grid(4096) == ((1, 1, 1), (256, 1, 1))
    assert copy_grid(4097) == ((2, 1, 1), (256, 1, 1))
    assert copy_grid(KERNEL_COPY_MAX)[0][0] * 256 * 16 >= KERNEL_COPY_MAX
    assert copy_grid(1 << 40) == ((1024, 1, 1), (256, 1, 1)), "the grid is capped; the kernel strides"
