"""What ``xlog_actors.actors.pykka_internals`` borrows from pykka, checked on the installed pykka.

Each test fails when a pykka upgrade changes a private name, signature or behaviour the runtime
relies on; the fix is then to review ``ResilientActor`` against the new pykka.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import inspect
import logging
import queue
import textwrap
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from pykka._envelope import Envelope

from xlog_actors.actors import pykka_internals
from xlog_actors.actors.latch_future import LatchFuture
from xlog_actors.actors.pykka_internals import (
    BATCH_LIMIT,
    PYKKA_MAJOR,
    Answer,
    ResilientActor,
    ask_posting,
    is_actor_ref_of,
)

#: sha256 of pykka 4.x's ``Actor._actor_loop_running`` source, which ``ResilientActor`` copies.
LOOP_FINGERPRINT = "226670085f0c989497b438b01649c9646e99685e524121f5bef4d1af6358a8ae"
TIMEOUT = 5


class Payload:
    """A reply the test can watch with a weak reference."""


class Probe:
    """What the test actors do with their messages."""

    def on_receive(self, message: Any) -> Any:
        if message == "boom":
            raise ValueError("boom")
        if message == "payload":
            return Payload()
        if message == "exit":
            raise SystemExit(3)
        return ("echo", message)


class Resilient(Probe, ResilientActor):
    def __init__(self) -> None:
        super().__init__()
        self.failures: queue.Queue[tuple[Any, Exception]] = queue.Queue()

    def on_told_failure(self, message: Any, error: Exception) -> None:
        self.failures.put((message, error))
        super().on_told_failure(message, error)


class Plain(Probe, pykka.ThreadingActor):
    pass


@pytest.fixture(autouse=True)
def stop_all() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all()


def test_the_installed_pykka_is_the_major_version_the_loop_was_copied_from() -> None:
    assert int(importlib.metadata.version("pykka").split(".")[0]) == PYKKA_MAJOR


def test_pykkas_message_loop_is_the_one_resilient_actor_copies() -> None:
    source = textwrap.dedent(inspect.getsource(pykka.Actor._actor_loop_running))
    assert hashlib.sha256(source.encode()).hexdigest() == LOOP_FINGERPRINT, source


def test_the_private_names_exist_with_the_expected_signatures() -> None:
    assert list(inspect.signature(pykka.Actor._handle_receive).parameters) == ["self", "message"]
    assert list(inspect.signature(pykka.Actor._stop).parameters) == ["self"]
    assert list(inspect.signature(pykka.Actor._actor_loop_running).parameters) == ["self"]
    assert callable(pykka.ActorRegistry.stop_all)
    assert Envelope.__slots__ == ["message", "reply_to"]
    future = pykka.ThreadingFuture[Any]()
    assert callable(future.set) and callable(future.set_exception)


def test_tell_and_ask_put_envelopes_with_and_without_a_reply_future() -> None:
    class Inert(pykka.ThreadingActor):
        pass

    actor = Inert()  # never started: the inbox keeps what is put in it
    ref = actor.actor_ref
    ref.tell("told")
    ref.ask("asked", block=False)
    told, asked = actor.actor_inbox.get(), actor.actor_inbox.get()
    assert isinstance(told, Envelope) and (told.message, told.reply_to) == ("told", None)
    assert isinstance(asked, Envelope) and asked.message == "asked" and isinstance(asked.reply_to, pykka.Future)


def test_start_runs_init_in_the_caller_and_registers_nothing_when_it_raises() -> None:
    seen: list[threading.Thread] = []

    class Refusing(pykka.ThreadingActor):
        def __init__(self) -> None:
            super().__init__()
            seen.append(threading.current_thread())
            raise ValueError("refused")

    before = len(pykka.ActorRegistry.get_all())
    with pytest.raises(ValueError, match="refused"):
        Refusing.start()
    assert seen == [threading.current_thread()]
    assert len(pykka.ActorRegistry.get_all()) == before


def test_actor_ref_names_its_actor_class() -> None:
    ref = Resilient.start()
    assert ref.actor_class is Resilient
    assert is_actor_ref_of(ref, ResilientActor) and is_actor_ref_of(ref, Resilient)
    assert not is_actor_ref_of(ref, Plain) and not is_actor_ref_of("a string", Resilient)
    ref.stop()
    assert not is_actor_ref_of(ref, Resilient)  # stopped


def test_pykka_stops_an_actor_whose_told_message_raised() -> None:
    # The behaviour ResilientActor exists to change: if pykka stops doing this, the override
    # may no longer be needed.
    ref = Plain.start()
    ref.tell("boom")
    deadline = threading.Event()
    for _ in range(100):
        if not ref.is_alive():
            break
        deadline.wait(0.05)
    assert not ref.is_alive()


def test_a_told_message_that_raises_reaches_on_told_failure_and_the_actor_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref = Resilient.start()
    with caplog.at_level(logging.WARNING, logger=__name__):
        ref.tell("boom")
        assert ref.ask("next", timeout=TIMEOUT) == ("echo", "next")
    message, error = ref.proxy().failures.get().get(timeout=TIMEOUT)
    assert message == "boom" and isinstance(error, ValueError)
    assert ref.is_alive()
    # logged at warning level on the logger named after the actor class's module
    assert any(r.name == __name__ and r.levelno == logging.WARNING and "boom" in r.getMessage() for r in caplog.records)


def test_an_asked_message_that_raises_is_answered_with_its_error() -> None:
    ref = Resilient.start()
    with pytest.raises(ValueError, match="boom"):
        ref.ask("boom", timeout=TIMEOUT)
    assert ref.proxy().failures.get(timeout=TIMEOUT).empty()
    assert ref.ask("still", timeout=TIMEOUT) == ("echo", "still")


@pytest.mark.parametrize(("actor_class", "kept"), [(Plain, True), (Resilient, False)])
def test_a_reply_is_dropped_as_soon_as_it_is_answered(actor_class: type[pykka.Actor], kept: bool) -> None:
    ref = actor_class.start()
    reply = ref.ask("payload", timeout=TIMEOUT)
    watch = weakref.ref(reply)
    del reply
    gc.collect()
    # pykka's own loop keeps the envelope and reply in its locals until the next message;
    # ResilientActor's drops them when the reply is set.
    assert (watch() is not None) == kept


def test_a_base_exception_still_stops_every_actor() -> None:
    bystander = Resilient.start()
    ref = Resilient.start()
    ref.tell("exit")
    for _ in range(100):
        if not ref.is_alive() and not bystander.is_alive():
            break
        threading.Event().wait(0.05)
    assert not ref.is_alive() and not bystander.is_alive()


def test_the_inbox_is_a_queue_whose_head_the_batching_loop_can_read() -> None:
    # What ResilientActor._take_queued_batch and _requeue use: the inbox is a queue.Queue whose
    # waiting items are the deque ``.queue`` (oldest first), mutated under ``.mutex``, with the
    # ``.not_full``/``.not_empty`` conditions on that same lock.
    class Inert(pykka.ThreadingActor):
        pass

    actor = Inert()  # never started: the inbox keeps what is put in it
    inbox = actor.actor_inbox
    assert isinstance(inbox, queue.Queue)
    actor.actor_ref.tell("a")
    actor.actor_ref.tell("b")
    actor.actor_ref.tell("c")
    assert isinstance(inbox.queue, deque)
    assert [e.message for e in inbox.queue] == ["a", "b", "c"]
    with inbox.mutex:
        first = inbox.queue.popleft()
        inbox.not_full.notify(1)
    assert first.message == "a" and inbox.qsize() == 2
    with inbox.mutex:
        inbox.queue.extendleft([first])
        inbox.not_empty.notify(1)
    assert [inbox.get_nowait().message for _ in range(3)] == ["a", "b", "c"]
    for condition in (inbox.not_full, inbox.not_empty):
        with condition:
            assert inbox.mutex.locked()  # the same lock: holding it is holding the queue


class Batching(ResilientActor):
    """Serves ("item", n) messages in batches; "gate" blocks it until the test opens it."""

    batch_types = (tuple,)

    def __init__(self, gate: threading.Event, inside: threading.Event) -> None:
        super().__init__()
        self.gate, self.inside = gate, inside
        self.batches: list[int] = []
        self.seen: list[Any] = []
        self.fail_batch = False

    def on_batch(self, size: int) -> None:
        self.batches.append(size)
        if self.fail_batch:
            self.fail_batch = False
            raise ValueError("batch refused")

    def on_receive(self, message: Any) -> Any:
        if message == "gate":
            self.inside.set()
            assert self.gate.wait(TIMEOUT)
            return None
        if message == "report":
            return list(self.batches), list(self.seen)
        if message == "refuse next batch":
            self.fail_batch = True
            return None
        self.seen.append(message)
        if message == ("item", "boom"):
            raise ValueError("boom")
        if message == ("item", "exit"):
            raise SystemExit(3)
        return message[1]


class LatchBatching(Batching):
    """``Batching`` whose asks are answered through ``LatchFuture``s (as a ``DeviceActor``'s)."""

    @staticmethod
    def _create_future() -> LatchFuture:
        return LatchFuture()

    def on_receive(self, message: Any) -> Any:
        if message[0] == "hold":  # ("hold", reached, release): the test holds the batch here
            message[1].set()
            assert message[2].wait(TIMEOUT)
            return "held"
        return super().on_receive(message)


def _blocked(
    fail_batch: bool = False, actor_class: type[Batching] = Batching
) -> tuple[pykka.ActorRef[Any], threading.Event]:
    gate, inside = threading.Event(), threading.Event()
    ref = actor_class.start(gate, inside)
    if fail_batch:
        ref.ask("refuse next batch", timeout=TIMEOUT)
    ref.tell("gate")
    assert inside.wait(TIMEOUT)
    return ref, gate


@pytest.mark.parametrize("actor_class", [Batching, LatchBatching])
def test_queued_messages_of_the_batch_types_are_served_in_one_wake_up_in_order(actor_class: type[Batching]) -> None:
    ref, gate = _blocked(actor_class=actor_class)
    items = [ref.ask(("item", i), block=False) for i in range(3)]
    report_between = ref.ask("report", block=False)
    bad = ref.ask(("item", "boom"), block=False)
    ref.tell(("item", "boom"))  # told and failing: the batch goes on
    tail = [ref.ask(("item", i), block=False) for i in range(3, 5)]
    gate.set()
    assert [f.get(timeout=TIMEOUT) for f in items + tail] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="boom"):
        bad.get(timeout=TIMEOUT)
    batches, seen = report_between.get(timeout=TIMEOUT)
    assert (batches, seen) == ([3], [("item", 0), ("item", 1), ("item", 2)])  # the stop at "report"
    batches, _ = ref.ask("report", timeout=TIMEOUT)
    assert batches == [3, 4]
    assert ref.proxy().seen.get(timeout=TIMEOUT)[-4:] == [("item", "boom"), ("item", "boom"), ("item", 3), ("item", 4)]
    assert ref.is_alive()


def test_a_batch_is_no_longer_than_the_limit_and_a_lone_message_is_no_batch() -> None:
    ref, gate = _blocked()
    futures = [ref.ask(("item", i), block=False) for i in range(BATCH_LIMIT + 1)]
    gate.set()
    assert [f.get(timeout=TIMEOUT) for f in futures] == list(range(BATCH_LIMIT + 1))
    assert ref.ask(("item", "alone"), timeout=TIMEOUT) == "alone"
    batches, _ = ref.ask("report", timeout=TIMEOUT)
    assert batches == [BATCH_LIMIT]  # the last of the first lot, and the lone one, were no batch


def test_a_failing_on_batch_is_the_answer_of_every_message_of_the_batch() -> None:
    ref, gate = _blocked(fail_batch=True)
    futures = [ref.ask(("item", i), block=False) for i in range(3)]
    gate.set()
    for future in futures:
        with pytest.raises(ValueError, match="batch refused"):
            future.get(timeout=TIMEOUT)
    batches, seen = ref.ask("report", timeout=TIMEOUT)
    assert batches == [3] and seen == []  # none was served
    assert ref.ask(("item", 9), timeout=TIMEOUT) == 9


@pytest.mark.parametrize("actor_class", [Batching, LatchBatching])
def test_a_base_exception_in_a_batch_stops_the_actor_and_the_rest_is_answered_by_pykkas_teardown(
    actor_class: type[Batching],
) -> None:
    ref, gate = _blocked(actor_class=actor_class)
    first = ref.ask(("item", 0), block=False)
    ref.tell(("item", "exit"))  # told: pykka answers no asker of a message that raised a BaseException
    rest = [ref.ask(("item", i), block=False) for i in range(1, 4)]
    gate.set()
    assert first.get(timeout=TIMEOUT) == 0
    for future in rest:  # put back in the inbox, answered as pykka answers a stopped actor's inbox
        with pytest.raises(pykka.ActorDeadError):
            future.get(timeout=TIMEOUT)
    assert not ref.is_alive()


@pytest.mark.parametrize("defer", [True, False])
def test_the_askers_of_a_batch_answered_through_latch_futures_wake_when_the_batch_ends(
    defer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pykka_internals, "DEFER_WAKES", defer)
    ref, gate = _blocked(actor_class=LatchBatching)
    reached, release = threading.Event(), threading.Event()
    first = ref.ask(("item", 0), block=False)
    holder = ref.ask(("hold", reached, release), block=False)
    gate.set()  # the gate message ends: the two queued asks are served as one batch
    try:
        assert reached.wait(TIMEOUT)  # the first is served, the batch is held at the second
        if defer:
            with pytest.raises(pykka.Timeout):
                first.get(timeout=0.05)  # its asker is not woken before the batch ends
        else:
            assert first.get(timeout=TIMEOUT) == 0
    finally:
        release.set()
    assert first.get(timeout=TIMEOUT) == 0
    assert holder.get(timeout=TIMEOUT) == "held"
    batches, _ = ref.ask("report", timeout=TIMEOUT)
    assert batches == [2]
    ref.stop()


class _Answers(ResilientActor):
    def on_receive(self, message: Any) -> Any:
        if message == "boom":
            raise ValueError("boom")
        if isinstance(message, threading.Event):
            message.wait(5)
            return "waited"
        return message * 2


def test_ask_posting_posts_each_answer_once_the_reply_is_in() -> None:
    ref = _Answers.start()
    try:
        replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        gate = threading.Event()
        ask_posting(ref, gate, replies, "slow")
        ask_posting(ref, 21, replies, "fast")
        ask_posting(ref, "boom", replies, "bad")
        with pytest.raises(queue.Empty):
            replies.get(timeout=0.05)  # nothing answered while the actor waits on the gate
        gate.set()
        slow, fast, bad = (replies.get(timeout=5) for _ in range(3))
        assert (slow.key, slow.value, slow.error) == ("slow", "waited", None)
        assert (fast.key, fast.value, fast.error) == ("fast", 42, None)
        assert bad.key == "bad" and bad.value is None
        assert isinstance(bad.error, ValueError) and str(bad.error) == "boom"
        with pytest.raises(queue.Empty):
            replies.get(timeout=0.05)  # each ask is answered exactly once
    finally:
        ref.stop()


def test_ask_posting_to_a_dead_or_stopping_actor_posts_the_error() -> None:
    ref = _Answers.start()
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    gate = threading.Event()
    ask_posting(ref, gate, replies, "busy")
    ask_posting(ref, 1, replies, "queued")  # ahead of the stop message: still served
    ref.stop(block=False)
    gate.set()
    busy, queued = replies.get(timeout=5), replies.get(timeout=5)
    assert (busy.key, queued.key, queued.value, queued.error) == ("busy", "queued", 2, None)
    ref.actor_stopped.wait(5)
    ask_posting(ref, 1, replies, "dead")
    dead = replies.get(timeout=0)  # posted before ask_posting returned
    assert dead.key == "dead" and isinstance(dead.error, pykka.ActorDeadError)


def test_ask_posting_a_message_queued_behind_a_stop_is_answered_actor_dead() -> None:
    ref = _Answers.start()
    replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
    gate = threading.Event()
    ask_posting(ref, gate, replies, "busy")
    ref.stop(block=False)
    ask_posting(ref, 1, replies, "late")  # behind the stop: the teardown answers it
    gate.set()
    answers = {a.key: a for a in (replies.get(timeout=5), replies.get(timeout=5))}
    assert answers["busy"].value == "waited"
    assert isinstance(answers["late"].error, pykka.ActorDeadError)


def test_an_actor_may_build_its_own_inbox_and_every_message_comes_through_its_put_and_get() -> None:
    """What the isolated device's proxy relies on (see the module docstring): the static
    ``_create_actor_inbox`` hook, and every ask, tell and stop going through ``put``, every
    message taken through ``_get`` under the queue's lock."""
    seen: list[str] = []

    class Inbox(queue.Queue):  # type: ignore[type-arg]
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            seen.append(f"put {type(item.message).__name__}")
            super().put(item, block, timeout)

        def _get(self) -> Any:
            assert self.mutex.locked(), "_get runs under the queue's lock"
            item = super()._get()
            seen.append(f"get {type(item.message).__name__}")
            return item

    class Own(pykka.ThreadingActor):
        @staticmethod
        def _create_actor_inbox() -> Inbox:
            return Inbox()

        def on_receive(self, message: Any) -> Any:
            return message

    ref = Own.start()
    assert isinstance(ref.actor_inbox, Inbox)
    assert ref.ask(7) == 7
    ref.tell("x")
    ref.stop()
    puts = [s for s in seen if s.startswith("put")]
    gets = [s for s in seen if s.startswith("get")]
    assert seen[:2] == ["put int", "get int"], seen
    assert puts[1:] == ["put str", puts[2]] and puts[2] != "put str", "the stop comes through put as well"
    assert [g[4:] for g in gets] == [p[4:] for p in puts], "every message is taken through _get, in order"


def test_an_actor_may_replace_its_ref_with_a_subclass_which_start_returns_and_registers() -> None:
    class Ref(pykka.ActorRef[Any]):
        pass

    class WithRef(pykka.ThreadingActor):
        def __init__(self) -> None:
            super().__init__()
            self._actor_ref = Ref(self)

        def on_receive(self, message: Any) -> Any:
            return message

    ref = WithRef.start()
    try:
        assert type(ref) is Ref and ref.ask("x", timeout=5) == "x"
        assert pykka.ActorRegistry.get_by_urn(ref.actor_urn) is ref
        actor = ref._actor_weakref()
        assert isinstance(actor, WithRef) and actor.actor_ref is ref
    finally:
        ref.stop()
