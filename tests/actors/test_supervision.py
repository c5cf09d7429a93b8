"""Supervision on the host driver, with
``HostDriver.inject_fault``."""

from __future__ import annotations

import gc
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.device_context import DeviceContext
from xlog_actors.actors.supervisor import Directive


@pytest.fixture(autouse=True)
def stop_all(host_driver: xa.HostDriver) -> Iterator[None]:
    # Depends on host_driver so that the actors stop before the driver closes.
    yield
    pykka.ActorRegistry.stop_all()


def start(driver: xa.HostDriver, **kwargs: Any) -> pykka.ActorRef[Any]:
    return xa.DeviceActor.start(0, driver=driver, **kwargs)


def stats(device: pykka.ActorRef[Any]) -> xa.DeviceStats:
    return device.ask(xa.GetStats())


def stale_reason(ref: xa.GpuRef) -> str:
    with pytest.raises(xa.GpuRefStale) as info:
        ref.access()
    return info.value.reason


class Listener(pykka.ThreadingActor):
    def __init__(self) -> None:
        super().__init__()
        self.events: queue.Queue[xa.GenerationChanged] = queue.Queue()

    def on_receive(self, message: Any) -> Any:
        self.events.put(message)


def subscribe(device: pykka.ActorRef[Any]) -> queue.Queue[xa.GenerationChanged]:
    listener = Listener.start()
    device.ask(xa.Subscribe(listener))
    return listener.proxy().events.get()


# -- the Supervisor itself --------------------------------------------------------------------------


def test_decider_by_error_class() -> None:
    decide = xa.Supervisor.decide
    assert decide(xa.OutOfMemory("x", requested=1)) is Directive.RESUME
    assert decide(xa.BudgetExceeded("x", requested=1, limit=0, outstanding=0)) is Directive.RESUME
    for error in (
        xa.InvalidRequest("x"),
        xa.StreamMisuse("x"),
        xa.UseAfterFree("x", generation=1),
        xa.GpuRefStale("released"),
        xa.DriverError("x", code="CUDA_ERROR_INVALID_VALUE"),
    ):
        assert decide(error) is Directive.RESUME, error
    assert decide(xa.ContextLost("x")) is Directive.REBUILD
    assert decide(RuntimeError("bug")) is Directive.REBUILD
    assert decide(KeyError("bug")) is Directive.REBUILD
    assert decide(xa.ContextPoisoned("x", code="CUDA_ERROR_ILLEGAL_ADDRESS")) is Directive.POISON


def test_restart_intensity_window() -> None:
    sup = xa.Supervisor()
    assert (sup.max_restarts, sup.within_s, sup.on_poisoned) == (3, 60.0, xa.stop_device)
    sup = xa.Supervisor(max_restarts=2, within_s=10.0)
    assert sup.allow_restart(0, now=100.0)
    assert sup.allow_restart(0, now=101.0)
    assert not sup.allow_restart(0, now=102.0)  # the third within 10 s
    assert sup.allow_restart(1, now=102.0)  # kept per device
    assert sup.allow_restart(0, now=110.5)  # the first left the window
    assert not sup.allow_restart(0, now=110.6)
    zero = xa.Supervisor(max_restarts=0)
    assert not zero.allow_restart(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_restarts": -1}, {"max_restarts": 1.5}, {"max_restarts": True}, {"within_s": 0}, {"within_s": "1"},
        {"on_poisoned": "log"},
    ],
)
def test_supervisor_arguments_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(xa.InvalidRequest):
        xa.Supervisor(**kwargs)


# -- each fault kind --------------------------------------------------------------------------------


def test_oom_resumes(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    keep = device.ask(xa.Allocate(1000))
    host_driver.inject_fault(0, "oom")
    with pytest.raises(xa.OutOfMemory) as info:
        device.ask(xa.Allocate(4096))
    assert info.value.requested == 4096
    s = stats(device)
    assert (s.generation, s.restarts, s.status, s.bytes_outstanding) == (0, 0, "running", 1000)
    assert keep.access().nbytes == 1000
    assert device.ask(xa.Allocate(4096)).generation == 0


def test_real_oom_resumes(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    with pytest.raises(xa.OutOfMemory):
        device.ask(xa.Allocate(128 << 20))  # twice the device
    s = stats(device)
    assert (s.generation, s.restarts, s.status, s.bytes_outstanding) == (0, 0, "running", 0)


def test_driver_error_resumes(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    keep = device.ask(xa.Allocate(1000))
    host_driver.inject_fault(0, "error")
    with pytest.raises(xa.DriverError) as info:
        device.ask(xa.Allocate(64))
    assert not isinstance(info.value, xa.ContextLost)
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    s = stats(device)
    assert (s.generation, s.restarts, s.status, s.bytes_outstanding) == (0, 0, "running", 1000)
    assert keep.access().nbytes == 1000


def test_driver_error_on_a_dropped_handles_free_is_retried(
    host_driver: xa.HostDriver, caplog: pytest.LogCaptureFixture
) -> None:
    device = start(host_driver)
    ref = device.ask(xa.Allocate(1000))
    host_driver.inject_fault(0, "error")
    del ref  # its free is told to the actor, and fails there
    gc.collect()
    assert device.is_alive()
    s = stats(device)  # the failed free was retried before reporting: nothing leaks
    assert (s.bytes_outstanding, s.live_blocks, s.generation, s.status) == (0, 0, 0, "running")
    assert host_driver.live_allocations(0) == 0
    # reported, not swallowed
    assert any(isinstance(r.exc_info and r.exc_info[1], xa.DriverError) for r in caplog.records)


def test_context_lost_rebuilds(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    events = subscribe(device)
    old = device.ask(xa.AllocateMany([1000, 2000]))
    host_driver.inject_fault(0, "context_lost")
    with pytest.raises(xa.ContextLost):
        device.ask(xa.Allocate(64))
    s = stats(device)
    assert (s.generation, s.restarts, s.status, s.bytes_outstanding, s.live_blocks) == (1, 1, "running", 0, 0)
    assert [stale_reason(r) for r in old] == ["context rebuilt"] * 2
    assert events.get(timeout=2) == xa.GenerationChanged(0, 1, "running")
    new = device.ask(xa.Allocate(64))
    assert new.generation == 1 and new.access().nbytes == 64
    assert host_driver.live_allocations(0) == 1
    del old
    gc.collect()
    assert stats(device).bytes_outstanding == 64 and host_driver.live_allocations(0) == 1


def test_sticky_poisons(host_driver: xa.HostDriver) -> None:
    calls: list[tuple[int, BaseException]] = []
    device = start(host_driver, supervisor=xa.Supervisor(on_poisoned=lambda d, e: calls.append((d, e))))
    events = subscribe(device)
    refs = device.ask(xa.AllocateMany([64, 128]))
    client = device.ask(xa.GetClient())
    host_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned) as info:
        device.ask(xa.Allocate(64))
    assert info.value.code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert [stale_reason(r) for r in refs] == ["context poisoned"] * 2
    assert events.get(timeout=2) == xa.GenerationChanged(0, 0, "poisoned")
    for request in (xa.Allocate(64), xa.AllocateMany([64]), xa.Rebuild("try"), xa.Allocate(0)):
        with pytest.raises(xa.ContextPoisoned):
            device.ask(request)
    with pytest.raises(xa.ContextPoisoned):
        client.allocate(64)
    with pytest.raises(xa.ContextPoisoned):
        client.allocate_many([64])
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.GetClient()).allocate(64)
    assert device.is_alive()
    s = stats(device)
    assert (s.status, s.generation, s.restarts) == ("poisoned", 0, 0)
    assert len(calls) == 1
    assert calls[0][0] == 0 and isinstance(calls[0][1], xa.ContextPoisoned)
    assert events.empty()


def test_poisoned_hook_that_raises_does_not_kill_the_device(host_driver: xa.HostDriver) -> None:
    def hook(device_id: int, error: BaseException) -> None:
        raise RuntimeError("hook failed")

    device = start(host_driver, supervisor=xa.Supervisor(on_poisoned=hook))
    host_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(64))
    assert device.is_alive()
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(64))


def test_exit_process_hook_ends_the_process_with_exit_poisoned() -> None:
    script = (
        "import xlog_actors as xa\n"
        "d = xa.HostDriver(memory_per_device=1 << 20)\n"
        "dev = xa.DeviceActor.start(0, driver=d, supervisor=xa.Supervisor(on_poisoned=xa.exit_process))\n"
        "d.inject_fault(0, 'sticky')\n"
        "try:\n"
        "    dev.ask(xa.Allocate(64), timeout=10)\n"
        "except Exception as e:\n"
        "    print('answered', type(e).__name__)\n"
        "import time; time.sleep(10)\n"
        "print('still running')\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert proc.returncode == xa.EXIT_POISONED == 75, proc.stderr
    assert "still running" not in proc.stdout


# -- rebuild accounting -----------------------------------------------------------------------------


def test_50_rebuilds_in_a_row_leak_nothing(host_driver: xa.HostDriver) -> None:
    device = start(host_driver, supervisor=xa.Supervisor(max_restarts=100))
    client = device.ask(xa.GetClient())
    baseline_mem = host_driver.mem_info(0)
    baseline_threads = threading.active_count()
    every_old: list[xa.GpuRef] = []
    for i in range(50):
        assert stats(device).generation == i
        refs = device.ask(xa.AllocateMany([4096] * 8)) + [client.allocate(8192)]
        assert all(r.generation == i for r in refs)
        assert stats(device).bytes_outstanding == 8 * 4096 + 8192
        every_old.extend(refs)
        host_driver.inject_fault(0, "context_lost", after_calls=i % 3)
        held = []  # held: a dropped handle's free would be the call that meets the fault
        with pytest.raises(xa.ContextLost):
            for _ in range(3):
                held.append(device.ask(xa.Allocate(64)))
        every_old.extend(held)
        s = stats(device)
        assert (s.generation, s.restarts, s.bytes_outstanding, s.live_blocks) == (i + 1, i + 1, 0, 0)
        assert host_driver.mem_info(0) == baseline_mem
        assert host_driver.live_allocations(0) == 0
    assert {stale_reason(r) for r in every_old} == {"context rebuilt"}
    del refs, every_old
    gc.collect()
    s = stats(device)
    assert (s.generation, s.status, s.bytes_outstanding) == (50, "running", 0)
    assert host_driver.mem_info(0) == baseline_mem
    assert threading.active_count() <= baseline_threads + 1  # no stream threads of old contexts left
    keep = device.ask(xa.Allocate(100))
    assert stats(device).bytes_outstanding == 100 and keep.generation == 50


def test_explicit_rebuilds_do_not_count_against_the_intensity(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    for _ in range(5):
        device.ask(xa.Rebuild())
    for _ in range(3):
        host_driver.inject_fault(0, "context_lost")
        with pytest.raises(xa.ContextLost):
            device.ask(xa.Allocate(64))
    s = stats(device)
    assert (s.status, s.generation, s.restarts) == ("running", 8, 8)


def test_fourth_failure_within_the_window_stops_the_device(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    events = subscribe(device)
    client = device.ask(xa.GetClient())
    for i in range(3):
        host_driver.inject_fault(0, "context_lost")
        with pytest.raises(xa.ContextLost):
            device.ask(xa.Allocate(64))
        assert stats(device).status == "running"
        assert events.get(timeout=2) == xa.GenerationChanged(0, i + 1, "running")
    ref = device.ask(xa.Allocate(64))
    host_driver.inject_fault(0, "context_lost")
    with pytest.raises(xa.ContextLost):
        device.ask(xa.Allocate(64))
    assert events.get(timeout=2) == xa.GenerationChanged(0, 3, "stopped")
    assert stale_reason(ref) == "device shutting down"
    for request in (xa.Allocate(64), xa.AllocateMany([8]), xa.Rebuild(), xa.Allocate(0)):
        with pytest.raises(xa.DeviceUnavailable):
            device.ask(request)
    with pytest.raises(xa.DeviceUnavailable):
        client.allocate(64)
    assert device.is_alive()
    s = stats(device)
    assert (s.status, s.generation, s.restarts) == ("stopped", 3, 3)
    time.sleep(0.05)
    assert events.empty()  # stopped once, however many requests were refused since
    # a stopped device still owns its ordinal until its actor is stopped
    with pytest.raises(xa.InvalidRequest):
        start(host_driver)
    device.stop()
    # a new actor for the ordinal rebuilds the context the old one left lost
    assert start(host_driver).ask(xa.Allocate(8)).access().nbytes == 8


def crash_next_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next ``DeviceContext.allocate`` raise a bug of the actor's own code, once."""
    real = DeviceContext.allocate
    crashes = [1]

    def crashing(self: DeviceContext, *args: Any) -> Any:
        if crashes:
            crashes.pop()
            raise RuntimeError("a bug in the actor's code")
        return real(self, *args)

    monkeypatch.setattr(DeviceContext, "allocate", crashing)


def test_crash_of_the_actors_own_code_rebuilds(host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    device = start(host_driver)
    old = device.ask(xa.Allocate(64))
    crash_next_allocation(monkeypatch)
    with pytest.raises(RuntimeError, match="a bug"):
        device.ask(xa.Allocate(64))
    s = stats(device)
    assert (s.generation, s.restarts, s.status) == (1, 1, "running")
    assert stale_reason(old) == "context rebuilt"
    assert device.ask(xa.Allocate(64)).generation == 1


def test_crash_in_the_runtime_rebuilds(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    ctx = device.ask(xa.GetClient())._cell.lifecycle.context

    def crashing(*args: Any) -> Any:
        raise KeyError("runtime bug")

    ctx.runtime.allocate = crashing
    ctx.rebind_runtime()
    with pytest.raises(KeyError):
        device.ask(xa.Allocate(64))
    assert stats(device).generation == 1
    assert device.ask(xa.Allocate(64)).generation == 1


def test_told_message_that_crashes_rebuilds_and_actor_lives_on(
    host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = start(host_driver)
    crash_next_allocation(monkeypatch)
    device.tell(xa.Allocate(64))
    device.tell(xa.Free(object()))  # type: ignore[arg-type]
    device.tell(xa.Allocate(0))
    s = stats(device)
    assert device.is_alive()
    assert (s.generation, s.restarts, s.status) == (1, 1, "running")
    with pytest.raises(xa.InvalidRequest):  # still owns its ordinal
        start(host_driver)


def test_on_start_that_raises_leaves_the_actor_reachable_and_a_later_request_retries(
    host_driver: xa.HostDriver,
) -> None:
    failures = [3]

    def factory(driver: xa.Driver, ordinal: int, pool: xa.StreamPool) -> xa.DeviceMemoryResource:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("resource factory failed")
        return xa.AsyncCudaResource(driver, ordinal, pool)

    device = start(host_driver, resource=factory, supervisor=xa.Supervisor(max_restarts=10))
    assert device.is_alive()
    # on_start failed (and so did the rebuild it tried): each request retries once and is
    # answered with a typed error while the build keeps failing
    s = stats(device)  # answered once on_start has run (pykka runs it in the actor's thread)
    assert (s.status, failures[0]) == ("broken", 1)
    with pytest.raises(xa.DeviceUnavailable, match="next request tries again"):
        device.ask(xa.Allocate(64))
    assert failures[0] == 0
    assert device.is_alive() and stats(device).status == "broken"
    ref = device.ask(xa.Allocate(64))
    assert ref.access().nbytes == 64
    s = stats(device)
    assert s.status == "running" and s.bytes_outstanding == 64
    with pytest.raises(xa.InvalidRequest):  # it owns its ordinal all along
        start(host_driver)


def test_on_start_that_always_raises_stops_past_the_intensity(host_driver: xa.HostDriver) -> None:
    def factory(driver: xa.Driver, ordinal: int, pool: xa.StreamPool) -> xa.DeviceMemoryResource:
        raise RuntimeError("resource factory failed")

    device = start(host_driver, resource=factory)
    answers = []
    for _ in range(6):
        with pytest.raises(xa.XlogError) as info:
            device.ask(xa.Allocate(64))
        answers.append(type(info.value))
    assert answers[-1] is xa.DeviceUnavailable
    assert stats(device).status == "stopped"
    assert device.is_alive()


# -- requests during a rebuild -----------------------------------------------------------------------


def slow_rebuild(driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    started, gate = threading.Event(), threading.Event()
    real = driver.rebuild_context

    def rebuild_context(ordinal: int) -> None:
        started.set()
        assert gate.wait(10)
        real(ordinal)

    monkeypatch.setattr(driver, "rebuild_context", rebuild_context)
    return started, gate


def test_requests_during_a_rebuild_wait_and_are_served_by_the_new_context(
    host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = start(host_driver)
    client = device.ask(xa.GetClient())
    started, gate = slow_rebuild(host_driver, monkeypatch)
    rebuild = device.ask(xa.Rebuild("slow"), block=False)
    assert started.wait(5)
    answers: queue.Queue[tuple[str, Any]] = queue.Queue()

    def ask_many() -> None:
        futures = [device.ask(xa.Allocate(256), block=False) for _ in range(25)]
        for f in futures:
            try:
                answers.put(("ask", f.get(timeout=10)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                answers.put(("ask", exc))

    def client_many() -> None:
        for _ in range(25):
            try:
                answers.put(("client", client.allocate(256)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                answers.put(("client", exc))

    threads = [threading.Thread(target=ask_many) for _ in range(4)] + [
        threading.Thread(target=client_many) for _ in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join()
    assert rebuild.get(timeout=5) == 1
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    assert len(got) == 8 * 25  # every request answered exactly once
    refs = [v for _, v in got if isinstance(v, xa.GpuRef)]
    errors = [v for _, v in got if not isinstance(v, xa.GpuRef)]
    # Asks wait in the inbox; client calls that find no running context go through the actor
    # and wait the same way: every request is served by the new context.
    assert errors == []
    assert all(r.generation == 1 and r.access().nbytes == 256 for r in refs)
    assert len({r.raw_device_ptr() for r in refs}) == len(refs)
    assert stats(device).bytes_outstanding == 256 * len(refs)
    del refs, got
    gc.collect()
    assert stats(device).bytes_outstanding == 0


def test_client_allocation_in_flight_when_the_context_goes_away(
    host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client allocation that completed in a context a rebuild was taking away is not handed
    # out as an already-stale handle.
    device = start(host_driver)
    client = device.ask(xa.GetClient())
    ctx = client._cell.lifecycle.context
    inside, release = threading.Event(), threading.Event()
    real = ctx.runtime.allocate

    def allocate_then_stall(*args: Any) -> Any:
        block = real(*args)
        inside.set()
        assert release.wait(10)
        return block

    ctx.runtime.allocate = allocate_then_stall
    ctx.rebind_runtime()
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(client.allocate(512))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            result.append(exc)

    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(5)
    assert device.ask(xa.Rebuild()) == 1
    release.set()
    t.join()
    (answer,) = result
    # retried through the actor, which served it in the new context
    assert isinstance(answer, xa.GpuRef), answer
    assert answer.generation == 1 and answer.access().nbytes == 512
    result.clear()
    del answer
    gc.collect()
    assert stats(device).bytes_outstanding == 0


# -- a context lost from outside ------------------------------------------------------------------------


def test_context_lost_from_outside_detected_by_a_client(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    client = device.ask(xa.GetClient())
    old = client.allocate(64)
    host_driver.inject_fault(0, "context_lost")
    with pytest.raises(xa.ContextLost):
        client.allocate(64)
    s = stats(device)  # the report reached the actor before this request
    assert (s.generation, s.restarts, s.status) == (1, 1, "running")
    assert stale_reason(old) == "context rebuilt"
    assert client.allocate(64).generation == 1


def test_context_lost_from_outside_detected_by_many_client_threads_rebuilds_once(host_driver: xa.HostDriver) -> None:
    device = start(host_driver)
    client = device.ask(xa.GetClient())
    host_driver.inject_fault(0, "context_lost")
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run() -> None:
        barrier.wait()
        try:
            client.allocate(64)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors and all(isinstance(e, xa.XlogError) for e in errors)
    s = stats(device)
    assert (s.generation, s.restarts, s.status) == (1, 1, "running")


def test_context_lost_met_by_a_told_free_rebuilds(host_driver: xa.HostDriver) -> None:
    # The free of a dropped handle is told to the actor: the failure it meets is supervised all
    # the same (pykka would stop an actor whose told handler raised).
    device = start(host_driver)
    ref = device.ask(xa.Allocate(64))
    keep = device.ask(xa.Allocate(64))
    host_driver.inject_fault(0, "context_lost")
    del ref
    gc.collect()
    s = stats(device)
    assert (s.generation, s.restarts, s.bytes_outstanding, s.status) == (1, 1, 0, "running")
    assert device.is_alive()
    assert stale_reason(keep) == "context rebuilt"


# -- regressions found by the stateful test ---------------------------------------------------------


def _ask_a_bad_request_while_holding(device: pykka.ActorRef[Any], ref: xa.GpuRef) -> None:
    """This frame holds ``ref``; the refused request's traceback reaches it."""
    assert ref.nbytes == 1000
    with pytest.raises(xa.InvalidRequest):
        device.ask(xa.Allocate(0))


def test_a_refused_request_does_not_keep_the_askers_handles_alive(host_driver: xa.HostDriver) -> None:
    """pykka re-raises the actor's exception object in the asker's thread, whose traceback then
    reaches the asker's frames: a device that kept that object as its last error would keep the
    asker's handles, and their memory, alive."""
    device = start(host_driver)
    ref = device.ask(xa.Allocate(1000))
    _ask_a_bad_request_while_holding(device, ref)
    del ref
    gc.collect()
    s = stats(device)
    assert (s.bytes_outstanding, s.live_blocks) == (0, 0)


def test_a_loss_met_by_a_library_actor_attaching_after_a_rebuild_rebuilds_once(host_driver: xa.HostDriver) -> None:
    """One lost context, one rebuild: the copy actor meets the loss while it attaches to the new
    context after a rebuild, and reports it with that context's generation; the device, which
    found the loss itself on its next message and rebuilt, ignores the report."""
    device = start(host_driver)
    copy = xa.CopyActor.start(device)
    copy.ask(xa.Fill(device.ask(xa.Allocate(64)), 1))  # attached to generation 0
    device.ask(xa.Rebuild("detach the copy actor"))  # generation 1: it attaches again on its next work
    ref = device.ask(xa.Allocate(64))
    host_driver.inject_fault(0, "context_lost", after_calls=0)
    with pytest.raises(xa.ContextLost):
        copy.ask(xa.Fill(ref, 2))
    s = stats(device)
    assert (s.generation, s.restarts, s.status) == (2, 2, "running")  # the Rebuild asked for, and one for the loss
    fresh = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(fresh, 3))
    assert copy.ask(xa.CopyToHost(fresh, nbytes=4)) == b"\x03" * 4
    assert stats(device).generation == 2
