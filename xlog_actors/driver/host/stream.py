"""Streams and events of the host driver.

A :class:`HostStream` is a FIFO of callables run by one worker thread, so work on one stream runs
in order and streams run concurrently with each other, as on a GPU. An event is a completion
marker (a ``threading.Event``) that the stream sets when it reaches it; ``Stream.wait`` enqueues a
wait on the marker the event held at that moment, so re-recording a pooled event never changes
what an already enqueued wait waits for (CUDA semantics).

A stream knows its device only through :class:`StreamDevice`, the few checks it needs (the
device's state and fault gate, and the guard that drops or poisons device work), so this module
never imports the driver.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ...errors import DriverError, InvalidRequest
from ..protocol import Event

__all__ = ["HostEvent", "HostStream", "StreamDevice"]

_stream_ids = itertools.count(1)
_HANDLE_BASE = 0x5_0000_0000


class StreamDevice(Protocol):
    """What streams and events need of the emulated device they belong to.

    Thread rule: every method may be called from any thread.
    """

    @property
    def ordinal(self) -> int:
        """The device's ordinal."""
        ...

    def gate(self) -> None:
        """Check the device before a call: raise ``ContextLost``/``ContextPoisoned`` for a dead
        context, ``DriverError`` for a closed driver, and fire an injected fault that is due."""
        ...

    def gate_stream(self, stream: HostStream) -> None:
        """:meth:`gate`, then ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) when ``stream``
        belongs to an older context or was closed."""
        ...

    def check_after_sync(self) -> None:
        """Raise the error a sticky fault left while the caller waited, as a synchronize
        reports it."""
        ...

    def guarded(self, stream: HostStream, op: Callable[[], object]) -> Callable[[], object]:
        """``op`` wrapped for ``stream``'s thread: dropped when the stream's context is gone by
        the time it runs, and poisoning the context when it raises."""
        ...


class HostEvent:
    """A completion marker of the host driver; see the module docstring.

    Invariant: the marker is None (never recorded, complete) or the ``threading.Event`` of the
    latest record, set when the stream reaches it.

    Thread rule: any thread. ``record`` swaps the marker atomically (one attribute store) and
    readers take one load, so no lock is needed.
    """

    __slots__ = ("__weakref__", "_device", "_marker")

    def __init__(self, device: StreamDevice) -> None:
        """An unrecorded event of ``device``. Made by ``HostDriver.create_event`` or
        :meth:`HostStream.record_event`."""
        self._device = device
        self._marker: threading.Event | None = None

    @property
    def ordinal(self) -> int:
        """The ordinal of the event's device."""
        return self._device.ordinal

    def query(self) -> bool:
        """Whether the stream has reached the latest record (True if never recorded).

        Raises:
            ContextLost, ContextPoisoned, DriverError: from the device's gate.
        Thread rule: any thread.
        """
        self._device.gate()
        marker = self._marker
        return marker is None or marker.is_set()

    def synchronize(self) -> None:
        """Block until the stream has reached the latest record.

        Raises:
            ContextLost, ContextPoisoned, DriverError: from the device's gate, or a sticky fault
                raised by work that ran meanwhile.
        Thread rule: any thread but a stream thread of this device.
        """
        self._device.gate()
        marker = self._marker
        if marker is not None:
            marker.wait()
        self._device.check_after_sync()

    def __repr__(self) -> str:
        state = "unrecorded" if self._marker is None else ("done" if self._marker.is_set() else "pending")
        return f"HostEvent(device={self.ordinal}, {state})"


def _host_event(event: Event) -> HostEvent:
    """``event`` if it is a host driver event; ``InvalidRequest`` for another driver's (the
    parameter takes any event so that a stream fits the protocol whatever its event type)."""
    if not isinstance(event, HostEvent):
        raise InvalidRequest(f"a host stream can only record or wait on a HostEvent, got {event!r}")
    return event


def _stop() -> None:
    """The sentinel that ends a stream's thread (compared by identity, never called)."""


_STOP: Callable[[], object] = _stop


class HostStream:
    """One emulated stream: a FIFO of work and the worker thread that drains it in order.

    Invariants: ``epoch`` is the device context the stream was made in and never changes; once
    closed, a stream takes no more work and its thread ends after the work queued before.

    Thread rule: any thread may call every method; the work itself runs on the stream's own
    thread (named ``xlog-host-stream-<ordinal>.<id>``).
    """

    def __init__(self, device: StreamDevice, epoch: int) -> None:
        """A stream of ``device``'s context ``epoch``, its thread started. Made by
        ``HostDriver.create_stream``."""
        self._device = device
        self.epoch = epoch
        self._id = next(_stream_ids)
        self._queue: deque[Callable[[], object]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._submitted = 0
        self._completed = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"xlog-host-stream-{device.ordinal}.{self._id}", daemon=True
        )
        self._thread.start()

    # -- the Stream protocol ----------------------------------------------------------------
    @property
    def id(self) -> int:
        """A process-unique id of this stream."""
        return self._id

    @property
    def ordinal(self) -> int:
        """The ordinal of the stream's device."""
        return self._device.ordinal

    @property
    def handle(self) -> int:
        """A process-unique int standing for the raw stream handle (what DLPack exports carry)."""
        return _HANDLE_BASE + self._id

    def synchronize(self) -> None:
        """Block until every operation enqueued so far has run.

        Raises:
            ContextLost, ContextPoisoned, DriverError: from the device's gate (a closed stream or
                one of an older context included), or a sticky fault raised by the work waited for.
        Thread rule: any thread but this stream's own.
        """
        self._device.gate_stream(self)
        self.wait_idle()
        self._device.check_after_sync()

    def query(self) -> bool:
        """Whether every operation enqueued so far has run.

        Raises:
            ContextLost, ContextPoisoned, DriverError: from the device's gate.
        Thread rule: any thread.
        """
        self._device.gate_stream(self)
        return self._completed == self._submitted

    def record_event(self) -> HostEvent:
        """A new event recorded at the current end of this stream.

        Raises:
            ContextLost, ContextPoisoned, DriverError: from the device's gate.
        Thread rule: any thread.
        """
        event = HostEvent(self._device)
        self.record(event)
        return event

    def _gated_event(self, event: Event) -> HostEvent:
        """The preamble of ``record`` and ``wait``: ``event`` as a host event, then the gate."""
        host_event = _host_event(event)
        self._device.gate_stream(self)
        return host_event

    def record(self, event: Event) -> None:
        """Re-record ``event`` at the current end of this stream; waits already enqueued on it
        keep the record they saw.

        Raises:
            InvalidRequest: ``event`` is not a host driver event.
            ContextLost, ContextPoisoned, DriverError: from the device's gate.
        Thread rule: any thread.
        """
        host_event = self._gated_event(event)
        marker = threading.Event()
        host_event._marker = marker
        self.enqueue(marker.set, always=True)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``'s latest record; never blocks.

        Raises:
            InvalidRequest: ``event`` is not a host driver event.
            ContextLost, ContextPoisoned, DriverError: from the device's gate.
        Thread rule: any thread.
        """
        marker = self._gated_event(event)._marker
        if marker is None or marker.is_set():
            return  # already satisfied: CUDA's wait is then a no-op as well
        self.enqueue(marker.wait, always=True)

    def close(self) -> None:
        """Stop the stream once its queued work has run, and join its thread. Idempotent.

        Thread rule: any thread (from the stream's own thread it does not join).
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.append(_STOP)
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        return f"HostStream(device={self.ordinal}, id={self._id}, epoch={self.epoch})"

    # -- the driver's side ------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def enqueue(self, op: Callable[[], object], *, always: bool = False) -> int:
        """Append work to the stream.

        Args:
            op: the work; it runs on the stream's thread after everything enqueued before.
            always: run ``op`` even when the stream's context is gone by then (markers and waits,
                so nobody waits forever). Otherwise the op is dropped in that case (its memory is
                gone too), and an exception it raises poisons the context.
        Returns:
            The op's sequence number on this stream (1 for the first).
        Raises:
            DriverError: ``CUDA_ERROR_INVALID_HANDLE`` when the stream is closed.
        Thread rule: any thread.
        """
        if not always:
            op = self._device.guarded(self, op)
        with self._cond:
            if self._closed:
                raise DriverError(
                    f"stream {self._id} of device {self.ordinal} is closed",
                    code="CUDA_ERROR_INVALID_HANDLE",
                )
            self._submitted += 1
            seq = self._submitted
            self._queue.append(op)
            self._cond.notify()
        return seq

    def wait_idle(self) -> None:
        """Block until the work enqueued so far has run; no gate, no fault check (the driver's
        device-synchronizing ``free`` uses it). Returns at once on a closed stream.

        Thread rule: any thread but this stream's own.
        """
        if self._completed == self._submitted:
            return
        done = threading.Event()
        with self._cond:
            if self._closed:
                return
            self._submitted += 1
            self._queue.append(done.set)
            self._cond.notify()
        done.wait()

    def _run(self) -> None:
        queue = self._queue
        cond = self._cond
        while True:
            with cond:
                while not queue:
                    cond.wait()
                op = queue.popleft()
            if op is _STOP:
                return
            try:
                op()
            finally:
                self._completed += 1
