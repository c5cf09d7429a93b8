"""A graph's host copies move exactly the bytes asked, whatever their size and alignment, on both
drivers; on CUDA the small ones are copy-kernel nodes (``driver/cuda/graph_copies.py``) and the
large ones memcpy nodes, and rebinding either kind to another view (aligned or not) copies from
or into the new one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.cuda.graph_copies import KERNEL_COPY_MAX, copy_grid
from xlog_actors.driver.graph import DeviceToHost, HostToDevice

SIZES = (4, 20, 4096, 65536 + 4, KERNEL_COPY_MAX, KERNEL_COPY_MAX + 16, 1 << 20)


class _Pinned:
    """Pinned allocations of ``driver``'s device 0 with byte views, and device buffers; freed
    at the end."""

    def __init__(self, driver: xa.Driver) -> None:
        self.driver = driver
        self.pinned: list[int] = []
        self.dev: list[int] = []
        self.stream = driver.create_stream(0)

    def host(self, nbytes: int, offset: int = 0) -> memoryview:
        p = self.driver.alloc_pinned(0, nbytes + offset)
        self.pinned.append(p)
        return self.driver.pinned_view(p, nbytes + offset)[offset:]

    def device(self, nbytes: int) -> int:
        self.dev.append(self.driver.alloc(0, nbytes))
        return self.dev[-1]

    def close(self) -> None:
        self.stream.synchronize()
        self.stream.close()
        for d in self.dev:
            self.driver.free(0, d)
        for p in self.pinned:
            self.driver.free_pinned(0, p)


@pytest.fixture
def mem(driver: xa.Driver) -> Iterator[_Pinned]:
    m = _Pinned(driver)
    yield m
    m.close()


def _fill(view: memoryview, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, len(view), dtype=np.uint8)
    np.frombuffer(view, np.uint8)[:] = data
    return data.tobytes()


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
def test_a_host_copy_there_and_back_moves_exactly_its_bytes(mem: _Pinned, nbytes: int, offset: int) -> None:
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
def test_a_rebound_host_side_copies_from_and_into_the_new_view(mem: _Pinned, offset: int) -> None:
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
def test_small_host_copies_are_copy_kernels_and_large_ones_memcpy_nodes(mem: _Pinned) -> None:
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
