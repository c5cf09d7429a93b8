"""A device on Ray, on the test session's three-node cluster (conftest.py; host driver): a handle made
on node A and used on node B reads the right bytes behind a slow kernel on A (a cross-node fetch);
a restart on A stales old handles on A and on B; a budget on A holds whatever B asks; a dead node
fails its handles with typed errors, never a hang; a poisoned device stops its descriptors
validating; the slab client allocates on A's node with no Ray call per allocation.

Marked ``ray``; skipped with a reason where ray is not installed. Every Ray wait has a timeout.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.errors import BudgetExceeded, ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest
from xlog_actors.ray import RemoteGpuRef, SlabClient, fetch, fetch_into, fetch_to, start_ray_device
from xlog_actors.ray.fetch import ray_get

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'xlog-actors[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(90)]

#: How long the slow kernel spins before it writes, in seconds: long enough that a read not
#: ordered after it would see the bytes from before it.
SLOW_S = 0.4


def _slow_fill_host(mem: Any, grid: Any, block: Any, out: int, value: float, n: int) -> None:
    time.sleep(SLOW_S)
    mem.array(out, n, np.float32)[:] = value


#: A fill that writes only after a spin; its host implementation runs on the stream's thread.
SLOW_FILL_F32 = xa.Kernel(
    "slow_fill_f32",
    'extern "C" __global__ void slow_fill_f32(float* out, float value, unsigned long long n) {\n'
    "    long long start = clock64(); while (clock64() - start < 400000000LL) {}\n"
    "    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)\n"
    "        out[i] = value;\n"
    "}\n",
    ("ptr", "f32", "u64"),
    _slow_fill_host,
)


@pytest.fixture(autouse=True)
def by_value() -> Iterator[None]:
    """This module's kernels, factories and tasks are shipped to the workers by value (they cannot
    import a test module)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def on(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def run_on(node: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a Ray task on ``node``; its typed errors come back as themselves."""
    task = ray.remote(fn).options(num_cpus=0, scheduling_strategy=on(node))
    return ray_get(task.remote(*args), f"task on {node[:12]}", 60)


def ask(handle: Any, message: Any) -> Any:
    return ray_get(handle.ask.remote(message), "test", 30)


@pytest.fixture
def device_a(cluster: Any) -> Iterator[Any]:
    handle = start_ray_device(0, node_id=cluster.a, max_restarts=1)
    yield handle
    ray.kill(handle, no_restart=True)


@pytest.fixture
def device_b(cluster: Any) -> Iterator[Any]:
    handle = start_ray_device(0, node_id=cluster.b, max_restarts=0)
    yield handle
    ray.kill(handle, no_restart=True)


def wait_generation(handle: Any, generation: int, timeout_s: float = 30.0) -> RemoteGpuRef:
    """The first allocation served on ``generation``: Ray has no event for a finished restart, so
    this retries until a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ref: RemoteGpuRef | None = ask(handle, xa.Allocate(256))
        except DeviceUnavailable:
            ref = None
        if ref is not None and ref.generation == generation:
            return ref
        assert time.monotonic() < deadline, f"no allocation on generation {generation} in {timeout_s} s"
        time.sleep(0.01)


# -- a handle made on A, used on B -----------------------------------------------------------------
def _fetch_on_b(ref: RemoteGpuRef) -> bytes:
    return fetch(ref).tobytes()


def test_a_handle_from_a_reads_the_right_bytes_on_b_behind_a_slow_kernel(
    cluster: Any, device_a: Any, device_b: Any
) -> None:
    n = 1 << 16
    src = ask(device_a, xa.Allocate(4 * n))
    assert src.node_id == cluster.a
    ask(device_a, xa.Fill(src, 0))
    want = np.full(n, 3.5, np.float32).tobytes()

    # The launch is answered once enqueued; the kernel still spins when B asks for the bytes.
    t0 = time.monotonic()
    ask(device_a, xa.Launch(SLOW_FILL_F32, 1, 1, [xa.Out(src), 3.5, n]))
    assert run_on(cluster.b, _fetch_on_b, src) == want
    assert time.monotonic() - t0 >= SLOW_S  # the read waited for the kernel

    # Into a block of B's device: the bytes go A -> B through the object store.
    ask(device_a, xa.Launch(SLOW_FILL_F32, 1, 1, [xa.Out(src), -1.0, n]))
    dst = ask(device_b, xa.Allocate(4 * n))
    run_on(cluster.b, fetch_to, src, device_b, dst)
    assert dst.node_id == cluster.b
    assert run_on(cluster.b, _fetch_on_b, dst) == np.full(n, -1.0, np.float32).tobytes()
    ask(device_a, xa.Free(src))
    ask(device_b, xa.Free(dst))


def test_write_lands_after_the_blocks_last_write_from_a_read_only_or_a_writable_buffer(
    cluster: Any, device_a: Any
) -> None:
    n = 1 << 16
    dst = ask(device_a, xa.Allocate(4 * n))
    # Arrays arrive as Ray's read-only views of its object store (registered, read when the copy
    # runs); a bytearray arrives writable (snapshotted).
    for data in [np.full(n, 2.0, np.float32), np.full((n // 4, 4), 5.0, np.float32), bytearray(b"\x01") * (4 * n)]:
        # The kernel still spins when the write arrives: the write must land after it (WAW).
        ask(device_a, xa.Launch(SLOW_FILL_F32, 1, 1, [xa.Out(dst), -7.0, n]))
        ray.get(device_a.write.remote(dst, data), timeout=30)
        assert bytes(fetch(dst)) == bytes(data)
    with pytest.raises(InvalidRequest, match="do not fit"):
        ray.get(device_a.write.remote(dst, np.zeros(4 * n + 1, np.uint8)), timeout=30)
    ask(device_a, xa.Free(dst))


def _fetch_into_a_local_device(ref: RemoteGpuRef) -> bytes:
    """On B: a local (pykka) device and copy actor, the bytes fetched into one of its blocks."""
    driver = xa.HostDriver()
    device = xa.DeviceActor.start(0, driver)
    copy = xa.CopyActor.start(device)
    try:
        dst = device.ask(xa.Allocate(ref.nbytes))
        fetch_into(ref, copy, dst)
        data: bytes = copy.ask(xa.CopyToHost(dst))
        return data
    finally:
        copy.stop()
        device.stop()
        driver.close()


def test_fetch_into_a_local_block_of_the_consumer(cluster: Any, device_a: Any) -> None:
    src = ask(device_a, xa.Allocate(4096))
    ask(device_a, xa.CopyToDevice(src, bytes(range(256)) * 16))
    assert run_on(cluster.b, _fetch_into_a_local_device, src) == bytes(range(256)) * 16
    ask(device_a, xa.Free(src))


class _SilentCopy(pykka.ThreadingActor):
    """Takes a message and never answers it: a consumer's copy actor that hangs."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def on_receive(self, message: Any) -> None:
        self.release.wait(30)


def test_fetch_into_a_copy_actor_that_does_not_answer_is_a_typed_error(device_a: Any) -> None:
    src = ask(device_a, xa.Allocate(256))
    release = threading.Event()
    silent = _SilentCopy.start(release)
    driver = xa.HostDriver()
    local = xa.DeviceActor.start(0, driver)
    try:
        dst = local.ask(xa.Allocate(256))
        t0 = time.monotonic()
        with pytest.raises(DeviceUnavailable, match="did not take the bytes in 0.5 s"):
            fetch_into(src, silent, dst, timeout_s=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        silent.stop()
        local.stop()
        driver.close()
    ask(device_a, xa.Free(src))


def test_fetch_refuses_what_it_cannot_serve(cluster: Any, device_a: Any, device_b: Any) -> None:
    src = ask(device_a, xa.Allocate(1024))
    dst = ask(device_b, xa.Allocate(512))
    with pytest.raises(InvalidRequest, match="do not fit"):
        fetch_to(src, device_b, dst)  # too small: nothing written
    with pytest.raises(InvalidRequest, match="not of this device"):
        fetch_to(src, device_a, dst)  # dst is B's, not A's
    with pytest.raises(InvalidRequest, match="takes a RemoteGpuRef"):
        fetch("not a descriptor")  # type: ignore[arg-type]
    ask(device_a, xa.Free(src))
    with pytest.raises(GpuRefStale, match="released"):
        fetch(src)
    with pytest.raises(GpuRefStale, match="released"):
        ask(device_a, xa.CopyToHost(src))
    with pytest.raises(InvalidRequest, match="not of this device"):
        ask(device_a, xa.Fill(dst, 1))
    assert ask(device_a, xa.GetStats()).live_blocks == 0
    ask(device_b, xa.Free(dst))


# -- restarts --------------------------------------------------------------------------------------
def _stale_reason(ref: RemoteGpuRef) -> str:
    try:
        ref.access()
    except GpuRefStale as exc:
        return exc.reason
    return "valid"


def _fetch_reason(ref: RemoteGpuRef) -> str:
    try:
        fetch(ref)
    except GpuRefStale as exc:
        return exc.reason
    return "read"


def test_a_killed_device_on_a_comes_back_and_its_old_handles_fail_on_a_and_b(cluster: Any, device_a: Any) -> None:
    old = ask(device_a, xa.Allocate(1024))
    assert run_on(cluster.a, _stale_reason, old) == run_on(cluster.b, _stale_reason, old) == "valid"
    ray.kill(device_a, no_restart=False)
    fresh = wait_generation(device_a, old.generation + 1)
    for node in (cluster.a, cluster.b):
        assert run_on(node, _stale_reason, old) == "context rebuilt"
        assert run_on(node, _fetch_reason, old) == "context rebuilt"
        assert run_on(node, _stale_reason, fresh) == "valid"
    with pytest.raises(GpuRefStale, match="context rebuilt"):
        ask(device_a, xa.CopyToHost(old))  # the device itself refuses the old generation
    ask(device_a, xa.Free(fresh))


# -- budgets ---------------------------------------------------------------------------------------
def _ask_from_b(device: Any, sizes: list[int]) -> list[str]:
    """On B: one Allocate per size, all in flight at once; what each got."""
    pending = [device.ask.remote(xa.Allocate(n)) for n in sizes]
    out = []
    for p in pending:
        try:
            ray_get(p, "budget", 30)
            out.append("ok")
        except BudgetExceeded:
            out.append("refused")
    return out


def _slabs_from_b(device: Any) -> tuple[int, str]:
    client = SlabClient(device, slab_bytes=4 << 20)  # larger than the budget: it falls back
    first = client.allocate(300 << 10)
    try:
        client.allocate(800 << 10)
    except BudgetExceeded as exc:
        return first.nbytes, type(exc).__name__
    return first.nbytes, "granted"


def test_a_budget_on_a_holds_whatever_b_asks(cluster: Any) -> None:
    device = start_ray_device(0, node_id=cluster.a, resource="async+budget:1MiB", max_restarts=0)
    try:
        got = run_on(cluster.b, _ask_from_b, device, [300 << 10] * 6)
        assert got.count("ok") == 3 and got.count("refused") == 3
        stats = ask(device, xa.GetStats())
        assert stats.bytes_outstanding <= 1 << 20 and stats.live_blocks == 3
        with pytest.raises(BudgetExceeded) as info:
            ask(device, xa.Allocate(2 << 20))
        assert info.value.limit == 1 << 20  # the error's context survived Ray
        assert ask(device, xa.GetStats()).live_blocks == 3
        ask(device, xa.Rebuild())  # drops the three, so the slab client below starts empty
        assert run_on(cluster.b, _slabs_from_b, device) == (300 << 10, "BudgetExceeded")
        assert ask(device, xa.GetStats()).bytes_outstanding <= 1 << 20
    finally:
        ray.kill(device, no_restart=True)


# -- a dead node -----------------------------------------------------------------------------------
def test_a_dead_node_fails_fetches_and_calls_with_typed_errors(cluster: Any) -> None:
    doomed = cluster.cluster.add_node(num_cpus=1, node_ip_address=cluster.loopback)
    cluster.cluster.wait_for_nodes()
    device = start_ray_device(0, node_id=doomed.node_id, max_restarts=1)
    ref = ask(device, xa.Allocate(64))
    assert fetch(ref).nbytes == 64
    cluster.cluster.remove_node(doomed)
    t0 = time.monotonic()
    with pytest.raises(GpuRefStale, match="device state dropped"):
        ref.access(timeout_s=5)
    with pytest.raises(GpuRefStale, match="device state dropped"):
        fetch(ref, timeout_s=5)
    # The device cannot come back: its node affinity is hard, and the node is gone.
    with pytest.raises(DeviceUnavailable):
        ray_get(device.ask.remote(xa.Allocate(64)), "dead node", 10)
    with pytest.raises(DeviceUnavailable):
        SlabClient(device, timeout_s=10).allocate(64)
    assert time.monotonic() - t0 < 30


# -- poisoning -------------------------------------------------------------------------------------
def _driver_turning_sticky() -> xa.Driver:
    """A host driver whose device meets a sticky error some calls after it started (in the worker)."""
    driver = xa.HostDriver(device_count=2)
    driver.inject_fault(1, "sticky", after_calls=40)
    return driver


def test_a_poisoned_device_stops_its_descriptors_validating(cluster: Any) -> None:
    device = start_ray_device(1, node_id=cluster.a, driver_factory=_driver_turning_sticky, max_restarts=0)
    try:
        first = ask(device, xa.Allocate(64))
        assert first.access() is first
        deadline = time.monotonic() + 30
        with pytest.raises(ContextPoisoned):  # the loop ends at the sticky error
            while True:
                assert time.monotonic() < deadline, "the planted sticky error never fired"
                ask(device, xa.Free(ask(device, xa.Allocate(64))))
        # The keeper was told before the asker got the error: no window.
        assert _stale_reason(first) == "context poisoned"
        assert run_on(cluster.b, _stale_reason, first) == "context poisoned"
        assert run_on(cluster.b, _fetch_reason, first) == "context poisoned"
        with pytest.raises(ContextPoisoned):
            ask(device, xa.Allocate(64))
    finally:
        ray.kill(device, no_restart=True)


def test_a_poisoned_device_can_restart_on_a_new_generation(cluster: Any) -> None:
    device = start_ray_device(
        1, node_id=cluster.a, driver_factory=_driver_turning_sticky, max_restarts=1, restart_on_poison=True
    )
    try:
        first = ask(device, xa.Allocate(64))
        deadline = time.monotonic() + 30
        # The asker sees the sticky error, or the worker already gone (Ray's restart).
        with pytest.raises((ContextPoisoned, DeviceUnavailable)):  # the loop ends at the sticky error
            while True:
                assert time.monotonic() < deadline, "the planted sticky error never fired"
                ask(device, xa.Free(ask(device, xa.Allocate(64))))
        # Poisoned before the process ended, rebuilt once the new process bumped: never valid.
        assert _stale_reason(first) in ("context poisoned", "context rebuilt")
        fresh = wait_generation(device, first.generation + 1)
        assert _stale_reason(first) == "context rebuilt"
        assert run_on(cluster.b, _stale_reason, fresh) == "valid"
        assert ask(device, xa.GetStats()).status == "running"
    finally:
        ray.kill(device, no_restart=True)


# -- the local path --------------------------------------------------------------------------------
class _Worker:
    """A worker Ray actor on the device's node, allocating through a SlabClient."""

    def __init__(self, device: Any) -> None:
        self.client = SlabClient(device, slab_bytes=1 << 20)

    def churn(self, count: int) -> list[RemoteGpuRef]:
        kept = []
        for i in range(count):
            ref = self.client.allocate(1000 + i % 7)
            if i % 2:
                self.client.free(ref)
            else:
                kept.append(ref)
        return kept

    def refresh(self) -> int:
        return self.client.refresh()

    def close(self) -> None:
        self.client.close()


def test_a_slab_client_on_the_node_allocates_without_a_ray_call_each(cluster: Any, device_a: Any) -> None:
    worker = ray.remote(_Worker).options(num_cpus=0, scheduling_strategy=on(cluster.a)).remote(device_a)
    try:
        kept = ray_get(worker.churn.remote(400), "worker", 30)
        # 400 allocations, one reservation: the device saw one Allocate.
        assert ask(device_a, xa.GetStats()).live_blocks == 1
        spans = sorted((r.ptr, r.ptr + r.nbytes) for r in kept)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
        assert len({r.carve for r in kept}) == len(kept) and all(r.node_id == cluster.a for r in kept)
        assert run_on(cluster.b, _stale_reason, kept[0]) == "valid"
        assert fetch(kept[1]).nbytes == kept[1].nbytes  # a carve's bytes, read at its offset
        with pytest.raises(InvalidRequest, match="carve"):
            ask(device_a, xa.Free(kept[0]))  # a carve is freed where it was carved
        with pytest.raises(InvalidRequest, match="whole block"):
            ask(device_a, xa.Fill(kept[0], 1))

        # A restart stales every carve; the client adopts the new generation at its next Ray call.
        generation = kept[0].generation
        ray.kill(device_a, no_restart=False)
        wait_generation(device_a, generation + 1)
        assert _stale_reason(kept[0]) == "context rebuilt"
        assert ray_get(worker.refresh.remote(), "worker", 30) == generation + 1
        again = ray_get(worker.churn.remote(10), "worker", 30)
        assert {r.generation for r in again} == {generation + 1} and again[0].access() is again[0]
        ray_get(worker.close.remote(), "worker", 30)
        assert ask(device_a, xa.GetStats()).live_blocks == 1  # wait_generation's own block
        with pytest.raises(GpuRefStale, match="released"):
            fetch(again[0])
    finally:
        ray.kill(worker)


# -- the worked example ----------------------------------------------------------------------------
def test_the_example_pipeline_survives_a_producer_restart(cluster: Any) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(xa.__file__).resolve().parent.parent / "examples" / "ray_pipeline.py"
    spec = importlib.util.spec_from_file_location("ray_pipeline_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    lines: list[str] = []
    out = example.run_pipeline(cluster.a, cluster.b, batches=5, nbytes=64 << 10, kill_at=2, log=lines.append)
    assert out == {"verified": 5, "redone": 1, "generations": 1}, lines
    assert any("killed" in line for line in lines) and any("produced again" in line for line in lines)
