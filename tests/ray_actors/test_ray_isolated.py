"""A Ray device in process mode, on the test session's three-node cluster (host
driver): a ``RayDevice`` started with ``isolate=`` keeps its device in a child process of its
worker; a sticky error or a crash there restarts only that child, the Ray actor lives on, the
cluster generation goes up by one and old descriptors fail on every node; a handle opens in place
(``open_on_node``, zero-copy) from a process on the device's own node, and goes stale there when
the device process dies; bad arguments are refused before anything starts.

Marked ``ray``; skipped with a reason where ray is not installed. Every Ray wait has a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault
from xlog_actors.errors import DeviceUnavailable, GpuRefStale, InvalidRequest
from xlog_actors.ray import RemoteGpuRef, fetch, open_on_node, start_ray_device
from xlog_actors.ray.fetch import ray_get

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'xlog-actors[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(90)]


def ask(handle: Any, message: Any) -> Any:
    return ray_get(handle.ask.remote(message), "test", 30)


def run_on(node: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a Ray task on ``node``; its typed errors come back as themselves."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(fn).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    return ray_get(task.remote(*args), f"task on {node[:12]}", 60)


@pytest.fixture
def isolated_a(cluster: Any) -> Iterator[Any]:
    """An isolated host-driver device on node A whose Ray actor Ray never restarts: whatever
    comes back after a fault came back inside the same Ray actor."""
    handle = start_ray_device(0, node_id=cluster.a, isolate="host", max_restarts=0)
    yield handle
    ray.kill(handle, no_restart=True)


def _stale_reason(ref: RemoteGpuRef) -> str:
    try:
        ref.access()
    except GpuRefStale as exc:
        return exc.reason
    return "valid"


def _read_on_node(ref: RemoteGpuRef) -> bytes:
    return fetch(ref).tobytes()


def _wait_generation(handle: Any, generation: int, timeout_s: float = 30.0) -> RemoteGpuRef:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ref: RemoteGpuRef | None = ask(handle, xa.Allocate(256))
        except (DeviceUnavailable, GpuRefStale):
            ref = None
        if ref is not None and ref.generation == generation:
            return ref
        assert time.monotonic() < deadline, f"no allocation on generation {generation} in {timeout_s} s"
        time.sleep(0.01)


@pytest.mark.parametrize("fault", ["sticky", "kill"])
def test_a_fault_in_the_device_process_restarts_only_it_and_bumps_the_cluster_generation(
    cluster: Any, isolated_a: Any, fault: str
) -> None:
    old = ask(isolated_a, xa.Allocate(4096))
    data = np.arange(4096, dtype=np.uint8)
    ray_get(isolated_a.write.remote(old, data), "write", 30)
    assert run_on(cluster.b, _read_on_node, old) == data.tobytes()  # the child's memory, read on B
    with pytest.raises((GpuRefStale, DeviceUnavailable)):
        ask(isolated_a, ChildFault(fault))  # type: ignore[arg-type]
    fresh = _wait_generation(isolated_a, old.generation + 1)
    for node in (cluster.a, cluster.b):
        assert run_on(node, _stale_reason, old) != "valid"
        assert run_on(node, _stale_reason, fresh) == "valid"
    with pytest.raises(GpuRefStale):
        ask(isolated_a, xa.CopyToHost(old))
    # The same Ray actor (max_restarts=0: Ray could not have replaced it) serves the new child.
    ray_get(isolated_a.write.remote(fresh, data[:256]), "write", 30)
    assert run_on(cluster.b, _read_on_node, fresh) == data[:256].tobytes()
    assert ray_get(isolated_a.generation.remote(), "generation", 30) == old.generation + 1


def _open_write_and_kill(ref: RemoteGpuRef, device: Any) -> tuple[str, str, str]:
    """On the device's node: open ``ref`` in place, write through the opened view, have the
    device read it back (the same memory, no copy), then kill the device process and look again."""
    shared = open_on_node(ref)
    kind = type(shared).__name__
    shared.view(ordered=True, timeout_s=10.0)[:4] = b"xlog"
    seen = bytes(ray_get(device.read.remote(ref), "read", 30)[:4])
    try:
        ray_get(device.ask.remote(ChildFault("kill")), "kill", 30)
    except DeviceUnavailable:
        pass
    try:
        shared.access()
        after = "valid"
    except GpuRefStale as exc:
        after = exc.reason
    shared.release()
    return kind, seen.decode(), after


def test_a_handle_opens_in_place_on_the_devices_node_and_goes_stale_with_its_process(
    cluster: Any, isolated_a: Any
) -> None:
    ref = ask(isolated_a, xa.Allocate(1 << 16))
    ask(isolated_a, xa.Fill(ref, 0))
    assert run_on(cluster.a, _open_write_and_kill, ref, isolated_a) == ("SharedGpuRef", "xlog", "context rebuilt")
    with pytest.raises(InvalidRequest, match="another node"):
        run_on(cluster.b, open_on_node, _wait_generation(isolated_a, ref.generation + 1))


def test_bad_isolate_arguments_and_unexportable_memory_are_refused(cluster: Any) -> None:
    with pytest.raises(InvalidRequest, match="isolate must be None or a driver kind"):
        start_ray_device(0, node_id=cluster.a, isolate="gpu")
    with pytest.raises(InvalidRequest, match="leave out driver_factory"):
        start_ray_device(0, node_id=cluster.a, isolate="host", restart_on_poison=True)
    plain = start_ray_device(0, node_id=cluster.a, max_restarts=0)
    try:
        ref = ask(plain, xa.Allocate(256))
        with pytest.raises(InvalidRequest, match="private memory"):
            run_on(cluster.a, open_on_node, ref)
        with pytest.raises(InvalidRequest, match="ChildFault"):
            ask(plain, ChildFault("kill"))  # the test hook is for isolated devices only
        assert run_on(cluster.a, _stale_reason, ref) == "valid"  # nothing changed
    finally:
        ray.kill(plain, no_restart=True)
