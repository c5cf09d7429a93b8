"""A device as a Ray actor on the session's simulated cluster (host driver, conftest.py): the
device on node A, this test process (the Ray driver) on the head; allocation through Ray,
descriptors that travel, the cluster generation bumped by a restart and by a rebuild, bad input
that changes nothing (a dead node: test_ray_cluster.py).

Marked ``ray``; skipped with a reason where ray is not installed.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors.errors import DeviceUnavailable, GpuRefStale, InvalidRequest
from xlog_actors.ray import RemoteGpuRef, find_keeper, start_ray_device

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'xlog-actors[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(90)]


@pytest.fixture
def device(cluster: Any) -> Iterator[Any]:
    handle = start_ray_device(0, node_id=cluster.device, max_restarts=1)
    yield handle
    ray.kill(handle, no_restart=True)


def ask(handle: Any, message: Any) -> Any:
    return ray.get(handle.ask.remote(message), timeout=30)


def wait_generation(handle: Any, generation: int, timeout_s: float = 30.0) -> RemoteGpuRef:
    """The first allocation that succeeds on ``generation``: Ray answers 'unavailable' while it
    restarts the actor, and no event says when it is back, so this retries until a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ref: RemoteGpuRef = ask(handle, xa.Allocate(256))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            ref = None  # type: ignore[assignment]
        if ref is not None and ref.generation == generation:
            return ref
        assert time.monotonic() < deadline, f"no allocation on generation {generation} in {timeout_s} s"
        time.sleep(0.01)


def test_allocate_free_through_ray(cluster: Any, device: Any) -> None:
    generation = ray.get(device.generation.remote(), timeout=30)
    ref = ask(device, xa.Allocate(1024, tag=xa.AllocTag("weights")))
    assert isinstance(ref, RemoteGpuRef)
    assert (ref.ordinal, ref.generation, ref.nbytes, ref.tag) == (0, generation, 1024, "weights")
    assert ref.node_id == cluster.device == ray.get(device.node_id.remote(), timeout=30)
    assert ref.access() is ref
    assert ask(device, xa.GetStats()).live_blocks == 1
    many = ask(device, xa.AllocateMany([64, 128]))
    assert [r.nbytes for r in many] == [64, 128]
    assert len({r.serial for r in [ref, *many]}) == 3
    for r in [ref, *many]:
        assert ask(device, xa.Free(r)) is None
    stats = ask(device, xa.GetStats())
    assert (stats.live_blocks, stats.bytes_outstanding) == (0, 0)
    assert ask(device, xa.Free(ref)) is None  # idempotent
    assert ask(device, xa.GetStats()).live_blocks == 0


def test_descriptor_travels_and_validates_elsewhere(device: Any) -> None:
    ref = ask(device, xa.Allocate(512))
    assert pickle.loads(pickle.dumps(ref)) == ref

    @ray.remote(num_cpus=0)
    def check(r: RemoteGpuRef) -> int:
        return r.access().generation

    assert ray.get(check.remote(ref), timeout=30) == ref.generation
    ask(device, xa.Free(ref))


def test_restart_bumps_the_generation_and_stales_old_descriptors(device: Any) -> None:
    old = ask(device, xa.Allocate(1024))
    ray.kill(device, no_restart=False)
    fresh = wait_generation(device, old.generation + 1)
    assert ray.get(device.generation.remote(), timeout=30) == old.generation + 1
    with pytest.raises(GpuRefStale, match="context rebuilt") as info:
        old.access()
    assert info.value.reason == "context rebuilt"
    assert f"generation {old.generation + 1}" in str(info.value)

    @ray.remote(num_cpus=0)
    def stale_elsewhere(r: RemoteGpuRef) -> str:
        try:
            r.access()
        except GpuRefStale as exc:
            return exc.reason
        return "valid"

    assert ray.get(stale_elsewhere.remote(old), timeout=30) == "context rebuilt"
    assert ask(device, xa.Free(old)) is None  # an older generation's free is a no-op
    assert fresh.access() is fresh
    assert ask(device, xa.GetStats()).live_blocks == 1
    ask(device, xa.Free(fresh))


def test_rebuild_bumps_the_generation_once(device: Any) -> None:
    old = ask(device, xa.Allocate(64))
    ask(device, xa.Rebuild())
    # The relay hears the same rebuild's GenerationChanged: still exactly one bump.
    assert ray.get(device.generation.remote(), timeout=30) == old.generation + 1
    ask(device, xa.GetStats())  # a round trip after the relay's tell
    assert ray.get(device.generation.remote(), timeout=30) == old.generation + 1
    with pytest.raises(GpuRefStale, match="context rebuilt"):
        old.access()
    assert ask(device, xa.Free(old)) is None
    new = ask(device, xa.Allocate(64))
    assert new.generation == old.generation + 1
    assert new.access() is new
    ask(device, xa.Free(new))


def test_bad_input_changes_nothing(device: Any) -> None:
    ref = ask(device, xa.Allocate(256))
    before = ask(device, xa.GetStats())
    generation = ray.get(device.generation.remote(), timeout=30)
    foreign = RemoteGpuRef(ref.node_id, 5, ref.generation, ref.ptr, ref.nbytes, ref.tag, None, ref.serial)
    other_node = RemoteGpuRef("0" * 56, 0, ref.generation, ref.ptr, ref.nbytes, ref.tag, None, ref.serial)
    for bad, match in [
        ("hello", "not str"),
        (xa.GetClient(), "not GetClient"),
        (xa.Free(42), "takes a RemoteGpuRef"),  # type: ignore[arg-type]
        (xa.Free(foreign), "not of this device"),  # type: ignore[arg-type]
        (xa.Free(other_node), "not of this device"),  # type: ignore[arg-type]
        (xa.Allocate(-1), "nbytes"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            ask(device, bad)
    after = ask(device, xa.GetStats())
    assert (after.live_blocks, after.bytes_outstanding) == (before.live_blocks, before.bytes_outstanding)
    assert ray.get(device.generation.remote(), timeout=30) == generation
    assert ref.access() is ref
    assert ask(device, xa.Free(ref)) is None


def test_shutdown_retires_the_generation(device: Any) -> None:
    ref = ask(device, xa.Allocate(64))
    ray.get(device.shutdown.remote(), timeout=30)
    with pytest.raises(GpuRefStale, match="device shutting down"):
        ref.access()
    with pytest.raises(DeviceUnavailable, match="shut down"):
        ask(device, xa.Allocate(64))
    ray.get(device.shutdown.remote(), timeout=30)  # idempotent


def test_descriptor_of_an_unknown_device_is_stale(cluster: Any) -> None:
    ref = RemoteGpuRef("f" * 56, 7, 1, 0x1000, 16, "untagged", None, 1)
    assert find_keeper(ref.node_id, ref.ordinal) is None
    with pytest.raises(GpuRefStale, match="device state dropped"):
        ref.access()


def test_a_device_that_cannot_start_leaves_no_keeper(cluster: Any) -> None:
    device = start_ray_device(9, max_restarts=0)  # the host driver has one device
    with pytest.raises(ray.exceptions.RayActorError, match="device ordinal 9 out of range"):
        ask(device, xa.GetStats())
    assert find_keeper(ray.get_runtime_context().get_node_id(), 9) is None


def test_a_dead_keeper_is_a_typed_error(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import xlog_actors.ray.remote_ref as remote_ref
    from xlog_actors.ray import GenerationKeeper

    keeper = ray.remote(GenerationKeeper).options(num_cpus=0).remote()
    generation = ray.get(keeper.bump.remote(), timeout=30)
    ray.kill(keeper)
    # ray.kill returns before the actor is gone: a call may still be answered until it is.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(keeper.state.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.01)
    ref = RemoteGpuRef("e" * 56, 0, generation, 0x1000, 16, "untagged", None, 1)
    monkeypatch.setattr(remote_ref, "find_keeper", lambda node_id, ordinal: keeper)
    with pytest.raises(GpuRefStale, match="the generation keeper died"):
        ref.access()


class _SilentKeeper:
    def __init__(self) -> None:
        self._answer = threading.Event()

    def state(self) -> tuple[int, str | None]:
        self._answer.wait(30)  # never set: the keeper does not answer in time
        return 1, None


def test_a_keeper_that_does_not_answer_is_a_typed_error(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import xlog_actors.ray.remote_ref as remote_ref

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        keeper = ray.remote(_SilentKeeper).options(num_cpus=0).remote()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ref = RemoteGpuRef("d" * 56, 0, 1, 0x1000, 16, "untagged", None, 1)
    monkeypatch.setattr(remote_ref, "find_keeper", lambda node_id, ordinal: keeper)
    t0 = time.monotonic()
    with pytest.raises(DeviceUnavailable, match="did not answer in 0.5 s"):
        ref.access(timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    ray.kill(keeper)


def test_negative_max_restarts_is_refused(cluster: Any) -> None:
    with pytest.raises(InvalidRequest, match="max_restarts"):
        start_ray_device(0, max_restarts=-1)


def _driver_losing_its_context() -> xa.Driver:
    """A host driver whose context is lost some calls after the device started (in the worker)."""
    driver = xa.HostDriver(device_count=2)
    driver.inject_fault(1, "context_lost", after_calls=40)
    return driver


def test_a_supervised_rebuild_bumps_the_generation(cluster: Any) -> None:
    # The factory is defined here, in a module the workers cannot import: ship it by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    device = start_ray_device(1, node_id=cluster.device, driver_factory=_driver_losing_its_context, max_restarts=0)
    try:
        first = ask(device, xa.Allocate(64))
        deadline = time.monotonic() + 30
        # The relay bumps the keeper when the device tells its GenerationChanged: no event reaches
        # this process, so it polls the keeper until a deadline.
        while ray.get(device.generation.remote(), timeout=30) == first.generation:
            assert time.monotonic() < deadline, "the supervisor's rebuild never bumped the generation"
            try:
                ask(device, xa.Free(ask(device, xa.Allocate(64))))
            except xa.ContextLost:
                pass
        assert ray.get(device.generation.remote(), timeout=30) == first.generation + 1
        assert ask(device, xa.GetStats()).restarts == 1
        with pytest.raises(GpuRefStale, match="context rebuilt"):
            first.access()
        fresh = ask(device, xa.Allocate(64))
        assert fresh.generation == first.generation + 1 and fresh.access() is fresh
    finally:
        ray.kill(device, no_restart=True)
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Listener:
    """A subscriber of a device: records every ``GenerationChanged`` it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, str]] = []

    def on_generation_changed(self, message: xa.GenerationChanged) -> None:
        self.seen.append((message.device_id, message.generation, message.status))

    def messages(self) -> list[tuple[int, int, str]]:
        return list(self.seen)


def heard(listener: Any, want: tuple[int, int, str], timeout_s: float = 30.0) -> list[tuple[int, int, str]]:
    """The listener's messages once ``want`` is among them (told fire-and-forget: polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen: list[tuple[int, int, str]] = ray.get(listener.messages.remote(), timeout=30)
        if want in seen:
            return seen
        assert time.monotonic() < deadline, f"{want} not heard in {timeout_s} s: {seen}"
        time.sleep(0.02)


def test_a_subscriber_on_another_node_hears_rebuilds_and_restarts(cluster: Any, device: Any) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_b = NodeAffinitySchedulingStrategy(node_id=cluster.b, soft=False)
    listener = Listener.options(scheduling_strategy=on_b).remote()
    witness = Listener.options(scheduling_strategy=on_b).remote()
    generation = ray.get(device.generation.remote(), timeout=30)
    assert ask(device, xa.Subscribe(listener)) is None
    assert ask(device, xa.Subscribe(listener)) is None  # a second subscription is a no-op
    ask(device, xa.Rebuild("test"))
    heard(listener, (0, generation + 1, "running"))
    ray.kill(device, no_restart=False)  # Ray restarts it: the restart's bump is told too
    wait_generation(device, generation + 2)
    seen = heard(listener, (0, generation + 2, "running"))
    assert seen.count((0, generation + 1, "running")) == 1, seen
    assert ask(device, xa.Unsubscribe(listener)) is None
    assert ask(device, xa.Subscribe(witness)) is None
    ask(device, xa.Rebuild("after"))
    heard(witness, (0, generation + 3, "running"))
    assert (0, generation + 3, "running") not in ray.get(listener.messages.remote(), timeout=30)
    with pytest.raises(InvalidRequest, match="on_generation_changed"):
        ask(device, xa.Subscribe("not an actor"))  # type: ignore[arg-type]
    ray.kill(listener)
    ray.kill(witness)
