"""An allocation whose handle cannot be made (``MemoryError`` where a new handle object would be
allocated, injected with ``handles.fail_a_make``) is refused and leaves nothing behind: the block
allocated for it goes back as if freed, through the block cache where there is one, so the
device's figures are what they were, every block comes back once the held handles go, and the
device goes on in the same generation: through the client's fast path and ``allocate_many`` (all
or none). Through the ``Allocate`` message the error reaches the asker after the supervisor's rule
for an unknown failure, a rebuild, which frees every block."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core.handles import fail_a_make

pytestmark = [pytest.mark.usefixtures("stop_actors"), pytest.mark.timeout(60)]

#: More handles than the handle pool keeps (64): while they are held, the next handle is a new object.
_PAST_THE_POOL = 80


def _calls(device: pykka.ActorRef[Any]) -> dict[str, Callable[[], object]]:
    client = device.ask(xa.GetClient())
    return {
        "client allocate": lambda: client.allocate(4096),
        "client allocate_many": lambda: client.allocate_many([4096] * 5),
    }


@pytest.mark.parametrize("resource", ["async", "async+cache"])
@pytest.mark.parametrize("call", ["client allocate", "client allocate_many"])
def test_an_allocation_whose_handle_cannot_be_made_leaves_nothing_behind(
    host_driver: xa.HostDriver, resource: str, call: str
) -> None:
    device = xa.DeviceActor.start(0, host_driver, resource=resource)
    client = device.ask(xa.GetClient())
    held = [client.allocate(4096) for _ in range(_PAST_THE_POOL)]
    before = device.ask(xa.GetStats())
    driver_before = host_driver.live_allocations(0)
    fail_a_make(2 if call == "client allocate_many" else 0)  # allocate_many: its third handle fails
    try:
        with pytest.raises(MemoryError, match="no memory for a new handle"):
            _calls(device)[call]()
    finally:
        fail_a_make(-1)
    after = device.ask(xa.GetStats())
    assert (after.live_blocks, after.bytes_outstanding) == (before.live_blocks, before.bytes_outstanding)
    assert (after.generation, after.restarts) == (before.generation, 0)
    if resource == "async":
        assert host_driver.live_allocations(0) == driver_before  # nothing more is allocated
    # the device goes on: the same call succeeds, and the block cache serves what came back
    made = _calls(device)[call]()
    held.extend(made if isinstance(made, list) else [made])
    del made
    held.clear()
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0


def test_through_allocate_the_error_reaches_the_asker_and_the_device_is_rebuilt(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, host_driver, resource="async")
    client = device.ask(xa.GetClient())
    held = [client.allocate(4096) for _ in range(_PAST_THE_POOL)]
    before = device.ask(xa.GetStats())
    fail_a_make(0)
    try:
        with pytest.raises(MemoryError, match="no memory for a new handle"):
            device.ask(xa.Allocate(4096))
    finally:
        fail_a_make(-1)
    after = device.ask(xa.GetStats())
    assert after.generation == before.generation + 1 and after.restarts == 1
    assert after.live_blocks == 0 and host_driver.live_allocations(0) == 0
    with pytest.raises(xa.GpuRefStale):
        held[0].access()
    assert device.ask(xa.Allocate(4096)).access().nbytes == 4096
