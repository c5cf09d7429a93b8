"""A kept copy source crosses to an isolated device's process as a token (``isolated/_sources.py``):
the child serves it from the handle that crossed with the export's first copy, taking no count and
importing nothing; a token of another export (a write since: a fresh export) is never served from
an older one's handle; the child's table is bounded, forgets what the parent drops (only once no
message naming it is in flight), and starts again after a rebuild or restart of either device;
``shared_ref.adopt`` takes the count a token does not carry. A copy sent again unchanged is the
payload pickled the first time, its destination checked every time; a ``LibraryWork`` pickles as
its fields. The first tests run the child's table in this process, over a ``shared=True`` host
driver whose device 0 owns the sources; the others run isolated host devices."""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import shared_ref
from xlog_actors.actors.export_table import HEADER_CELLS
from xlog_actors.actors.isolated import ChildFault, _library, _protocol, _sources
from xlog_actors.actors.isolated._sources import KeptImports, KeptSource
from xlog_actors.actors.library_messages import BufferArg
from xlog_actors.actors.shared_ref import SharedGpuRef
from xlog_actors.driver.kernel_library import FILL_F32
from xlog_actors.memory.block import Access

NBYTES = 4096
SLOW_US = 300_000


def _count(export: shared_ref.GpuRefExport) -> int:
    """The owner's count of ``export``'s slot now (0 once the slot was freed and reused)."""
    cells = shared_ref._table_cells(export.table)
    base = HEADER_CELLS + 2 * export.slot
    return int(cells[base]) if cells[base + 1] == export.serial else 0


def _token(ident: int, ref: xa.GpuRef) -> KeptSource:
    """A fresh export of ``ref`` as the parent keeps it: its import here holds the count."""
    shared = pickle.loads(pickle.dumps(ref))
    return KeptSource(ident, pickle.dumps(shared.export, pickle.HIGHEST_PROTOCOL), shared)


# -- the child's table, in this process ----------------------------------------------------------


@dataclass
class _Owner:
    """Devices 0 (the sources' owner) and 1 (the copies' destination) of one ``shared=True`` host
    driver, a copy actor of each, and the driver."""

    dev0: pykka.ActorRef[Any]
    dev1: pykka.ActorRef[Any]
    copy0: pykka.ActorRef[Any]
    copy1: pykka.ActorRef[Any]
    driver: xa.HostDriver


@pytest.fixture
def owner() -> Iterator[_Owner]:
    drv = xa.HostDriver(device_count=2, memory_per_device=16 << 20, shared=True)
    dev0, dev1 = xa.DeviceActor.start(0, drv), xa.DeviceActor.start(1, drv)
    yield _Owner(dev0, dev1, xa.CopyActor.start(dev0), xa.CopyActor.start(dev1), drv)
    pykka.ActorRegistry.stop_all()
    drv.close()


def test_a_kept_source_is_served_from_the_handle_that_crossed_with_its_first_copy(owner: _Owner) -> None:
    """The second crossing of a token takes no count and makes no handle: the first's is served."""
    copy0, copy1 = owner.copy0, owner.copy1
    src, dst = owner.dev0.ask(xa.Allocate(NBYTES)), owner.dev1.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 7))
    token = _token(1, src)
    kept = KeptImports(4)
    crossed = pickle.loads(pickle.dumps(token.carrying()))  # the first copy: the export in full
    assert isinstance(crossed.shared, SharedGpuRef) and crossed.ident == 1
    first = kept.resolve(crossed, 0)
    assert first is crossed.shared and _count(token.shared.export) == 2, "the parent's count and the child's"
    del crossed
    later = pickle.loads(pickle.dumps(token))
    assert later.shared is None, "later copies: the token alone"
    again = kept.resolve(later, 0)
    assert again is first and (kept.hits, kept.carried, kept.adopted) == (1, 1, 0)
    assert _count(token.shared.export) == 2, "no count taken for the second crossing"
    copy1.ask(xa.CopyDeviceToDevice(again, dst))
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x07" * NBYTES
    other = KeptImports(4)  # a child that never got the first copy (a new process): the descriptor serves
    assert other.resolve(later, 0) is not first and other.adopted == 1 and _count(token.shared.export) == 3


@pytest.mark.parametrize(
    ("mapping", "sees_the_write"),
    [("a new ident", True), ("the old ident", True), ("the old ident, bytes not compared", False)],
)
def test_a_token_of_a_newer_export_is_never_served_from_an_older_ones_handle(
    owner: _Owner, monkeypatch: pytest.MonkeyPatch, mapping: str, sees_the_write: bool
) -> None:
    """The source is written behind a slow sleep after its first export, and exported again: the
    copy of the newer token waits for that write. The last case is the hazard a wrong mapping
    makes: a child that served a token from the handle kept under its ident without checking the
    descriptor (what a parent giving an ident twice would then get) reads before the write."""
    copy0, copy1 = owner.copy0, owner.copy1
    src, dst = owner.dev0.ask(xa.Allocate(NBYTES)), owner.dev1.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 0))
    copy0.ask(xa.CopyToHost(src, nbytes=1))  # the zero fill has landed
    kept = KeptImports(4)
    old = _token(1, src)
    copy1.ask(xa.CopyDeviceToDevice(kept.resolve(old, 0), dst))
    if "not compared" in mapping:
        monkeypatch.setattr(_sources, "_same", lambda kept_bytes, crossed: True)
    ctx = src.context
    owner.driver.sleep(ctx.runtime.stream_pool.resolve(copy0.proxy().stream_id.get()), SLOW_US)
    copy0.ask(xa.Fill(src, 9))  # behind the sleep: the source's last write, still to come
    newer = _token(2 if mapping == "a new ident" else 1, src)
    assert newer.descriptor != old.descriptor, "a new export: another event"
    copy1.ask(xa.CopyDeviceToDevice(kept.resolve(newer, 0), dst))
    got = copy1.ask(xa.CopyToHost(dst))
    if sees_the_write:
        assert got == b"\x09" * NBYTES
    else:
        assert got == bytes(NBYTES), "served from the old export's handle, the copy did not wait for the write"


def test_the_table_is_bounded_forgets_and_starts_again_in_a_new_generation(owner: _Owner) -> None:
    """Each way a kept handle goes: the bound, a forget, a new generation of the child's device,
    a new generation of the source's owner (at the next token), a clear."""
    tokens = [_token(k, owner.dev0.ask(xa.Allocate(NBYTES))) for k in range(3)]
    kept = KeptImports(2)
    handles = [weakref.ref(kept.resolve(token, 0)) for token in tokens]
    assert len(kept) == 2 and handles[0]() is None, "the least recently used dropped"
    assert _count(tokens[0].shared.export) == 1, "its count given back"
    assert kept.resolve(tokens[2], 0) is handles[2]()
    kept.forget((2, 99))  # an ident not kept is skipped
    assert len(kept) == 1 and _count(tokens[2].shared.export) == 1
    assert kept.resolve(tokens[1], 0) is handles[1]()
    assert kept.resolve(tokens[1], 1) is not handles[1](), "a new generation of the child's device starts again"
    assert kept.adopted == 4 and _count(tokens[1].shared.export) == 2
    kept.clear()
    assert len(kept) == 0 and _count(tokens[1].shared.export) == 1
    stale = weakref.ref(kept.resolve(tokens[1], 1))
    owner.dev0.ask(xa.Rebuild("test"))  # the sources' owner moves on: every handle of it is stale
    kept.resolve(_token(9, owner.dev0.ask(xa.Allocate(NBYTES))), 1)
    assert stale() is None and len(kept) == 1, "the stale handle went at the next token, its mapping with it"


def test_adopt_takes_a_count_of_its_own_and_refuses_a_slot_given_up(owner: _Owner) -> None:
    src = owner.dev0.ask(xa.Allocate(NBYTES))
    held = pickle.loads(pickle.dumps(src))
    export = held.export
    adopted = shared_ref.adopt(export)
    assert _count(export) == 2 and adopted.access() is adopted
    adopted.release()
    assert _count(export) == 1
    held.release()  # the last count: the owner frees the slot
    late = shared_ref.adopt(export)
    assert late.released and _count(export) == 0, "no count taken of a slot given up"
    with pytest.raises(xa.GpuRefStale, match="released"):
        late.access()
    again = pickle.loads(pickle.dumps(src))
    owner.dev0.ask(xa.Rebuild("test"))
    with pytest.raises(xa.GpuRefStale, match="context rebuilt"):
        shared_ref.adopt(again.export).access()


# -- two isolated devices ------------------------------------------------------------------------

@pytest.fixture
def pair() -> Iterator[list[pykka.ActorRef[Any]]]:
    devices = [xa.DeviceActor.start(k, "host", isolate=True, hot_spare=False) for k in (0, 1)]
    yield devices
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def full_exports(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The ``SharedGpuRef`` pickled in this process (a count taken each), counted."""
    pickled: list[object] = []
    real = SharedGpuRef.__reduce__

    def counting(self: SharedGpuRef) -> Any:
        pickled.append(self)
        return real(self)

    monkeypatch.setattr(SharedGpuRef, "__reduce__", counting)
    return pickled


def _kept(copy: pykka.ActorRef[Any], src: xa.GpuRef) -> Any:
    """What ``copy`` (a parent-side copy actor) keeps for ``src`` (an ``_library._Kept``)."""
    library = copy._actor_weakref()  # type: ignore[attr-defined]
    with library._lock:
        return library._kept[id(src)]


def _kept_export(copy: pykka.ActorRef[Any], src: xa.GpuRef) -> shared_ref.GpuRefExport:
    """The export ``copy`` (a parent-side copy actor) keeps for ``src``."""
    return _kept(copy, src).shared.export  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaked_process")
def test_copies_of_a_kept_source_cross_without_a_count_or_an_import(
    pair: list[pykka.ActorRef[Any]], full_exports: list[object]
) -> None:
    """Fails with the token off: each copy then pickles the kept ``SharedGpuRef`` (a count)."""
    dev0, dev1 = pair
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 7))
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(full_exports) == 1, "the first copy carries the export in full"
    export = _kept_export(copy1, src)
    counted = _count(export)
    for _ in range(5):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert len(full_exports) == 1, "every later copy crossed as the kept export's token alone"
    assert _count(export) == counted == 2, "the parent's count and the child's kept handle's, no more"
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x07" * NBYTES


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaked_process")
def test_a_write_on_the_source_device_makes_a_new_token_ordered_after_it(
    slow_kernels: Any, pair: list[pykka.ActorRef[Any]]
) -> None:
    dev0, dev1 = pair
    copy0, copy1, kernels0 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1), xa.KernelActor.start(dev0)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 0))
    for _ in range(2):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    first = _kept(copy1, src).source.ident
    kernels0.ask(xa.Launch(slow_kernels.SLOW_FILL_U8, 1, 1, [xa.Out(src), 9, NBYTES]))  # replies once enqueued
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x09" * NBYTES
    assert _kept(copy1, src).source.ident != first


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaked_process")
def test_a_restart_or_rebuild_of_either_device_ends_the_tokens_issued_before(
    pair: list[pykka.ActorRef[Any]],
) -> None:
    """The destination's new process (or new generation) has no handle of the kept export: the
    token is served from its descriptor; the source's restart makes the copy ``GpuRefStale``."""
    dev0, dev1 = pair
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    src, dst = dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, 3))
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    with contextlib.suppress(xa.DeviceUnavailable):
        dev1.ask(ChildFault("exit"))
    dst = dev1.ask(xa.Allocate(NBYTES))
    for _ in range(2):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x03" * NBYTES
    dev1.ask(xa.Rebuild("test"))
    dst = dev1.ask(xa.Allocate(NBYTES))
    copy1.ask(xa.CopyDeviceToDevice(src, dst))
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x03" * NBYTES
    with contextlib.suppress(xa.DeviceUnavailable, xa.GpuRefStale):
        dev0.ask(ChildFault("exit"))
    with pytest.raises(xa.GpuRefStale):
        copy1.ask(xa.CopyDeviceToDevice(src, dst))
    fresh = dev0.ask(xa.Allocate(NBYTES))
    xa.CopyActor.start(dev0).ask(xa.Fill(fresh, 4))
    copy1.ask(xa.CopyDeviceToDevice(fresh, dst))
    assert copy1.ask(xa.CopyToHost(dst)) == b"\x04" * NBYTES


def _gone(export: shared_ref.GpuRefExport, timeout_s: float = 10.0) -> bool:
    """Whether the owner let go of ``export``'s slot (every count given back) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _count(export) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _count(export) == 0


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaked_process")
def test_a_released_source_is_let_go_in_both_processes_at_the_next_copy(pair: list[pykka.ActorRef[Any]]) -> None:
    """Fails without the forget (or without the drop at a stop): the child's handle of the source
    keeps its count. Another copy actor of the same process copies from as many other sources
    as the child's import cache holds first, so that its entry (the same handle) is evicted and
    only the kept source's handle could still hold the count."""
    from xlog_actors.actors.import_cache import CAPACITY

    dev0, dev1 = pair
    copy1, other = xa.CopyActor.start(dev1), xa.CopyActor.start(dev1)
    a, b, dst = dev0.ask(xa.Allocate(NBYTES)), dev0.ask(xa.Allocate(NBYTES)), dev1.ask(xa.Allocate(NBYTES))

    def evict_the_import_cache() -> None:
        for _ in range(CAPACITY):
            other.ask(xa.CopyDeviceToDevice(dev0.ask(xa.Allocate(NBYTES)), dst))

    for _ in range(2):
        copy1.ask(xa.CopyDeviceToDevice(a, dst))
    export = _kept_export(copy1, a)
    a.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        copy1.ask(xa.CopyDeviceToDevice(a, dst))
    evict_the_import_cache()
    assert _count(export) >= 1, "the copy actor still keeps it, in this process and the child"
    copy1.ask(xa.CopyDeviceToDevice(b, dst))  # drops a's kept export and tells the child to forget it
    assert _gone(export), f"a count of the released source is still held: {_count(export)}"
    kept_b = _kept_export(copy1, b)
    copy1.stop()  # the child drops every kept source of the stopped actor
    evict_the_import_cache()
    assert _gone(kept_b), f"a count of the stopped actor's source is still held: {_count(kept_b)}"


def test_a_kept_export_is_forgotten_only_once_no_frame_naming_it_is_in_flight() -> None:
    """``IsolatedLibrary``'s bookkeeping, without an actor: a kept export dropped while a frame
    names it is forgotten when that frame is answered; a failed message's forgets go again."""
    library: Any = object.__new__(_library.IsolatedLibrary)
    library._lock = threading.Lock()
    library._forget = []
    entry = object.__new__(_library._Kept)
    entry.source, entry.inflight, entry.dropped = KeptSource(5, b""), 1, False
    settled = library._settler(entry, ())
    library._drop(entry)
    assert library._forget == [], "a frame naming it is in flight"
    settled(False)
    assert library._forget == [5] and entry.inflight == 0
    library._forget.clear()
    library._drop(entry)
    assert library._forget == [], "dropped once"
    library._settler(None, (5, 6))(True)
    assert library._forget == [5, 6], "a failed message's forgets are sent again"
    library._settler(None, (7,))(False)
    assert library._forget == [5, 6]


def test_an_answer_settles_once_whichever_way_it_comes() -> None:
    calls: list[bool] = []
    for answer in ("set", "set_exception", "fill", "fill_error"):
        future: Any = _library.SpinningFuture(0.0) if answer.startswith("fill") else pykka.ThreadingFuture()
        reply = _library.LibraryAnswer(future, "test", calls.append)
        error = (ValueError, ValueError("x"), None)
        if answer == "set":
            reply.set(1)
        elif answer == "set_exception":
            reply.set_exception(error)
        else:
            bell = reply.fill(1, error if answer == "fill_error" else None)
            assert bell is not None
        with contextlib.suppress(ValueError, Exception):
            reply.set(2)  # a second answer: pykka refuses it; settled already
    assert calls == [False, True, False, True]


def test_library_work_crosses_as_its_fields() -> None:
    """Every library message a ``LibraryWork`` flattens comes back equal, its forgets too."""
    a, b = _protocol.RemoteHandle(0x1000, 1), _protocol.RemoteHandle(0x2000, 1)
    messages = [
        xa.CopyDeviceToDevice(a, b), xa.CopyDeviceToDevice(KeptSource(3, b"xyz"), b), xa.Fill(a, 3),
        xa.CopyToHost(a, 8), xa.CopyToDevice(a, b"data"),
        xa.Launch(FILL_F32, 4, 64, [BufferArg(a, Access.WRITE), 2.0, 256]),
        xa.Launches([xa.Launch(FILL_F32, 1, 1, [xa.Out(b), 1.0, 1])]), "not a library message",
    ]
    for message, forget in zip(messages, itertools.cycle([(), (4, 5)])):
        work = _protocol.LibraryWork("urn:test", xa.CopyActor, True, message, forget)
        back = pickle.loads(pickle.dumps(work, pickle.HIGHEST_PROTOCOL))
        if isinstance(message, xa.CopyDeviceToDevice) and isinstance(message.src, KeptSource):
            assert (back.message.src.ident, back.message.src.descriptor) == (3, b"xyz")
            assert back.message.dst == b and back.forget == forget
        else:
            assert back == work, message


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_leaked_process")
def test_a_repeated_kept_copy_is_sent_as_the_bytes_pickled_the_first_time() -> None:
    """``payload_of``: the same copy of a kept source reuses its pickled payload; anything its
    payload holds that changes (the destination, the kept export, the child's generation), a
    forget or a token carrying its export makes a new one; the destination is validated every
    time. Fails when the reuse ignores one of them: the decoded payload names the wrong handle."""
    device = xa.DeviceActor.start(0, "host", isolate=True, hot_spare=False)
    proxy = device._actor_weakref()  # type: ignore[attr-defined]
    child, owner_urn = proxy._keeper.child, proxy.actor_urn
    a, b = device.ask(xa.Allocate(NBYTES)), device.ask(xa.Allocate(NBYTES))
    token = KeptSource(11, b"descriptor")

    def payload(src: Any, dst: xa.GpuRef, forget: tuple[int, ...] = ()) -> Any:
        work = _protocol.LibraryWork("urn:test", xa.CopyActor, True, xa.CopyDeviceToDevice(src, dst), forget)
        return _library.payload_of(work, owner_urn, child, 0)

    def decoded(sent: Any) -> Any:
        work = pickle.loads(pickle.dumps(sent, pickle.HIGHEST_PROTOCOL))
        assert isinstance(work, _protocol.LibraryWork)
        return work

    first = payload(token, a)
    assert isinstance(first, _protocol.PickledWork) and payload(token, a) is first, "the same copy: the same bytes"
    work = decoded(first)
    assert (work.message.src.ident, work.message.src.descriptor, work.message.src.shared) == (11, b"descriptor", None)
    assert work.message.dst == _protocol.RemoteHandle(a.block.ptr, 0) and work.forget == ()
    other = payload(token, b)
    assert other is not first and decoded(other).message.dst.ptr == b.block.ptr, "another destination"
    assert decoded(payload(KeptSource(12, b"other"), b)).message.src.ident == 12, "another kept export"
    assert isinstance(payload(token, b, forget=(3,)), _protocol.LibraryWork), "a forget is not cached"
    assert isinstance(payload(token.carrying(), b), _protocol.LibraryWork), "nor the export's first copy"
    b.release()
    with pytest.raises(xa.GpuRefStale, match="released"):
        payload(token, b)  # validated every time, as to_child validates it
    assert payload(token, a) is not first and decoded(payload(token, a)).message.dst.ptr == a.block.ptr
    device.ask(xa.Rebuild("test"))
    with pytest.raises(xa.GpuRefStale):
        payload(token, a)
    fresh = device.ask(xa.Allocate(NBYTES))
    assert fresh.block.ptr == a.block.ptr, "the same address in the child's new generation"
    assert decoded(payload(token, fresh)).message.dst.generation == 1, "the payload names the new generation"


def test_the_same_pickled_work_twice_in_a_row_is_read_as_one_object() -> None:
    # What a copy sent again unchanged costs the child's frame reader: no second unpickling.
    copy = xa.CopyDeviceToDevice(KeptSource(21, b"d"), _protocol.RemoteHandle(4096, 0))  # type: ignore[arg-type]
    work = _protocol.LibraryWork("urn:a", xa.CopyActor, True, copy)
    data = pickle.dumps(work, pickle.HIGHEST_PROTOCOL)
    first = pickle.loads(pickle.dumps(_protocol.PickledWork(data)))
    again = pickle.loads(pickle.dumps(_protocol.PickledWork(bytes(data))))  # equal bytes, another object
    assert isinstance(first, _protocol.LibraryWork) and again is first
    assert first.message.src.ident == 21 and first.message.dst == _protocol.RemoteHandle(4096, 0)
    other = _protocol.LibraryWork("urn:a", xa.CopyActor, True,
                                  xa.CopyDeviceToDevice(KeptSource(22, b"d"), _protocol.RemoteHandle(4096, 0)))  # type: ignore[arg-type]
    changed = pickle.loads(pickle.dumps(_protocol.PickledWork(pickle.dumps(other, pickle.HIGHEST_PROTOCOL))))
    assert changed is not first and changed.message.src.ident == 22, "other bytes: read again"
    assert pickle.loads(pickle.dumps(_protocol.PickledWork(data))) is not first, "not the previous bytes any more"
