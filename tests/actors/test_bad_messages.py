"""No actor dies from a message, and every mistake is answered at once.

Told garbage is logged at warning level and dropped (the actor answers the next ask); asked
garbage gets ``InvalidRequest`` naming the message type and what was expected; a malformed
payload gets ``InvalidRequest`` naming the field and changes nothing; a bad configuration of
``DeviceActor.start`` or of a library actor's ``start`` is refused in the caller, with nothing
left running and nothing stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.messages import ReportFailure
from xlog_actors.actors.supervisor import SupervisedFailure
from xlog_actors.driver.kernel_library import SCALE_ADD_F32
from xlog_actors.memory.stack import LOG_ENV, RESOURCE_ENV

TIMEOUT = 5


@pytest.fixture
def device(host_driver: xa.HostDriver) -> Iterator[pykka.ActorRef[Any]]:
    ref = xa.DeviceActor.start(0, driver=host_driver)
    yield ref
    pykka.ActorRegistry.stop_all()


def counters(device: pykka.ActorRef[Any]) -> tuple[int, int, int, int, str]:
    s = device.ask(xa.GetStats(), timeout=TIMEOUT)
    return (s.generation, s.restarts, s.bytes_outstanding, s.live_blocks, s.status)


def running_actors() -> int:
    return len(pykka.ActorRegistry.get_all())


GARBAGE: list[Any] = ["garbage", 42, None, object(), ("a", "tuple"), xa.GenerationChanged]


# -- told garbage ---------------------------------------------------------------------------------
def test_told_garbage_leaves_the_device_actor_alive(
    device: pykka.ActorRef[Any], host_driver: xa.HostDriver, caplog: pytest.LogCaptureFixture
) -> None:
    keep = device.ask(xa.Allocate(1000), timeout=TIMEOUT)
    before = counters(device)
    malformed = [
        xa.Free("not a ref"), xa.Allocate("x"), xa.Allocate(10, stream="x"), xa.Allocate(10, tag=5),
        xa.AllocateMany("ab"), xa.Rebuild(5), xa.Subscribe(3), xa.Unsubscribe([]), ReportFailure("x", None),
        xa.CopyToDevice(keep, b"1"), xa.Launch(SCALE_ADD_F32, 1, 1, []),
    ]
    with caplog.at_level(logging.WARNING):
        for message in [*GARBAGE, *malformed]:
            device.tell(message)
        assert counters(device) == before  # answered: the actor lives, and nothing changed
    assert device.is_alive() and keep.access().nbytes == 1000
    assert host_driver.live_allocations(0) == 1
    module = "xlog_actors.actors.device_actor"
    dropped = [r for r in caplog.records if r.name == module and r.levelno == logging.WARNING]
    assert len(dropped) == len(GARBAGE) + len(malformed)
    assert any("str" in r.getMessage() for r in dropped)


@pytest.mark.parametrize("kind", ["copy", "kernel"])
def test_told_garbage_leaves_a_library_actor_alive(
    device: pykka.ActorRef[Any], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    actor_class = xa.CopyActor if kind == "copy" else xa.KernelActor
    actor = actor_class.start(device)
    ref = device.ask(xa.Allocate(16), timeout=TIMEOUT)
    malformed = [
        xa.CopyToDevice(ref, [1, 2, 3]), xa.Fill(ref, 300), xa.Allocate(16), xa.Launch("k", 1, 1, 5),
        xa.CopyToDevice("x", b"1"),
    ]
    with caplog.at_level(logging.WARNING):
        for message in [*GARBAGE, *malformed]:
            actor.tell(message)
        # a valid ask is answered
        if kind == "copy":
            actor.ask(xa.Fill(ref, 7), timeout=TIMEOUT)
            assert actor.ask(xa.CopyToHost(ref), timeout=TIMEOUT) == bytes([7] * 16)
        else:
            x = device.ask(xa.Allocate(16), timeout=TIMEOUT)
            actor.ask(xa.Launch(SCALE_ADD_F32, 1, 4, [xa.In(x), xa.Out(ref), 1.0, 0.0, 4]), timeout=TIMEOUT)
    assert actor.is_alive() and device.is_alive()
    module = f"xlog_actors.actors.{kind}_actor"
    dropped = [r for r in caplog.records if r.name == module and r.levelno == logging.WARNING]
    assert len(dropped) == len(GARBAGE) + len(malformed)


# -- asked garbage --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "expected"),
    [("device", "Allocate, AllocateMany"), ("copy", "CopyToDevice, CopyToHost"), ("kernel", "Launch")],
)
def test_asked_garbage_is_answered_with_invalid_request(device: pykka.ActorRef[Any], kind: str, expected: str) -> None:
    actor = {"device": lambda: device, "copy": lambda: xa.CopyActor.start(device),
             "kernel": lambda: xa.KernelActor.start(device)}[kind]()
    for message, name in [("garbage", "str"), (42, "int"), (xa.GetReport() if kind != "device" else 1.5, None)]:
        with pytest.raises(xa.InvalidRequest, match="does not understand") as info:
            actor.ask(message, timeout=TIMEOUT)
        text = str(info.value)
        assert (name or type(message).__name__) in text and f"expected {expected}" in text
    assert actor.is_alive()


# -- starting a library actor ---------------------------------------------------------------------
@pytest.mark.parametrize("actor_class", [xa.CopyActor, xa.KernelActor])
def test_a_library_actor_needs_a_running_device_actor(
    device: pykka.ActorRef[Any], host_driver: xa.HostDriver, actor_class: type[xa.CopyActor]
) -> None:
    copy = xa.CopyActor.start(device)
    kernels = xa.KernelActor.start(device)
    stopped = xa.DeviceActor.start(1, driver=host_driver)
    stopped.stop()
    count = running_actors()
    for bad, what in [
        (copy, "CopyActor"), (kernels, "KernelActor"), (stopped, "stopped DeviceActor"),
        ("device", "str"), (None, "NoneType"), (device.proxy(), "ActorProxy"),
    ]:
        with pytest.raises(xa.InvalidRequest, match="needs the ActorRef of a running DeviceActor") as info:
            actor_class.start(bad)
        assert what in str(info.value)
    assert running_actors() == count  # nothing started, nothing stopped
    assert copy.is_alive() and kernels.is_alive() and device.is_alive()
    ref = device.ask(xa.Allocate(8), timeout=TIMEOUT)
    copy.ask(xa.Fill(ref, 1), timeout=TIMEOUT)
    with pytest.raises(xa.InvalidRequest, match="track must be a bool"):
        actor_class.start(device, track="yes")


# -- malformed payloads ---------------------------------------------------------------------------
def test_malformed_copy_messages_name_the_field_and_change_nothing(
    device: pykka.ActorRef[Any], host_driver: xa.HostDriver
) -> None:
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(16), timeout=TIMEOUT)
    copy.ask(xa.Fill(ref, 9), timeout=TIMEOUT)
    copy.ask(xa.CopyToHost(ref), timeout=TIMEOUT)
    written_on = ref.last_write_stream
    before = (counters(device), host_driver.live_allocations(0))
    cases = [
        (xa.CopyToDevice(ref, [1, 2, 3]), "CopyToDevice.data"),
        (xa.CopyToDevice(ref, "text"), "CopyToDevice.data"),
        (xa.CopyToDevice(ref, None), "CopyToDevice.data"),
        (xa.CopyToDevice(ref, np.array([1, "a"], dtype=object)), "CopyToDevice.data"),
        (xa.CopyToDevice(ref, np.arange(32, dtype=np.uint8)[::2]), "CopyToDevice.data"),  # not contiguous
        (xa.CopyToDevice(ref, np.zeros(5, np.float32)), "CopyToDevice.data"),  # 20 bytes in 16
        (xa.CopyToDevice(ref, b""), "CopyToDevice.data"),
        (xa.CopyToDevice("ref", b"1"), "CopyToDevice.ref"),
        (xa.CopyToHost(ref, 0), "CopyToHost.nbytes"),
        (xa.CopyToHost(ref, 17), "CopyToHost.nbytes"),
        (xa.CopyToHost(ref, 1.5), "CopyToHost.nbytes"),
        (xa.CopyToHost([ref]), "CopyToHost.ref"),
        (xa.CopyDeviceToDevice(ref, "dst"), "CopyDeviceToDevice.dst"),
        (xa.CopyDeviceToDevice(1, ref), "CopyDeviceToDevice.src"),
        (xa.CopyDeviceToDevice(ref, ref), "CopyDeviceToDevice.dst"),
        (xa.Fill(ref, 256), "Fill.byte"),
        (xa.Fill(ref, -1), "Fill.byte"),
        (xa.Fill(ref, "a"), "Fill.byte"),
        (xa.Fill(ref, True), "Fill.byte"),
        (xa.Fill(None, 1), "Fill.ref"),
    ]
    for message, field in cases:
        with pytest.raises(xa.InvalidRequest, match=field.replace(".", r"\.")):
            copy.ask(message, timeout=TIMEOUT)
    assert copy.ask(xa.CopyToHost(ref), timeout=TIMEOUT) == bytes([9] * 16)  # no byte moved
    assert ref.last_write_stream == written_on
    assert (counters(device), host_driver.live_allocations(0)) == before
    assert copy.is_alive()


def test_a_float_array_is_a_plain_buffer_and_is_copied(device: pykka.ActorRef[Any]) -> None:
    copy = xa.CopyActor.start(device)
    data = np.arange(4, dtype=np.float32)
    ref = device.ask(xa.Allocate(data.nbytes), timeout=TIMEOUT)
    copy.ask(xa.CopyToDevice(ref, data), timeout=TIMEOUT)
    assert copy.ask(xa.CopyToHost(ref), timeout=TIMEOUT) == data.tobytes()


def test_malformed_launches_name_the_field_and_change_nothing(device: pykka.ActorRef[Any]) -> None:
    kernels = xa.KernelActor.start(device)
    x, y = device.ask(xa.AllocateMany([16, 16]), timeout=TIMEOUT)
    before = counters(device)
    cases = [
        (xa.Launch("scale_add", 1, 4, []), r"Launch\.kernel"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, 5), r"Launch\.args must be a list"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, [xa.In(x)]), r"Launch\.args: kernel"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, [x, xa.Out(y), 1.0, 0.0, 4]), r"Launch\.args\[0\]"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, [xa.In("x"), xa.Out(y), 1.0, 0.0, 4]), r"Launch\.args\[0\]"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, [xa.In(x), xa.Out(y), xa.In(x), 0.0, 4]), r"Launch\.args\[2\]"),
        (xa.Launch(SCALE_ADD_F32, 1, 4, [1, xa.Out(y), 1.0, 0.0, 4]), r"Launch\.args\[0\]"),
    ]
    for message, field in cases:
        with pytest.raises(xa.InvalidRequest, match=field):
            kernels.ask(message, timeout=TIMEOUT)
    assert y.last_write_stream is None and counters(device) == before and kernels.is_alive()


def test_malformed_device_messages_name_the_field_and_change_nothing(
    device: pykka.ActorRef[Any], host_driver: xa.HostDriver
) -> None:
    keep = device.ask(xa.Allocate(64), timeout=TIMEOUT)
    before = (counters(device), host_driver.live_allocations(0))
    cases = [
        (xa.Allocate(10, stream="x"), r"Allocate\.stream"),
        (xa.Allocate(10, stream=True), r"Allocate\.stream"),
        (xa.Allocate(10, tag=5), r"Allocate\.tag"),
        (xa.AllocateMany([8], tag=None), r"AllocateMany\.tag"),
        (xa.AllocateMany([8], stream=1.0), r"AllocateMany\.stream"),
        (xa.Rebuild(5), r"Rebuild\.reason"),
        (xa.Free("ref"), r"Free\.ref"),
        (xa.Subscribe("actor"), r"Subscribe\.actor_ref"),
        (xa.Unsubscribe([]), r"Unsubscribe\.actor_ref"),
        (ReportFailure("not an error", None), r"ReportFailure\.error"),
    ]
    for message, field in cases:
        with pytest.raises(xa.InvalidRequest, match=field):
            device.ask(message, timeout=TIMEOUT)
    assert (counters(device), host_driver.live_allocations(0)) == before
    assert keep.access().nbytes == 64


# -- DeviceActor.start checks its whole configuration ----------------------------------------------
BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"resource": "no-such-resource"}, "unknown base 'no-such-resource'"),
    ({"resource": ""}, "non-empty string"),
    ({"resource": "async+nope"}, "unknown adaptor 'nope'"),
    ({"resource": "async+budget"}, "needs a size"),
    ({"resource": "async+budget:lots"}, "size 'lots'"),
    ({"resource": "async+budget:0"}, "not a positive whole number"),
    ({"resource": "async+stats:1"}, "takes no argument"),
    ({"resource": "async+guard:abc"}, "size 'abc'"),
    ({"resource": "async+log:/nonexistent-dir/x.csv"}, "not a writable folder"),
    ({"resource": 5}, "stack description or a factory"),
    ({"supervisor": "strict"}, "supervisor must be a Supervisor"),
    ({"supervisor": xa.Supervisor}, "supervisor must be a Supervisor"),
    ({"ordinal": 2}, "out of range"),
    ({"ordinal": -1}, "out of range"),
    ({"ordinal": "0"}, "must be an int"),
    ({"driver": "gpu"}, "unknown driver kind 'gpu'"),
    ({"driver": 3.5}, "driver must be an xlog_actors Driver"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_CONFIGS, ids=[str(kw) for kw, _ in BAD_CONFIGS])
def test_a_bad_configuration_is_refused_before_start_returns(
    host_driver: xa.HostDriver, stop_actors: None, kwargs: dict[str, Any], match: str
) -> None:
    count = running_actors()
    args = {"ordinal": 0, "driver": host_driver, **kwargs}
    with pytest.raises(xa.InvalidRequest) as info:
        xa.DeviceActor.start(args.pop("ordinal"), **args)
    assert match in str(info.value)
    assert running_actors() == count
    # the ordinal was not claimed: a good configuration starts on it
    device = xa.DeviceActor.start(0, driver=host_driver)
    assert device.ask(xa.GetStats(), timeout=TIMEOUT).status == "running"


def test_a_bad_default_description_is_refused_at_start(
    host_driver: xa.HostDriver, stop_actors: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESOURCE_ENV, "no-such-stack")
    with pytest.raises(xa.InvalidRequest, match="unknown base 'no-such-stack'"):
        xa.DeviceActor.start(0, driver=host_driver)
    monkeypatch.setenv(RESOURCE_ENV, "direct")
    assert xa.DeviceActor.start(0, driver=host_driver).ask(xa.GetStats(), timeout=TIMEOUT).stack.startswith("direct")


def test_a_log_path_from_the_environment_is_checked_at_start(
    host_driver: xa.HostDriver, stop_actors: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOG_ENV, "/nonexistent-dir/alloc.csv")
    count = running_actors()
    with pytest.raises(xa.InvalidRequest, match="not a writable folder"):
        xa.DeviceActor.start(0, driver=host_driver, resource="async+log")
    assert running_actors() == count


def test_good_descriptions_start(host_driver: xa.HostDriver, stop_actors: None, tmp_path: Path) -> None:
    log = tmp_path / "alloc.csv"
    device = xa.DeviceActor.start(0, driver=host_driver, resource=f" Async+stats+budget:1MiB+guard:256+log:{log} ")
    stats = device.ask(xa.GetStats(), timeout=TIMEOUT)
    assert stats.status == "running" and "budget" in stats.stack
    device.stop()
    assert log.exists()


# -- supervision marks failures with a wrapper ----------------------------------------------------
def test_supervised_failure_is_an_immutable_wrapper() -> None:
    error = xa.DeviceUnavailable("gone")
    wrapped = SupervisedFailure(error)
    assert wrapped.error is error
    with pytest.raises(AttributeError, match="immutable"):
        wrapped.error = ValueError()  # type: ignore[misc]  # the property has no setter: that is the point
    with pytest.raises(AttributeError, match="immutable"):
        wrapped.note = 1  # type: ignore[attr-defined]  # setting any attribute is refused
    try:
        raise wrapped
    except SupervisedFailure as caught:  # raise itself may still set the traceback
        assert caught.__traceback__ is not None


def test_a_poisoned_devices_answers_are_the_bare_errors_and_count_no_restart(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver, supervisor=xa.Supervisor(max_restarts=1))
    try:
        host_driver.inject_fault(0, "sticky")
        errors = []
        for _ in range(5):
            with pytest.raises(xa.ContextPoisoned) as info:
                device.ask(xa.Allocate(64), timeout=TIMEOUT)
            errors.append(info.value)
        with pytest.raises(xa.ContextPoisoned) as info:
            device.ask(xa.Rebuild("try"), timeout=TIMEOUT)
        errors.append(info.value)
        assert not any(hasattr(e, "_xlog_supervised") or isinstance(e, SupervisedFailure) for e in errors)
        s = device.ask(xa.GetStats(), timeout=TIMEOUT)
        assert (s.status, s.restarts, s.generation) == ("poisoned", 0, 0)
    finally:
        device.stop()


def test_a_stopped_devices_answers_keep_their_cause(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver, supervisor=xa.Supervisor(max_restarts=0))
    try:
        # The first context is built in on_start, on the actor's thread: a fault planted before
        # it would be met by that build, whose rebuild (not counted) clears it.
        assert device.ask(xa.GetStats(), timeout=TIMEOUT).status == "running"
        host_driver.inject_fault(0, "context_lost")
        with pytest.raises((xa.ContextLost, xa.DeviceUnavailable)):
            device.ask(xa.Allocate(64), timeout=TIMEOUT)
        with pytest.raises(xa.DeviceUnavailable, match="stopped for good") as info:
            device.ask(xa.Allocate(64), timeout=TIMEOUT)
        assert not isinstance(info.value, SupervisedFailure)
        assert device.ask(xa.GetStats(), timeout=TIMEOUT).status == "stopped"
    finally:
        device.stop()


def test_a_library_actor_whose_device_stopped_before_it_started_answers_device_unavailable(
    host_driver: xa.HostDriver, stop_actors: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xlog_actors.actors.library_actor as library_actor

    device = xa.DeviceActor.start(0, driver=host_driver)
    ref = device.ask(xa.Allocate(16), timeout=TIMEOUT)
    device.stop()
    # the device stops between the check in __init__ and on_start: let the check pass
    monkeypatch.setattr(library_actor, "is_actor_ref_of", lambda ref, cls: True)
    copy = xa.CopyActor.start(device)
    with pytest.raises(xa.DeviceUnavailable, match="its DeviceActor was stopped"):
        copy.ask(xa.Fill(ref, 1), timeout=TIMEOUT)
    assert copy.is_alive()


def test_a_crash_on_a_poisoned_device_does_not_rebuild_it(
    host_driver: xa.HostDriver, stop_actors: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(self: xa.DeviceActor, msg: Any) -> None:
        raise RuntimeError("a bug in a handler")

    monkeypatch.setattr(xa.DeviceActor, "_on_report", crash)  # handlers are looked up per message
    device = xa.DeviceActor.start(0, driver=host_driver)
    host_driver.inject_fault(0, "sticky")
    with pytest.raises(xa.ContextPoisoned):
        device.ask(xa.Allocate(64), timeout=TIMEOUT)
    # a crash of the actor's own code asks for a rebuild, which a poisoned device cannot have
    with pytest.raises(RuntimeError, match="a bug"):
        device.ask(xa.GetReport(), timeout=TIMEOUT)
    s = device.ask(xa.GetStats(), timeout=TIMEOUT)
    assert (s.status, s.generation, s.restarts) == ("poisoned", 0, 0)
