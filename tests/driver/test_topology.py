"""The device topology helpers: CPU lists and PCI bus ids as sysfs writes them, and a binding
that binds nothing where the device's node cannot be told."""

from __future__ import annotations

import os

import pytest

from xlog_actors.driver.cuda import topology


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert topology.parse_cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert topology.parse_cpulist("5") == frozenset({5})
    for bad in ("3-1", "a-b", "-1"):
        with pytest.raises(ValueError):
            topology.parse_cpulist(bad)


def test_bus_ids_are_named_as_sysfs_names_them() -> None:
    assert topology.sysfs_name("0000:1B:00.0") == "0000:1b:00.0"
    assert topology.sysfs_name("00000000:C3:00.0\x00") == "0000:c3:00.0"
    with pytest.raises(ValueError):
        topology.sysfs_name("1B:00")


def test_no_device_node_binds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topology, "local_cpus", lambda ordinal: None)
    before = os.sched_getaffinity(0)
    assert topology.bind_to_device(0) is None
    assert os.sched_getaffinity(0) == before


def test_a_node_of_part_of_the_cpus_is_bound_to(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    mine = frozenset(allowed[:1])
    monkeypatch.setattr(topology, "local_cpus", lambda ordinal: mine)
    try:
        assert topology.bind_to_device(0) == mine
        assert os.sched_getaffinity(0) == set(mine)
    finally:
        os.sched_setaffinity(0, allowed)
