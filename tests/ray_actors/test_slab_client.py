"""The slab client's carving without Ray: its reservations go to a stand-in device (``_ask``
replaced), so every case below runs anywhere; the Ray-backed cases are in test_ray_cluster.py.
Also: the typed errors a Ray worker sends back pickle as themselves."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from xlog_actors.errors import BudgetExceeded, GpuRefStale, InvalidRequest, OutOfMemory
from xlog_actors.ray import RemoteGpuRef, SlabClient
from xlog_actors.ray.slab import CARVE_ALIGN

pytestmark = pytest.mark.timeout(30)


class _Device:
    """Stands in for a RayDevice's ``ask(Allocate)``: slabs at distinct addresses, a budget."""

    def __init__(self, budget: int = 1 << 30, generation: int = 1) -> None:
        self.budget, self.generation, self.asks, self.outstanding = budget, generation, [], 0

    def ask(self, message: Any) -> RemoteGpuRef:
        self.asks.append(message.nbytes)
        if self.outstanding + message.nbytes > self.budget:
            raise BudgetExceeded("over", requested=message.nbytes, limit=self.budget, outstanding=self.outstanding)
        self.outstanding += message.nbytes
        n = len(self.asks)
        return RemoteGpuRef("n" * 56, 0, self.generation, n << 32, message.nbytes, str(message.tag), None, n)


def client_of(device: _Device, **kwargs: Any) -> SlabClient:
    client = SlabClient(object(), **kwargs)
    client._ask = device.ask  # type: ignore[method-assign]
    return client


def test_carves_share_one_reservation_and_never_overlap() -> None:
    device = _Device()
    client = client_of(device, slab_bytes=1 << 20)
    refs = [client.allocate(n) for n in (1, 255, 256, 257, 4000)]
    assert device.asks == [1 << 20]  # one reservation for all five
    assert [r.nbytes for r in refs] == [1, 255, 256, 257, 4000]
    assert all(r.ptr % CARVE_ALIGN == 0 and r.serial == 1 and r.generation == 1 for r in refs)
    spans = sorted((r.ptr, r.ptr + r.nbytes) for r in refs)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert len({r.carve for r in refs}) == 5 and all(r.carve for r in refs)
    assert client.live_carves == 5 and client.reserved_bytes == 1 << 20


def test_a_freed_carve_is_reused_and_its_old_descriptor_frees_nothing() -> None:
    client = client_of(_Device(), slab_bytes=1 << 20)
    old = client.allocate(1000)
    client.free(old)
    client.free(old)  # idempotent
    new = client.allocate(900)  # same rounded size: the same address
    assert new.ptr == old.ptr and new.carve != old.carve
    client.free(old)  # the ABA case: the stale descriptor must not free the new carve
    assert client.live_carves == 1
    client.free(new)
    assert client.live_carves == 0


def test_a_slab_too_small_or_refused_falls_back_to_the_request() -> None:
    device = _Device(budget=3 << 20)
    client = client_of(device, slab_bytes=2 << 20)
    big = client.allocate(5 << 19)  # larger than a slab: a slab of its own size
    assert device.asks == [5 << 19] and big.nbytes == 5 << 19
    small = client.allocate(1 << 19)  # a 2 MiB slab would pass the budget: exactly its size
    assert device.asks == [5 << 19, 2 << 20, 1 << 19] and small.nbytes == 1 << 19
    with pytest.raises(BudgetExceeded):
        client.allocate(1 << 20)
    assert client.live_carves == 2 and client.reserved_bytes == 3 << 20


def test_a_newer_generation_drops_the_old_slabs() -> None:
    device = _Device(generation=1)
    client = client_of(device, slab_bytes=1 << 12)
    old = client.allocate(1 << 12)
    device.generation = 2  # the device restarted; the client sees it at its next reservation
    new = client.allocate(1 << 12)
    assert (old.generation, new.generation, client.generation) == (1, 2, 2)
    assert client.live_carves == 1 and client.reserved_bytes == 1 << 12
    client.free(old)  # an older generation's: a no-op
    assert client.live_carves == 1


def test_bad_input_changes_nothing() -> None:
    device = _Device()
    client = client_of(device, slab_bytes=1 << 20)
    ref = client.allocate(64)
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(InvalidRequest, match="positive int"):
            client.allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="takes a RemoteGpuRef"):
        client.free("x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="whole block"):
        client.free(RemoteGpuRef("n" * 56, 0, 1, ref.ptr, 64, "t", None, 1))
    with pytest.raises(InvalidRequest, match="not a carve of this client"):
        client.free(RemoteGpuRef("n" * 56, 0, 1, ref.ptr, 64, "t", None, 99, ref.carve + 5))
    assert client.live_carves == 1 and device.asks == [1 << 20]
    for kwargs in ({"slab_bytes": 100}, {"slab_bytes": 0}, {"tag": 3}, {"timeout_s": 0}):
        with pytest.raises(InvalidRequest):
            SlabClient(object(), **kwargs)


def test_typed_errors_pickle_as_themselves() -> None:
    stale = pickle.loads(pickle.dumps(GpuRefStale("context poisoned", "node n")))
    assert isinstance(stale, GpuRefStale) and stale.reason == "context poisoned" and "node n" in str(stale)
    over = pickle.loads(pickle.dumps(BudgetExceeded("over", requested=3, limit=2, outstanding=1)))
    assert isinstance(over, BudgetExceeded) and isinstance(over, OutOfMemory) and isinstance(over, MemoryError)
    assert (over.requested, over.limit, over.outstanding, str(over)) == (3, 2, 1, "over")
