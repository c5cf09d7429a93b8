"""Without Ray: the package imports, and what needs Ray says which extra to install."""

from __future__ import annotations

import sys

import pytest

from xlog_actors.ray import RemoteGpuRef, find_keeper, keeper_name, start_ray_device
from xlog_actors.ray._require import require_ray


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match=r"xlog-actors\[ray\]"):
        require_ray()
    with pytest.raises(ImportError, match=r"xlog-actors\[ray\]"):
        start_ray_device(0)
    with pytest.raises(ImportError, match=r"xlog-actors\[ray\]"):
        find_keeper("n", 0)
    ref = RemoteGpuRef("n", 0, 1, 0x1000, 16, "untagged", None, 1)
    with pytest.raises(ImportError, match=r"xlog-actors\[ray\]"):
        ref.access()


def test_keeper_names_are_per_node_and_ordinal() -> None:
    names = {keeper_name(n, o) for n in ("a", "b") for o in (0, 1)}
    assert len(names) == 4


def test_a_handle_a_rebuild_left_behind_gets_a_stale_descriptor() -> None:
    """The race between an allocation and a rebuild's bump, set up without Ray: ``_describe`` of a
    handle whose local generation the device already left gets a generation no keeper holds."""
    import threading

    import xlog_actors as xa
    from xlog_actors.ray.device import STALE_GENERATION, RayDevice

    local = xa.DeviceActor.start(ordinal=0, driver=xa.HostDriver())
    try:
        ref = local.ask(xa.Allocate(64), block=True)
        body = RayDevice.__new__(RayDevice)
        body._lock = threading.Lock()
        body._refs = {}
        body._node_id, body._ordinal, body._generation = "n" * 56, 0, 7
        body._local_generation = ref.generation
        assert body._describe(ref).generation == 7
        assert len(body._refs) == 1
        body._refs.clear()
        body._local_generation = ref.generation + 1  # a rebuild's bump already landed
        described = body._describe(ref)
        assert described.generation == STALE_GENERATION != 7
        assert body._refs == {}
        ref.release()
    finally:
        local.stop()
