"""``PostedServe``: the posted asks of a copy in from pinned memory, a copy back into it and a
launch, served in C in the asker's thread, with the Python path's conditions, replies and errors."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import ranges
from xlog_actors.actors.copy_actor import CopyActor
from xlog_actors.actors.kernel_actor import KernelActor
from xlog_actors.actors.library_actor import LibraryActor
from xlog_actors.actors.library_messages import CopyDone
from xlog_actors.actors.pykka_internals import Answer, ask_served
from xlog_actors.driver.kernel_library import FILL_F32, launch_shape


def _started(ref: pykka.ActorRef[Any]) -> Any:
    """The actor behind ``ref``, once it has started and attached (a proxy call runs on it)."""
    ref.proxy().stream_id.get()
    return ref._actor_weakref()


def _python_path(monkeypatch: pytest.MonkeyPatch, *names: tuple[type, str]) -> list[str]:
    """Record every call of the named handlers (the Python path) and let it run."""
    calls: list[str] = []
    for cls, name in names:
        original = getattr(cls, name)

        def handler(self: Any, msg: Any, _original: Any = original, _name: str = name) -> Any:
            calls.append(_name)
            return _original(self, msg)

        monkeypatch.setattr(cls, name, handler)
    return calls


@pytest.fixture
def rig(device: pykka.ActorRef[Any]) -> Any:
    copy, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    n = 256
    ref = device.ask(xa.Allocate(4 * n))
    pinned = device.ask(xa.AllocatePinned(4 * n))
    grid, block = launch_shape(n)
    launch = xa.Launch(FILL_F32, grid, block, [xa.Out(ref), 5.0, n])
    kernels.ask(launch)  # the Python path learns the launch: the next ones are compiled
    return type("Rig", (), {"device": device, "copy": copy, "kernels": kernels, "ref": ref, "pinned": pinned,
                            "launch": launch, "n": n, "copier": _started(copy), "launcher": _started(kernels)})


def test_posted_copies_and_launches_are_served_here_without_the_handlers(rig: Any, monkeypatch: Any) -> None:
    """Served in C: the replies and the device's bytes are the Python path's, and none of its
    handlers runs (recorded: they would run if the compiled server were not in place)."""
    calls = _python_path(monkeypatch, (CopyActor, "_to_device"), (CopyActor, "_to_host"), (KernelActor, "_launch"))
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    rig.pinned.array(np.float32)[:] = 2.0
    assert ask_served(rig.copy, xa.CopyToDevice(rig.ref, rig.pinned), replies, "in") == Answer("in", None, None)
    back = xa.CopyToHost(rig.ref, 4 * rig.n, out=rig.pinned)
    answer = ask_served(rig.copy, back, replies, "back")
    assert answer is not None and answer.error is None
    done = answer.value
    assert type(done) is CopyDone and done.out is rig.pinned and done.nbytes == 4 * rig.n
    done.wait()
    assert set(rig.pinned.array(np.float32).tolist()) == {2.0}
    assert ask_served(rig.kernels, rig.launch, replies, "k") == Answer("k", None, None)
    ask_served(rig.copy, back, replies, "again")[1].wait()  # type: ignore[index]
    assert set(rig.pinned.array(np.float32).tolist()) == {5.0}, "the copy back waited for the launch"
    assert calls == [] and replies.empty()
    assert rig.ref.last_write_stream == rig.launcher.stream_id


def test_what_it_does_not_take_is_the_python_paths(rig: Any, monkeypatch: Any) -> None:
    """A pageable copy in goes through the actor; a copy back of the whole handle (nbytes None),
    one larger than the handle and a stale handle are the Python path's, with its errors."""
    calls = _python_path(monkeypatch, (CopyActor, "_to_device"), (CopyActor, "_to_host"))
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    assert ask_served(rig.copy, xa.CopyToDevice(rig.ref, np.ones(4, np.uint8)), replies, "pageable") is None
    assert replies.get(timeout=10) == Answer("pageable", None, None)
    whole = ask_served(rig.copy, xa.CopyToHost(rig.ref, out=rig.pinned), replies, "whole")
    assert whole is not None and type(whole.value) is CopyDone and whole.value.nbytes == 4 * rig.n
    too_big = ask_served(rig.copy, xa.CopyToHost(rig.ref, 4 * rig.n + 4, out=rig.pinned), replies, "big")
    assert too_big is not None and isinstance(too_big.error, xa.InvalidRequest)
    assert calls == ["_to_device", "_to_host", "_to_host"]
    old = rig.ref
    rig.device.ask(xa.Rebuild())
    stale = ask_served(rig.copy, xa.CopyToDevice(old, rig.pinned), replies, "stale")
    assert stale is None or isinstance(stale.error, xa.GpuRefStale)
    if stale is None:  # the rebuild's GenerationChanged detached the actor: through its inbox
        assert isinstance(replies.get(timeout=10).error, xa.GpuRefStale)
    assert rig.copy.is_alive()


def test_nothing_is_served_here_while_the_actor_is_busy_queued_or_stopped(rig: Any) -> None:
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    message = xa.CopyToDevice(rig.ref, rig.pinned)
    with rig.copier._exclusive:  # as the actor holds it while it serves
        assert ask_served(rig.copy, message, replies, "busy") is None
    assert replies.get(timeout=10) == Answer("busy", None, None)  # served by the actor after
    inbox = rig.copy.actor_inbox
    with inbox._count_lock:
        inbox._unserved += 1  # as a put counts a message before it is queued
    try:
        assert ask_served(rig.copy, message, replies, "queued") is None
        assert replies.get(timeout=10) == Answer("queued", None, None)  # served by the actor
    finally:
        with inbox._count_lock:
            inbox._unserved -= 1
    rig.copy.stop()
    dead = ask_served(rig.copy, message, replies, "dead")
    assert dead is None and isinstance(replies.get(timeout=0).error, pykka.ActorDeadError)


def test_a_tracer_on_sends_every_ask_through_the_python_path(rig: Any, monkeypatch: Any) -> None:
    """NVTX ranges are pushed by ``serve_in_caller``: with a tracer on, the Python path serves."""
    calls = _python_path(monkeypatch, (CopyActor, "_to_device"))
    pushed: list[tuple[type, type]] = []
    tracer = type("Tracer", (), {"push": lambda self, a, m: pushed.append((a, m)), "pop": lambda self: None})()
    monkeypatch.setattr(ranges, "RANGES", tracer)
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    assert ask_served(rig.copy, xa.CopyToDevice(rig.ref, rig.pinned), replies, "in") == Answer("in", None, None)
    assert calls == ["_to_device"] and pushed == [(CopyActor, xa.CopyToDevice)]


class _FailingCore:
    """Stands in for the actor's ``EnqueueCore``: its copy in raises ``error``."""

    def __init__(self, context: Any, error: BaseException) -> None:
        self.context, self.error = context, error

    def to_device(self, ref: Any, data: Any) -> bool:
        raise self.error

    def close(self) -> None:
        pass


def test_a_lost_context_met_here_is_reported_and_a_rebuild_meanwhile_is_a_stale_handle(
    rig: Any, monkeypatch: Any
) -> None:
    reported: list[tuple[Any, BaseException]] = []
    monkeypatch.setattr(LibraryActor, "_report", lambda self, exc, generation: reported.append((self, exc)))
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    message = xa.CopyToDevice(rig.ref, rig.pinned)
    ctx = rig.copier._ctx
    lost = xa.ContextLost("the primary context was reset")
    monkeypatch.setattr(rig.copier, "_core", _FailingCore(ctx, lost))
    answer = ask_served(rig.copy, message, replies, "lost")
    assert answer is not None and answer.error is lost
    assert reported == [(rig.copier, lost)], "reported to the device's supervisor, as the handler does"
    failed = xa.DriverError("cuMemcpyHtoDAsync failed", code="CUDA_ERROR_INVALID_VALUE")
    monkeypatch.setattr(rig.copier, "_core", _FailingCore(ctx, failed))
    monkeypatch.setattr(type(ctx), "is_current", lambda self: False)  # rebuilt during the call
    answer = ask_served(rig.copy, message, replies, "rebuilt")
    assert answer is not None and isinstance(answer.error, xa.GpuRefStale) and answer.error.__cause__ is failed
    assert len(reported) == 1
