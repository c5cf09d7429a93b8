"""Fixtures of the driver tests: the buffers the graph tests record steps over."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.graph import KernelStep
from xlog_actors.driver.kernel_library import SCALE_ADD_F32, launch_shape


class GraphBuffers:
    """``count`` pinned buffers (with their byte views) and ``count`` device buffers of ``n``
    float32s each, and a stream, on device 0 of ``driver``; more of any size through
    :meth:`host` and :meth:`device`; all freed by :meth:`close`."""

    def __init__(self, driver: xa.Driver, count: int, n: int) -> None:
        self.driver = driver
        self.n = n
        self.pinned = [driver.alloc_pinned(0, 4 * n) for _ in range(count)]
        self.views = [driver.pinned_view(p, 4 * n) for p in self.pinned]
        self.dev = [driver.alloc(0, 4 * n) for _ in range(count)]
        self.stream = driver.create_stream(0)

    def host(self, nbytes: int, offset: int = 0) -> memoryview:
        """A byte view of ``nbytes`` of a new pinned allocation, starting ``offset`` bytes in."""
        p = self.driver.alloc_pinned(0, nbytes + offset)
        self.pinned.append(p)
        return self.driver.pinned_view(p, nbytes + offset)[offset:]

    def device(self, nbytes: int) -> int:
        """A new device allocation of ``nbytes``."""
        self.dev.append(self.driver.alloc(0, nbytes))
        return self.dev[-1]

    def floats(self, i: int) -> np.ndarray:
        """Pinned buffer ``i`` as float32s."""
        return np.frombuffer(self.views[i], np.float32)

    def kernel(self, dst: int, src: int, alpha: float = 2.0, beta: float = 1.0) -> KernelStep:
        """The step ``dst = alpha * src + beta`` over ``n`` floats."""
        grid, block = launch_shape(self.n)
        return KernelStep(SCALE_ADD_F32, (grid, 1, 1), (block, 1, 1), (dst, src, alpha, beta, self.n))

    def run(self, graph: object) -> None:
        """Launch ``graph`` on the stream and wait for it."""
        graph.launch(self.stream)  # type: ignore[attr-defined]
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self.stream.close()
        for p in self.dev:
            self.driver.free(0, p)
        for p in self.pinned:
            self.driver.free_pinned(0, p)


@pytest.fixture
def graph_buffers(driver: xa.Driver) -> Iterator[Callable[[int, int], GraphBuffers]]:
    """Makes :class:`GraphBuffers` of ``driver`` (count, floats each); closes them after the test."""
    made: list[GraphBuffers] = []

    def make(count: int, n: int) -> GraphBuffers:
        made.append(GraphBuffers(driver, count, n))
        return made[-1]

    yield make
    for b in made:
        b.close()
