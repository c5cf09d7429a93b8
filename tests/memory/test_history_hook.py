"""The compiled resources' memory-history hook: off by default, and when set it sees every
allocation and every successful free, and no failed one."""

from __future__ import annotations

from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors.errors import UseAfterFree
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource, StreamPool


class _Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []

    def record_alloc(self, block: xa.DeviceBlock) -> None:
        self.log.append(("alloc", block.ptr, block.nbytes))

    def record_free(self, block: xa.DeviceBlock) -> None:
        self.log.append(("free", block.ptr, block.nbytes))


@pytest.mark.parametrize("kind", ["async", "direct"])
def test_the_hook_sees_each_allocation_and_successful_free(host_driver: Any, kind: str) -> None:
    pool = StreamPool(host_driver, 0)
    res = AsyncCudaResource(host_driver, 0, pool) if kind == "async" else DirectCudaResource(host_driver, 0)
    assert res.history is None, "off by default"
    quiet = res.allocate(32)  # before the hook: not recorded
    recorder = _Recorder()
    res.set_history(recorder)
    block = res.allocate(128)
    res.deallocate(block)
    with pytest.raises(UseAfterFree):
        res.deallocate(block)  # a refused free is not recorded
    res.set_history(None)
    res.deallocate(quiet)
    assert recorder.log == [("alloc", block.ptr, 128), ("free", block.ptr, 128)]
    pool.close()
