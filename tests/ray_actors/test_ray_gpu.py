"""The Ray path on a GPU, on the test session's three-node cluster of one GPU host: node A
declares the GPU. A ``RayDevice`` on the CUDA driver serves node B the bytes a slow kernel wrote
(read through Ray's object store, ordered after the kernel), and a kill of its Ray actor stales
its old handles on A and B; an isolated CUDA device (``isolate="cuda"``: its IPC-capable pool in a
child process of the Ray worker) opens in place on A through CUDA IPC, and an illegal address in
its process restarts only that process, on generation + 1.

Marked ``gpu`` and ``ray``: skipped with a reason without either. The GPU machine has no network
and Ray does not fit in one device call: ``scripts/gpu-ray-stash.sh`` then ``scripts/gpu-ray.sh``
carry and install it there.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.actors.isolated import ChildFault
from xlog_actors.errors import DeviceUnavailable, GpuRefStale
from xlog_actors.ray import RemoteGpuRef, fetch, open_on_node, start_ray_device
from xlog_actors.ray.fetch import ray_get

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'xlog-actors[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.gpu, pytest.mark.timeout(180)]


def _late_fill_host(mem: Any, grid: Any, block: Any, out: int, value: float, n: int) -> None:
    time.sleep(0.3)
    mem.array(out, n, np.float32)[:] = value


#: Spins about 0.2 s on the GPU, then fills: a read not ordered after it sees the old bytes.
LATE_FILL = xa.Kernel(
    "xlog_test_late_fill",
    'extern "C" __global__ void xlog_test_late_fill(float* out, float v, unsigned long long n) {\n'
    "    long long t0 = clock64(); while (clock64() - t0 < 400000000LL) {}\n"
    "    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = v;\n"
    "}\n",
    ("ptr", "f32", "u64"),
    _late_fill_host,
)


@pytest.fixture(autouse=True)
def by_value() -> Iterator[None]:
    """This module's kernel and tasks travel to the workers by value."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _cuda() -> xa.Driver:
    return xa.open_driver("cuda")


def ask(handle: Any, message: Any) -> Any:
    return ray_get(handle.ask.remote(message), "test", 60)


def run_on(node: str, fn: Callable[..., Any], *args: Any) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(fn).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    return ray_get(task.remote(*args), f"task on {node[:12]}", 90)


def _wait_generation(handle: Any, generation: int, timeout_s: float = 60.0) -> RemoteGpuRef:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ref: RemoteGpuRef | None = ask(handle, xa.Allocate(256))
        except (DeviceUnavailable, GpuRefStale):
            ref = None
        if ref is not None and ref.generation == generation:
            return ref
        assert time.monotonic() < deadline, f"no allocation on generation {generation} in {timeout_s} s"
        time.sleep(0.02)


def _stale_reason(ref: RemoteGpuRef) -> str:
    try:
        ref.access()
    except GpuRefStale as exc:
        return exc.reason
    return "valid"


def _fetch_bytes(ref: RemoteGpuRef) -> bytes:
    return fetch(ref).tobytes()


def test_a_cuda_device_on_a_serves_b_behind_a_slow_kernel_and_a_kill_stales_it_everywhere(cluster: Any) -> None:
    device = start_ray_device(0, node_id=cluster.a, driver_factory=_cuda, num_gpus=1, max_restarts=1)
    try:
        n = 1 << 16
        src = ask(device, xa.Allocate(4 * n))
        ask(device, xa.Fill(src, 0))
        assert ask(device, xa.GetStats()).driver == "cuda"
        t0 = time.monotonic()
        ask(device, xa.Launch(LATE_FILL, 1, 256, [xa.Out(src), 3.5, n]))
        assert run_on(cluster.b, _fetch_bytes, src) == np.full(n, 3.5, np.float32).tobytes()
        assert time.monotonic() - t0 >= 0.1  # the read waited for the kernel on the GPU
        ray.kill(device, no_restart=False)
        fresh = _wait_generation(device, src.generation + 1)
        for node in (cluster.a, cluster.b):
            assert run_on(node, _stale_reason, src) == "context rebuilt"
            assert run_on(node, _stale_reason, fresh) == "valid"
    finally:
        ray.kill(device, no_restart=True)


def _open_and_read(ref: RemoteGpuRef) -> tuple[str, bytes]:
    """On the device's node: open in place (CUDA IPC) and read 16 bytes after the last write."""
    from cuda.bindings import driver as cu

    shared = open_on_node(ref)
    try:
        shared.wait_write(timeout_s=30.0)
        out = bytearray(16)
        (err,) = cu.cuMemcpyDtoH(out, shared.raw_device_ptr(), 16)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return type(shared).__name__, bytes(out)
    finally:
        shared.release()


@pytest.mark.skipif(os.environ.get("XLOG_ACTORS_SANITIZER") == "1",
                    reason="plants a real illegal address: the sanitizer reports it")
def test_an_isolated_cuda_device_opens_in_place_and_survives_an_illegal_address(cluster: Any) -> None:
    device = start_ray_device(0, node_id=cluster.a, isolate="cuda", resource="async", num_gpus=1, max_restarts=0)
    try:
        ref = ask(device, xa.Allocate(1 << 20))
        ask(device, xa.Fill(ref, 7))
        assert run_on(cluster.a, _open_and_read, ref) == ("SharedGpuRef", b"\x07" * 16)
        with pytest.raises(GpuRefStale, match="context poisoned"):
            ask(device, ChildFault("illegal_address"))
        fresh = _wait_generation(device, ref.generation + 1)
        for node in (cluster.a, cluster.b):
            assert run_on(node, _stale_reason, ref) != "valid"
        ask(device, xa.Fill(fresh, 9))
        assert run_on(cluster.b, _fetch_bytes, fresh) == b"\x09" * 256
        assert run_on(cluster.a, _open_and_read, fresh) == ("SharedGpuRef", b"\x09" * 16)
    finally:
        ray.kill(device, no_restart=True)
