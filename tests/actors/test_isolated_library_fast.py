"""The asker's path of an isolated device's library actors, on the host driver: an ask of the
parent-side ``CopyActor``/``KernelActor`` is forwarded from the asker's own thread while the actor
is idle, and the device's proxy sends its ``LibraryWork`` (and an export's ``ExportHandle``) to the
child from that thread too, so neither parent actor's thread is used; everything else (tells, a
busy actor, refusals, a dead or stopped child) takes the actors' path, with the same answers."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors.caller_inbox import CallerServedInbox
from xlog_actors.actors.isolated import ChildFault, _child, _library, _protocol, _proxy
from xlog_actors.actors.isolated._library import IsolatedLibrary
from xlog_actors.actors.isolated._proxy import IsolatedDevice
from xlog_actors.driver.kernel_library import FILL_F32

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_process")]

@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The messages each parent-side actor's own thread handled (its stop and pykka's own
    messages left out), by actor class."""
    seen: dict[str, list[str]] = {"library": [], "proxy": []}
    for cls, key in ((IsolatedLibrary, "library"), (IsolatedDevice, "proxy")):
        real = cls._handle_envelope

        def counting(self: Any, envelope: Any, receive: Any = None, _real: Any = real, _key: str = key) -> None:
            if not type(envelope.message).__module__.startswith("pykka"):
                seen[_key].append(type(envelope.message).__name__)
            _real(self, envelope, receive)

        monkeypatch.setattr(cls, "_handle_envelope", counting)
    return seen


def _quiet(*refs: pykka.ActorRef[Any]) -> None:
    """Wait until each actor serves in its askers' threads and has served what it took."""
    deadline = time.monotonic() + 10.0
    for ref in refs:
        inbox = ref.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        while inbox.serve is None or not inbox.quiet():
            assert time.monotonic() < deadline, f"{ref} never went idle"
            time.sleep(0.001)


def test_asks_of_an_isolated_library_actor_use_neither_parent_actors_thread(handled: dict[str, list[str]]) -> None:
    """Fails with either fast path off: every ask below is then handled on the library actor's
    or the proxy's thread."""
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier, kernels = xa.CopyActor.start(device), xa.KernelActor.start(device)
    x, y = device.ask(xa.Allocate(64)), device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(x, 0))
    kernels.ask(xa.Launch(FILL_F32, 1, 16, [xa.Out(y), 0.0, 16]))
    _quiet(copier, kernels, device)
    handled["library"].clear()
    handled["proxy"].clear()
    assert copier.ask(xa.Fill(x, 7)) is None
    assert copier.ask(xa.CopyToHost(x, nbytes=4)) == b"\x07" * 4
    copier.ask(xa.CopyToDevice(y, b"\x01" * 8))
    copier.ask(xa.CopyDeviceToDevice(x, y))
    assert copier.ask(xa.CopyToHost(y)) == b"\x07" * 64
    kernels.ask(xa.Launch(FILL_F32, 1, 16, [xa.Out(y), 2.0, 16]))
    futures = [copier.ask(xa.Fill(x, k), block=False) for k in range(5)]  # non-blocking asks too
    assert [f.get(timeout=10) for f in futures] == [None] * 5
    assert copier.ask(xa.CopyToHost(x, nbytes=1)) == b"\x04"
    assert handled == {"library": [], "proxy": []}
    sent, answered = x.context.work.mark()
    assert sent == answered == 14, "each piece of work was counted as sent and answered"


def test_a_copy_from_another_isolated_device_exports_and_forwards_in_the_askers_thread(
    handled: dict[str, list[str]],
) -> None:
    dev0 = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    dev1 = xa.DeviceActor.start(1, "host", isolate=True, hot_spare=False)
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(4096)), dev1.ask(xa.Allocate(4096))
    copy0.ask(xa.Fill(src, 0))
    copy1.ask(xa.Fill(dst, 0))
    _quiet(dev0, dev1, copy0, copy1)
    handled["library"].clear()
    handled["proxy"].clear()
    for value in (3, 5):
        copy0.ask(xa.Fill(src, value))  # library work on the source's device: the next copy exports afresh
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
        assert copy1.ask(xa.CopyToHost(dst)) == bytes([value]) * 4096
    assert handled == {"library": [], "proxy": []}, "the exports (ExportHandle) went straight to the child too"


def test_the_fast_paths_answer_refusals_and_errors_as_the_actors_path(
    handled: dict[str, list[str]], foreign: tuple[xa.GpuRef, xa.PinnedBuffer]
) -> None:
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 7))
    other_ref, pinned = foreign
    for message, error, match in [
        (xa.CopyToDevice(ref, pinned), xa.InvalidRequest, "PinnedBuffer cannot cross"),
        (xa.CopyToHost(ref, out=pinned), xa.InvalidRequest, "pinned memory cannot cross"),
        (xa.CopyDeviceToDevice(other_ref, ref), xa.InvalidRequest, "not a handle of isolated device 0"),
        (xa.Fill(ref, 300), xa.InvalidRequest, "Fill.byte"),  # judged by the actor in the child
        (xa.CopyToDevice(ref, bytes(65)), xa.InvalidRequest, "do not fit"),
    ]:
        _quiet(copier, device)
        with pytest.raises(error, match=match):
            copier.ask(message)
    stale = device.ask(xa.Allocate(64))
    stale.release()
    with pytest.raises(xa.GpuRefStale) as info:
        copier.ask(xa.Fill(stale, 1))
    assert info.value.reason == "released"
    assert copier.ask(xa.CopyToHost(ref)) == b"\x07" * 64  # nothing was written by a refused message
    assert "LibraryWork" in handled["proxy"], "a refusal met on the fast path is answered by the proxy's own path"


def test_a_large_upload_is_written_on_the_actors_thread(
    handled: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_library, "CALLER_DATA_BYTES", 16)
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 0))
    _quiet(copier, device)
    handled["library"].clear()
    copier.ask(xa.CopyToDevice(ref, b"\x02" * 16))  # small: the asker's thread
    copier.ask(xa.CopyToDevice(ref, b"\x03" * 17))  # over the bound: the actor's
    assert copier.ask(xa.CopyToHost(ref, nbytes=18)) == b"\x03" * 17 + b"\x00"
    assert handled["library"].count("CopyToDevice") == 1  # (the read after it may find the actor not yet idle)


def test_a_senders_tells_and_asks_mixed_keep_their_order(handled: dict[str, list[str]]) -> None:
    """A tell goes through the actor's thread, an ask may not: the ask after a tell must still
    see its write, and a tell after an ask must not overtake it."""
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(256))
    copier.ask(xa.Fill(ref, 0))
    for k in range(1, 41):
        copier.tell(xa.Fill(ref, k))
        if k % 3 == 0:
            copier.tell(xa.CopyToDevice(ref, bytes([k + 100]) * 4))
        if k % 2:
            _quiet(copier)  # the tells forwarded by the actor's thread: the ask is the asker's to forward
        if k % 3 == 0:
            assert copier.ask(xa.CopyToHost(ref, nbytes=5)) == bytes([k + 100]) * 4 + bytes([k])
        else:
            assert copier.ask(xa.CopyToHost(ref, nbytes=1)) == bytes([k])
    assert handled["library"].count("Fill") == 40  # every tell took the actor's path
    assert handled["library"].count("CopyToHost") <= 20, "the asks after a quiet actor were the askers' to forward"


def test_two_threads_ask_at_once(run_threads: Callable[..., list[BaseException]]) -> None:
    """Asks served in two askers' threads at once, copies from another device's sources (the
    kept exports, shared under their lock) among them, each see their own writes."""
    dev0 = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    dev1 = xa.DeviceActor.start(1, "host", isolate=True, hot_spare=False)
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    names = iter(range(2))
    lock = threading.Lock()

    def work() -> None:
        with lock:
            me = next(names)
        own, src = dev1.ask(xa.Allocate(1024)), dev0.ask(xa.Allocate(1024))
        copy0.ask(xa.Fill(src, 50 + me))
        for k in range(25):
            value = (me * 100 + k) % 256
            copy1.ask(xa.Fill(own, value))
            assert copy1.ask(xa.CopyToHost(own, nbytes=2)) == bytes([value]) * 2
            copy1.ask(xa.CopyDeviceToDevice(src, own))  # the kept export of this thread's source
            assert copy1.ask(xa.CopyToHost(own, nbytes=2)) == bytes([50 + me]) * 2

    assert run_threads(work, 2, 50) == []


def test_a_child_killed_with_asks_in_flight_from_two_threads_answers_each_with_its_error(
    answers_from_threads: Callable[..., list[object]],
) -> None:
    device = xa.DeviceActor.start(0, "host", supervisor=xa.Supervisor(max_restarts=3), isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 1))
    device.ask(xa.GetStats())
    device.tell(ChildFault("kill", hold=4))
    outcomes = answers_from_threads(lambda: [copier.ask(xa.CopyToHost(ref, nbytes=1), block=False) for _ in range(2)],
                                    2, 40)
    assert len(outcomes) == 4 and all(isinstance(o, xa.DeviceUnavailable) for o in outcomes), outcomes
    with pytest.raises(xa.GpuRefStale):
        copier.ask(xa.Fill(ref, 1))
    new = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(new, 9))
    assert copier.ask(xa.CopyToHost(new, nbytes=2)) == b"\x09\x09"


def test_a_stopped_device_answers_the_asks_in_flight_and_later_ones_device_unavailable(slow_kernels: Any) -> None:
    device = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    kernels, copier = xa.KernelActor.start(device), xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 0))
    slow = kernels.ask(xa.Launch(slow_kernels.SLOW_FILL_U8, 1, 1, [xa.Out(ref), 9, 64]), block=False)
    behind = copier.ask(xa.CopyToHost(ref), block=False)  # waits for the slow kernel in the child
    device.stop()
    for future in (slow, behind):
        try:  # answered, or DeviceUnavailable when the child ended first; never left waiting
            future.get(timeout=30)
        except xa.DeviceUnavailable as exc:
            assert "stopped" in str(exc)
    with pytest.raises(xa.DeviceUnavailable, match="stopped"):
        copier.ask(xa.Fill(ref, 1))


def test_a_stopping_library_actor_waits_for_the_asks_forwarded_in_askers_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its child actor's stop (``LibraryStop``) follows every message forwarded before it, and
    once it stops no asker forwards any more."""
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 0))
    _quiet(copier)
    entered, release = threading.Event(), threading.Event()
    real = _library.ask_into

    def slow_ask_into(actor: Any, message: Any, reply: Any) -> None:
        if isinstance(message, _protocol.LibraryWork) and message.message == xa.Fill(ref, 6):
            entered.set()
            release.wait(10)
        real(actor, message, reply)

    monkeypatch.setattr(_library, "ask_into", slow_ask_into)
    result: list[object] = []
    asker = threading.Thread(target=lambda: result.append(copier.ask(xa.Fill(ref, 6))), daemon=True)
    asker.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=copier.stop, daemon=True)
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive(), "the stop waits for the ask being forwarded"
    release.set()
    stopper.join(10)
    asker.join(10)
    assert result == [None]
    with pytest.raises(pykka.ActorDeadError):
        copier.ask(xa.Fill(ref, 1))
    # The fill reached the child before its actor was stopped: a new copy actor reads it.
    assert xa.CopyActor.start(device).ask(xa.CopyToHost(ref, nbytes=1)) == b"\x06"


def test_the_child_reader_spins_on_while_library_work_it_handed_on_is_in_flight() -> None:
    """``_Server.spin_for_frame``: one spin after each frame; more while a library actor holds
    work or answered some during the last spin; never past ``WORK_SPIN_S``. The bell of the
    library actor last handed work goes to the first spin only (rung there, once the GIL is let
    go). Run on a ``_Server`` in this process with a ``wait`` that counts its spins."""
    from xlog_actors._core.doorbell import Doorbell

    server = object.__new__(_child._Server)
    server.work = _child._WorkCount()
    server.bell = None
    spins: list[float] = []
    bells: list[Doorbell | None] = []

    def waiting(answer_at: int | None = None) -> Callable[[float, Doorbell | None], bool]:
        def wait(seconds: float, bell: Doorbell | None) -> bool:
            spins.append(seconds)
            bells.append(bell)
            if answer_at is not None and len(spins) == answer_at:
                server.work.answer()
            return False

        return wait

    assert server.spin_for_frame(waiting(), 0.001, False) is False
    assert len(spins) == 1  # nothing in flight: one spin
    spins.clear()
    server.work.forwarded += 1
    server.bell = bell = Doorbell()
    bells.clear()
    server.spin_for_frame(waiting(answer_at=3), 0.001, False)
    assert len(spins) == 4  # in flight for three, then one more after the answer came
    assert bells == [bell, None, None, None] and server.bell is None  # handed to the first spin only
    spins.clear()
    server.work.forwarded += 1  # never answered: bounded
    server.spin_for_frame(waiting(), 0.001, False)
    assert len(spins) == round(_child.WORK_SPIN_S / 0.001)
    spins.clear()
    assert server.spin_for_frame(waiting(), 0.0, False) is False and len(spins) == 1  # no spin budget: once

    def frame(seconds: float, bell: Doorbell | None) -> bool:
        spins.append(seconds)
        return True

    spins.clear()
    assert server.spin_for_frame(frame, 0.001, False) is True and len(spins) == 1


def test_the_child_counts_the_library_work_it_hands_on_and_its_answers() -> None:
    """What ``spin_for_frame`` reads: a ``LibraryWork`` served by a ``_Server`` (in this process,
    over a pipe) counts as forwarded, and as answered once its reply was sent; the library
    actor's bell is kept for the reader's next wait."""
    driver = xa.HostDriver()
    device = xa.DeviceActor.start(0, driver)
    parent, child_end = multiprocessing.Pipe()
    server = _child._Server(_protocol.Channel(child_end), driver, 0, device)
    try:
        ref = device.ask(xa.Allocate(64))
        server.handles.hold(ref)
        handle = _protocol.RemoteHandle(ref.block.ptr, ref.generation)
        server.ask(1, _protocol.LibraryWork("urn:test", xa.CopyActor, True, xa.Fill(handle, 3)))
        # The copy actor's bell is left for the reader's next wait to ring, the GIL let go.
        assert server.bell is server.libraries["urn:test"].actor_inbox._bell
        server.take_bell().ring()  # type: ignore[union-attr]
        assert server.bell is None
        assert parent.recv()[:3] == ("reply", 1, True)
        deadline = time.monotonic() + 5.0
        while server.work.answered < 1 and time.monotonic() < deadline:  # counted just after the send
            time.sleep(0.001)
        assert (server.work.forwarded, server.work.answered) == (1, 1)
    finally:
        for library in server.libraries.values():
            library.stop()
        device.stop()
        driver.close()
        parent.close()
        child_end.close()


def test_forced_spinning_waits_serve_library_work_as_the_sleeping_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the parent's waits spinning (forced whatever the cores), the library asks served in
    the askers' threads still reach their askers."""
    from xlog_actors.actors.isolated import _lane, _reader

    for module in (_proxy, _reader, _lane, _library):
        monkeypatch.setattr(module, "spin_budget", lambda seconds: seconds)
    device = xa.DeviceActor.start(0, "host", isolate=True)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    for k in range(30):
        copier.ask(xa.Fill(ref, k))
        assert copier.ask(xa.CopyToHost(ref, nbytes=1)) == bytes([k])


def test_map_refs_maps_every_handle_of_a_message_and_keeps_the_rest() -> None:
    """Every handle of a library message (a field, a buffer argument, one inside a list) is
    mapped, everything else kept; the message types it rebuilds take all their fields in
    ``__init__`` (what rebuilding them by keyword needs)."""
    import dataclasses

    from xlog_actors.actors.library_messages import BufferArg
    from xlog_actors.memory.block import Access

    a, b = _protocol.RemoteHandle(0x1000, 1), _protocol.RemoteHandle(0x2000, 1)
    named = {a: "A", b: "B"}
    launch = xa.Launch(FILL_F32, 4, 64, [BufferArg(a, Access.WRITE), 2.0, 256])
    mapped = _library.map_refs(launch, named.__getitem__)
    assert mapped.args == [BufferArg("A", Access.WRITE), 2.0, 256] and mapped.kernel is FILL_F32
    copy = _library.map_refs(xa.CopyDeviceToDevice(a, b), named.__getitem__)
    assert (copy.src, copy.dst) == ("A", "B")
    back = _library.map_refs(xa.CopyToHost(b, 8), named.__getitem__)
    assert (back.ref, back.nbytes, back.out) == ("B", 8, None)
    for kind in _library._MESSAGES:
        assert all(f.init for f in dataclasses.fields(kind)), kind


def test_an_ask_sent_while_the_parents_reader_sleeps_wakes_it_before_the_reply(
    monkeypatch: pytest.MonkeyPatch, slow_kernels: Any
) -> None:
    """``ChildLink.sleep_until_readable``: a slow kernel's launch, sent while the reader sleeps,
    wakes it long before the kernel's reply could (the reader then spins for the reply), and the
    reply still reaches its asker. Fails with the wake-up off: the reader then sleeps on until the
    reply comes, ``SLOW_S`` later."""
    from xlog_actors.actors.isolated import _lane, _reader

    for module in (_proxy, _reader, _lane, _library):  # the parent's waits spin whatever the cores
        monkeypatch.setattr(module, "spin_budget", lambda seconds: seconds)
    device = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    kernels, copier = xa.KernelActor.start(device), xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    copier.ask(xa.Fill(ref, 0))
    child = device._actor_weakref()._keeper.child  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10.0
    while not child.reader_asleep:  # its spins after the last reply run out
        assert time.monotonic() < deadline, "the reader never slept"
        time.sleep(0.001)
    wakes = child.reader_wakes
    sent = time.monotonic()
    slow = kernels.ask(xa.Launch(slow_kernels.SLOW_FILL_U8, 1, 1, [xa.Out(ref), 9, 64]), block=False)
    while child.reader_wakes == wakes:
        assert time.monotonic() - sent < slow_kernels.SLOW_S * 0.8, "the reader slept through the launch"
        time.sleep(0.001)
    assert slow.get(timeout=30) is None
    assert copier.ask(xa.CopyToHost(ref, nbytes=2)) == b"\x09\x09"
