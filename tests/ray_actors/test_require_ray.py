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
