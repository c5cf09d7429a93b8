"""The interprocess events of CUDA exports (``xlog_actors.driver.cuda.ipc``), their bookkeeping
checked without a GPU on a stand-in of ``cuda.bindings``: an export of a block whose last write is
on the stream of an earlier export records that export's event again instead of making one; an
importer opens an event once per export slot while a handle keeps the opening, and waits on it
with one query once it is reached; the owner's table keeps a reused event once."""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any

import pytest
from cuda.bindings import driver as real_cu

from xlog_actors.driver.cuda import ipc
from xlog_actors.driver.cuda.importer import HANDLE_BYTES
from xlog_actors.errors import DriverError

SUCCESS = real_cu.CUresult.CUDA_SUCCESS
NOT_READY = real_cu.CUresult.CUDA_ERROR_NOT_READY


class _Handle:
    """A stand-in ``CUipcEventHandle`` holding 64 given bytes."""

    def __init__(self, data: bytes) -> None:
        self._buf = ctypes.create_string_buffer(data, HANDLE_BYTES)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


class FakeCu:
    """``cuda.bindings.driver`` with the event calls counted (the rest is the real module)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.made = 0
        self.live: set[int] = set()
        self.reached = True
        #: The gate of the stream being recorded on, checked held at each record.
        self.gate: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(real_cu, name)

    def cuEventCreate(self, _flags: Any) -> tuple[Any, int]:
        self.calls.append("create")
        self.made += 1
        self.live.add(self.made)
        return SUCCESS, self.made

    def cuEventRecord(self, event: int, _stream: Any) -> tuple[Any]:
        self.calls.append(f"record {event}")
        if self.gate is not None and not self.gate.locked():
            self.calls.append("outside the gate")
        return (SUCCESS,)

    def cuIpcGetEventHandle(self, event: int) -> tuple[Any, _Handle]:
        self.calls.append("handle")
        return SUCCESS, _Handle(bytes([event]) * HANDLE_BYTES)

    def cuIpcOpenEventHandle(self, _handle: Any) -> tuple[Any, int]:
        self.calls.append("open")
        self.made += 1
        self.live.add(self.made)
        return SUCCESS, self.made

    def cuEventQuery(self, _event: int) -> tuple[Any]:
        self.calls.append("query")
        return (SUCCESS if self.reached else NOT_READY,)

    def cuEventDestroy(self, event: int) -> tuple[Any]:
        self.live.discard(event)
        return (SUCCESS,)


class _Driver:
    def make_current(self, _ordinal: int) -> None:
        pass


class _Stream:
    """A stand-in ``CudaStream``: an ordinal, a handle, weak references, the gate a rebuild
    retires it through and the liveness check made under it (``retired``: its context was
    rebuilt)."""

    def __init__(self, handle: int) -> None:
        self.ordinal = 0
        self.handle = handle
        self._gate = threading.Lock()
        self.retired = False

    def _enter(self) -> None:
        if self.retired:
            raise DriverError(f"stream {self.handle} belongs to a destroyed context", code="CUDA_ERROR_INVALID_HANDLE")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCu:
    cu = FakeCu()
    monkeypatch.setattr(ipc, "cu", cu)
    monkeypatch.setattr(ipc, "make_current", lambda _ordinal: None)
    return cu


def test_an_export_on_the_same_stream_records_the_earlier_event_again(fake: FakeCu) -> None:
    driver, stream, other = _Driver(), _Stream(1), _Stream(2)
    first = ipc.record_event(driver, stream)
    assert fake.calls == ["create", "record 1", "handle"]
    fake.calls.clear()
    again = ipc.record_event(driver, stream, first)
    assert again is first and fake.calls == ["record 1"], "no new event, no new handle: one record"
    fake.calls.clear()
    elsewhere = ipc.record_event(driver, other, first)
    assert elsewhere is not first and fake.calls == ["create", "record 2", "handle"], "another stream: a new event"
    assert elsewhere.handle != first.handle


def test_a_stream_gone_is_never_taken_for_a_new_one_at_the_same_handle(fake: FakeCu) -> None:
    driver, stream = _Driver(), _Stream(1)
    first = ipc.record_event(driver, stream)
    del stream
    gc.collect()
    fake.calls.clear()
    assert ipc.record_event(driver, _Stream(1), first) is not first
    assert fake.calls[0] == "create"


def test_a_record_holds_the_streams_gate_and_a_retired_stream_is_refused_before_any_call(fake: FakeCu) -> None:
    """A rebuild retires a stream through its gate before it destroys the stream and the
    context: the record checks the stream under that gate and calls CUDA only while holding it,
    so an export racing a rebuild gets ``DriverError`` instead of recording onto a destroyed
    stream (which crashes the process)."""
    driver, stream = _Driver(), _Stream(1)
    fake.gate = stream._gate
    first = ipc.record_event(driver, stream)
    ipc.record_event(driver, stream, first)
    assert "outside the gate" not in fake.calls and fake.calls.count("record 1") == 2
    fake.calls.clear()
    stream.retired = True
    for again in (None, first):
        with pytest.raises(DriverError, match="destroyed context"):
            ipc.record_event(driver, stream, again)
    assert fake.calls == [], "nothing reached CUDA"
    assert not stream._gate.locked()


def test_an_importer_opens_an_event_once_while_a_handle_keeps_the_opening(fake: FakeCu) -> None:
    handle = bytes([9]) * HANDLE_BYTES
    key = ("xlog-refs-test", 3, 1, 0, handle)
    opened = ipc.open_event(0, handle, key)
    assert ipc.open_event(0, handle, key) is opened and fake.calls.count("open") == 1
    assert ipc.open_event(0, handle, ("xlog-refs-test", 3, 2, 0, handle)) is not opened, "another serial: another open"
    fake.calls.clear()
    opened.wait(1.0, lambda: None)
    assert fake.calls == ["query"], "reached already: one query, no open, no sleep"
    event = opened._event
    del opened
    gc.collect()
    assert event not in fake.live, "the last holder gone, the opening is destroyed"
    ipc.open_event(0, handle, key)
    assert fake.calls.count("open") == 1


def test_a_wait_on_an_opened_event_polls_until_reached_and_can_be_aborted(fake: FakeCu) -> None:
    handle = bytes([7]) * HANDLE_BYTES
    opened = ipc.open_event(0, handle, ("xlog-refs-test", 4, 1, 0, handle))
    fake.reached = False

    class Stop(Exception):
        pass

    def abort() -> None:
        if fake.calls.count("query") >= 3:
            raise Stop

    with pytest.raises(Stop):
        opened.wait(5.0, abort)
    fake.reached = True
    opened.wait(0.0, abort)
