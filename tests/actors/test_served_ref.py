"""``served_ref``: a library actor's blocking ask is served in the asker's thread while the actor
is idle, and only then; one handler at a time; a sender's order kept; the same replies and errors
as through the actor."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.copy_actor import CopyActor
from xlog_actors.actors.library_actor import LibraryActor
from xlog_actors.actors.served_ref import NOT_SERVED, ServedRef


class Recorded:
    """Wraps ``CopyActor._fill``: records (thread ident, fill value) per call, can hold a call
    on an event, and counts handlers running at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        self.hold: dict[int, threading.Event] = {}  # fill byte -> released by the test
        self.entered: dict[int, threading.Event] = {}
        self.inside = 0
        self.most_inside = 0
        original: Callable[[Any, Any], Any] = CopyActor._fill

        def fill(actor: Any, msg: Any) -> Any:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            try:
                self.calls.append((threading.get_ident(), msg.byte))
                if msg.byte in self.entered:
                    self.entered[msg.byte].set()
                if msg.byte in self.hold:
                    assert self.hold[msg.byte].wait(10)
                time.sleep(0.0005)  # widen any overlap a broken exclusion would let through
                return original(actor, msg)
            finally:
                self.inside -= 1

        monkeypatch.setattr(CopyActor, "_fill", fill)

    def threads(self) -> list[int]:
        return [t for t, _ in self.calls]


def actor_thread(ref: pykka.ActorRef[Any]) -> int:
    """The ident of the actor's own thread (a proxy call is always served there)."""
    return ref.proxy().served_here().get()


@pytest.fixture
def thread_ident(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LibraryActor, "served_here", lambda self: threading.get_ident(), raising=False)


def test_a_blocking_ask_is_served_in_the_askers_thread(device: Any, monkeypatch: Any, thread_ident: None) -> None:
    rec = Recorded(monkeypatch)
    copy = xa.CopyActor.start(device)
    assert isinstance(copy, ServedRef)
    assert actor_thread(copy) != threading.get_ident()  # and the actor has started
    ref = device.ask(xa.Allocate(4096))
    assert copy.ask(xa.Fill(ref, 7)) is None
    assert copy.ask(xa.CopyToHost(ref, nbytes=8)) == b"\x07" * 8  # the fill is there
    assert rec.threads() == [threading.get_ident()]


def test_a_non_blocking_ask_and_an_ask_with_a_timeout_go_through_the_actor(
    device: Any, monkeypatch: Any, thread_ident: None
) -> None:
    rec = Recorded(monkeypatch)
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    future = copy.ask(xa.Fill(ref, 1), block=False)
    assert future.get(timeout=10) is None
    assert copy.ask(xa.Fill(ref, 2), timeout=10) is None
    copy.tell(xa.Fill(ref, 3))
    assert copy.ask(xa.CopyToHost(ref, nbytes=4), timeout=10) == b"\x03" * 4
    mine = actor_thread(copy)
    assert rec.calls == [(mine, 1), (mine, 2), (mine, 3)]


def test_an_ask_behind_a_queued_message_waits_its_turn_on_the_actor(
    device: Any, monkeypatch: Any, thread_ident: None
) -> None:
    rec = Recorded(monkeypatch)
    rec.hold[1] = threading.Event()
    rec.entered[1] = threading.Event()
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    mine = actor_thread(copy)
    copy.tell(xa.Fill(ref, 1))  # held in its handler: the actor is busy
    assert rec.entered[1].wait(10)
    replies: list[Any] = []
    asker = threading.Thread(target=lambda: replies.append(copy.ask(xa.Fill(ref, 2))), daemon=True)
    asker.start()
    time.sleep(0.05)
    assert replies == [] and [v for _, v in rec.calls] == [1]  # not served beside the busy actor
    rec.hold[1].set()
    asker.join(10)
    assert replies == [None]
    assert rec.calls == [(mine, 1), (mine, 2)]  # in order, both on the actor's thread
    assert copy.ask(xa.CopyToHost(ref, nbytes=4)) == b"\x02" * 4


def test_one_handler_at_a_time_whoever_serves(device: Any, monkeypatch: Any, thread_ident: None) -> None:
    rec = Recorded(monkeypatch)
    copy = xa.CopyActor.start(device)
    mine = actor_thread(copy)
    refs = [device.ask(xa.Allocate(4096)) for _ in range(4)]
    errors: list[BaseException] = []
    workers: set[int] = set()

    def both_served() -> bool:
        served_by = set(rec.threads())
        return mine in served_by and bool(served_by & workers)

    def work(i: int) -> None:
        workers.add(threading.get_ident())
        try:
            for k in range(100):
                if k % 3 == 0:
                    copy.ask(xa.Fill(refs[i], i + 1), block=False).get(timeout=10)
                else:
                    copy.ask(xa.Fill(refs[i], i + 1))
                if k >= 20 and both_served():
                    return
                time.sleep(0.001 * (i + 1))  # lets the actor fall idle now and then
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert both_served()  # askers served some, the actor the others
    assert rec.most_inside == 1  # and never two at once
    for i, ref in enumerate(refs):
        assert copy.ask(xa.CopyToHost(ref, nbytes=16)) == bytes([i + 1]) * 16


def test_no_ask_is_served_before_the_actor_started(device: Any, monkeypatch: Any, thread_ident: None) -> None:
    rec = Recorded(monkeypatch)
    release = threading.Event()
    original = LibraryActor._start

    def slow_start(self: Any) -> None:
        assert release.wait(10)
        original(self)

    monkeypatch.setattr(LibraryActor, "_start", slow_start)
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    replies: list[Any] = []
    asker = threading.Thread(target=lambda: replies.append(copy.ask(xa.Fill(ref, 9))), daemon=True)
    asker.start()
    time.sleep(0.05)
    assert replies == [] and rec.calls == []
    release.set()
    asker.join(10)
    assert replies == [None]
    assert rec.threads() == [actor_thread(copy)]


def test_errors_served_in_the_caller_are_the_actors_and_leave_it_working(device: Any) -> None:
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(ref, 0))
    with pytest.raises(xa.InvalidRequest, match="Fill.ref must be a GpuRef"):
        copy.ask(xa.Fill("not a ref", 1))
    with pytest.raises(xa.InvalidRequest, match="do not fit"):
        copy.ask(xa.CopyToDevice(ref, np.zeros(65, np.uint8)))
    assert copy.ask(xa.CopyToHost(ref, nbytes=8)) == b"\x00" * 8  # nothing was copied
    assert copy.actor_inbox.unserved() == 0
    del ref
    device.ask(xa.Rebuild())
    fresh = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(fresh, 4))
    assert copy.ask(xa.CopyToHost(fresh, nbytes=4)) == b"\x04" * 4


def test_a_stale_handle_served_in_the_caller_raises_gpu_ref_stale(device: Any) -> None:
    copy = xa.CopyActor.start(device)
    old = device.ask(xa.Allocate(64))
    device.ask(xa.Rebuild())
    with pytest.raises(xa.GpuRefStale):
        copy.ask(xa.Fill(old, 1))
    assert copy.is_alive()


def test_a_stopped_actor_is_not_served(device: Any) -> None:
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copy.stop()
    with pytest.raises(pykka.ActorDeadError):
        copy.ask(xa.Fill(ref, 1))


def test_serve_in_caller_says_not_served_while_the_actor_is_busy(device: Any) -> None:
    copy = xa.CopyActor.start(device)
    actor = copy._actor_weakref()
    ref = device.ask(xa.Allocate(64))
    copy.ask(xa.Fill(ref, 0), timeout=10)  # through the actor: it has started
    with actor._exclusive:  # as the actor holds it while it serves
        assert actor.serve_in_caller(xa.Fill(ref, 1)) is NOT_SERVED
    assert actor.serve_in_caller(xa.Fill(ref, 1)) is None


def test_kernel_launches_are_served_in_the_caller_too(device: Any) -> None:
    from xlog_actors.driver.kernel_library import FILL_F32, launch_shape

    kernels, copy = xa.KernelActor.start(device), xa.CopyActor.start(device)
    kernels.proxy().stream_id.get()  # through the actor: it has started
    n = 1000
    out = device.ask(xa.Allocate(4 * n))
    grid, block = launch_shape(n)
    seen: list[int] = []
    actor = kernels._actor_weakref()
    original = type(actor)._launch

    def launch(self: Any, msg: Any) -> Any:
        seen.append(threading.get_ident())
        return original(self, msg)

    type(actor)._launch = launch  # type: ignore[method-assign]
    try:
        kernels.ask(xa.Launch(FILL_F32, grid, block, [xa.Out(out), 3.0, n]))
    finally:
        type(actor)._launch = original  # type: ignore[method-assign]
    assert seen == [threading.get_ident()]
    assert set(np.frombuffer(copy.ask(xa.CopyToHost(out)), np.float32).tolist()) == {3.0}


def test_a_posted_ask_that_only_enqueues_is_served_in_the_askers_thread(
    device: Any, monkeypatch: Any, thread_ident: None
) -> None:
    """``ask_posting`` of a Fill (enqueue only) runs in the asker's thread and its answer is on
    the queue when the call returns; a CopyToHost into pageable memory (it waits) goes through
    the actor; an error of the served handler is the posted answer and the actor lives on."""
    import queue

    from xlog_actors.actors.pykka_internals import Answer, ask_posting

    rec = Recorded(monkeypatch)
    copy = xa.CopyActor.start(device)
    mine = actor_thread(copy)
    ref = device.ask(xa.Allocate(4096))
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    ask_posting(copy, xa.Fill(ref, 5), replies, "fill")
    assert replies.get_nowait() == Answer("fill", None, None)  # posted before ask_posting returned
    assert rec.calls == [(threading.get_ident(), 5)]
    ask_posting(copy, xa.Fill(ref, 300), replies, "bad")
    bad = replies.get_nowait()
    assert bad.key == "bad" and isinstance(bad.error, xa.InvalidRequest)
    ask_posting(copy, xa.CopyToHost(ref, nbytes=4), replies, "back")
    answer = replies.get(timeout=10)
    assert answer == Answer("back", b"\x05" * 4, None)
    assert copy.proxy().served_here().get() == mine  # the actor still runs
    assert not copy._actor_weakref().posts_in_caller(xa.CopyToHost(ref, nbytes=4))
    assert not copy._actor_weakref().posts_in_caller(xa.CopyToDevice(ref, b"pageable"))


def test_ask_served_returns_the_answer_of_an_ask_served_here_and_posts_the_others(
    device: Any, monkeypatch: Any, thread_ident: None
) -> None:
    """``ask_served`` of a Fill (served in this thread) returns its answer and posts nothing; a
    Fill the handler refuses returns the error as the answer; a CopyToHost into pageable memory
    (served by the actor) returns None and its answer is posted."""
    import queue

    from xlog_actors.actors.pykka_internals import Answer, ask_served

    rec = Recorded(monkeypatch)
    copy = xa.CopyActor.start(device)
    actor_thread(copy)  # started and attached: an idle actor
    ref = device.ask(xa.Allocate(4096))
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    assert ask_served(copy, xa.Fill(ref, 7), replies, "fill") == Answer("fill", None, None)
    assert replies.empty() and rec.calls == [(threading.get_ident(), 7)]
    bad = ask_served(copy, xa.Fill(ref, 300), replies, "bad")
    assert bad is not None and bad.key == "bad" and isinstance(bad.error, xa.InvalidRequest)
    assert replies.empty()
    assert ask_served(copy, xa.CopyToHost(ref, nbytes=4), replies, "back") is None
    assert replies.get(timeout=10) == Answer("back", b"\x07" * 4, None)


def test_a_posted_ask_is_not_served_in_the_caller_on_an_untracked_stack(driver: xa.Driver) -> None:
    """On the direct stack a handler synchronizes its stream: never served in a posting caller."""
    device = xa.DeviceActor.start(0, driver, resource="direct")
    try:
        copy = xa.CopyActor.start(device)
        ref = device.ask(xa.Allocate(64))
        copy.ask(xa.Fill(ref, 1))  # attached
        assert not copy._actor_weakref().posts_in_caller(xa.Fill(ref, 2))
    finally:
        pykka.ActorRegistry.stop_all()
