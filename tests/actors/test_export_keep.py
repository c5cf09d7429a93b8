"""What an owner's export table keeps for a pinned handle (``ExportTable.kept``): an export that
reuses an earlier export's keep-alive (the CUDA path re-records its interprocess event) adds
nothing to the slot's; a new one is kept beside it; a handle not pinned keeps nothing."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.export_table import ExportTable


@pytest.fixture
def device() -> Iterator[pykka.ActorRef[Any]]:
    drv = xa.HostDriver(memory_per_device=16 << 20, shared=True)
    yield xa.DeviceActor.start(0, drv)
    pykka.ActorRegistry.stop_all()
    drv.close()


def test_a_reused_keep_alive_is_kept_once_and_a_new_one_beside_it(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(4096))
    state = ref.context.state_ref()
    assert state is not None
    table = ExportTable.of(state)
    assert table.kept(ref) == ()
    event, other = object(), object()
    slot, serial = table.pin(ref, (event,))
    assert table.kept(ref) == (event,)
    assert table.pin(ref, (event,)) == (slot, serial) and table.kept(ref) == (event,), "reused: kept once"
    table.pin(ref, (other,))
    assert table.kept(ref) == (event, other)
    assert table.count(slot) == 3
    # A pickle of the handle (the host driver keeps no event) pins the same slot and keeps both.
    shared = pickle.loads(pickle.dumps(ref))
    assert shared.export.slot == slot and table.kept(ref) == (event, other)
    assert table.kept(device.ask(xa.Allocate(4096))) == ()
