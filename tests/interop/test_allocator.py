"""``DeviceAllocator`` on the host driver: bad input changes nothing, frees met inside a garbage
collection are queued (no driver call from a collector), a rebuild's lost blocks are reported,
and the torch and CuPy routes refuse what they cannot serve."""

from __future__ import annotations

import gc
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.interop import DeviceAllocator, as_client
from xlog_actors.interop import cupy as xa_cupy
from xlog_actors.interop import torch as xa_torch


@pytest.fixture
def device(host_driver: xa.HostDriver) -> Iterator[pykka.ActorRef[Any]]:
    ref = xa.DeviceActor.start(0, host_driver)
    yield ref
    ref.stop()


@pytest.fixture
def allocator(device: pykka.ActorRef[Any]) -> DeviceAllocator:
    return DeviceAllocator(as_client(device), "torch")


def _outstanding(device: pykka.ActorRef[Any]) -> int:
    return int(device.ask(xa.GetStats()).bytes_outstanding)


def test_bad_input_is_refused_and_changes_nothing(device: Any, allocator: DeviceAllocator) -> None:
    ptr = allocator.allocate(4096, 0)
    with pytest.raises(xa.InvalidRequest, match="no live torch block"):
        allocator.free(ptr + 256, 4096, 0)
    with pytest.raises(xa.InvalidRequest, match="with 100 bytes, but its torch block has 4096"):
        allocator.free(ptr, 100, 0)
    with pytest.raises(xa.InvalidRequest):
        allocator.allocate(0, 0)
    with pytest.raises(xa.InvalidRequest, match="no live torch block"):
        allocator.ref(ptr + 1)
    assert allocator.live_blocks == 1 and _outstanding(device) == 4096
    allocator.free(ptr, 4096, 0)
    assert _outstanding(device) == 0
    with pytest.raises(xa.InvalidRequest):
        allocator.free(ptr, 4096, 0)  # twice


def test_tags_and_clients_are_checked(device: Any) -> None:
    with pytest.raises(xa.InvalidRequest, match="tag"):
        DeviceAllocator(as_client(device), "")
    with pytest.raises(xa.InvalidRequest, match="DeviceActor's ref or a DeviceClient"):
        as_client(42)
    client = as_client(device)
    assert as_client(client) is client


class _Cyclic:
    """Frees its block when collected, from inside the garbage collection."""

    def __init__(self, allocator: DeviceAllocator, ptr: int, nbytes: int) -> None:
        self.allocator, self.ptr, self.nbytes = allocator, ptr, nbytes
        self.cycle = self

    def __del__(self) -> None:
        self.allocator.free(self.ptr, self.nbytes, 0)


def test_a_free_inside_a_garbage_collection_is_queued_until_the_next_allocation(
    device: Any, allocator: DeviceAllocator
) -> None:
    ptr = allocator.allocate(1 << 20, 0)
    _Cyclic(allocator, ptr, 1 << 20)
    gc.collect()
    assert allocator.pending_frees == 1, "no driver call from inside a collection"
    assert _outstanding(device) == 1 << 20
    other = allocator.allocate(4096, 0)  # the queued free is done first
    assert allocator.pending_frees == 0 and _outstanding(device) == 4096
    allocator.free(other, 4096, 0)
    ptr = allocator.allocate(8192, 0)
    _Cyclic(allocator, ptr, 8192)
    gc.collect()
    allocator.flush()
    assert allocator.pending_frees == 0 and _outstanding(device) == 0


def test_close_refuses_allocations_and_does_the_queued_frees(device: Any, allocator: DeviceAllocator) -> None:
    ptr = allocator.allocate(4096, 0)
    kept = allocator.allocate(4096, 0)
    _Cyclic(allocator, ptr, 4096)
    gc.collect()
    allocator.close()
    assert allocator.pending_frees == 0 and _outstanding(device) == 4096
    with pytest.raises(xa.InvalidRequest, match="closed"):
        allocator.allocate(4096, 0)
    allocator.free(kept, 4096, 0)  # a block still live is freed by its later free
    assert _outstanding(device) == 0


def test_a_rebuild_frees_the_blocks_the_library_holds_and_says_so(
    device: Any, allocator: DeviceAllocator, caplog: pytest.LogCaptureFixture
) -> None:
    """What the runtime does today: a rebuild cannot keep a block alive, so a tensor alive
    across it points at freed memory. The allocator reports the loss and stays consistent, and
    never hands the library an address it still holds (the device would: it hands the lowest
    address out again)."""
    old = [allocator.allocate(4096, 0), allocator.allocate(8192, 0)]
    device.ask(xa.Rebuild("test"))
    assert _outstanding(device) == 0, "the rebuild freed them with the old context"
    with caplog.at_level(logging.WARNING, logger="xlog_actors.interop"):
        new = allocator.allocate(4096, 0)
    assert "freed 2 torch block(s), 12288 bytes" in caplog.text
    assert allocator.lost_blocks == {old[0]: 4096, old[1]: 8192}
    assert new not in old, "an address the library still holds was handed out again"
    # Both lost addresses came back first (lowest first): two blocks are held back.
    assert allocator.live_blocks == 1 and _outstanding(device) == 3 * 4096, "the held-back blocks"
    allocator.free(old[1], 8192, 0)
    allocator.free(old[0], 4096, 0)  # the held-back blocks at their addresses are let go
    allocator.flush()
    assert allocator.lost_blocks == {} and allocator.live_blocks == 1 and _outstanding(device) == 4096
    allocator.free(new, 4096, 0)
    assert _outstanding(device) == 0


def test_a_free_of_a_block_a_rebuild_took_is_a_no_op(device: Any, allocator: DeviceAllocator) -> None:
    ptr = allocator.allocate(4096, 0)
    device.ask(xa.Rebuild("test"))
    allocator.free(ptr, 4096, 0)
    assert allocator.live_blocks == 0 and _outstanding(device) == 0


@pytest.mark.parametrize(("library", "route"), [("torch", xa_torch), ("cupy", xa_cupy)])
def test_the_routes_need_their_library_and_the_cuda_driver(device: Any, library: str, route: Any) -> None:
    if importlib.util.find_spec(library) is None:
        with pytest.raises(ImportError):
            route.use_device(device)
        return
    with pytest.raises(xa.InvalidRequest, match="only on the CUDA driver"):
        route.use_device(device)


def test_synchronize_waits_for_the_device_s_stream_and_needs_no_context(device: Any, allocator: DeviceAllocator,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ptr = allocator.allocate(4096, 0)
    allocator.free(ptr, 4096, 0)
    ctx = allocator._client._cell.lifecycle.context
    stream = ctx.runtime.stream_pool.resolve(xa.StreamId.DEFAULT)
    waited: list[int] = []
    monkeypatch.setattr(type(stream), "synchronize", lambda self: waited.append(1), raising=True)
    allocator.synchronize()
    assert waited == [1]
    monkeypatch.setattr(allocator._client._cell.lifecycle, "_context", None)
    allocator.synchronize()  # no context (rebuilding, broken): nothing to wait for
    assert waited == [1]
