"""Streams and events of the host driver.

A :class:`HostStream` is a FIFO of callables run by one worker thread, so work on one stream runs
in order and streams run concurrently with each other, as on a GPU. An event is a completion
marker (a ``threading.Event``) that the stream sets when it reaches it; ``Stream.wait`` enqueues a
wait on the marker the event held at that moment, so re-recording a pooled event never changes
what an already enqueued wait waits for (CUDA semantics).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .host import HostDriver

__all__ = ["HostEvent", "HostStream"]

_stream_ids = itertools.count(1)
_HANDLE_BASE = 0x5_0000_0000


class HostEvent:
    """See the module docstring. Thread rules: ``record`` swaps the marker atomically (one
    attribute store); readers take one load, so no lock is needed."""

    __slots__ = ("__weakref__", "_driver", "_marker", "_ordinal")

    def __init__(self, driver: HostDriver, ordinal: int) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self._marker: threading.Event | None = None

    @property
    def ordinal(self) -> int:
        return self._ordinal

    def query(self) -> bool:
        self._driver._gate(self._ordinal)
        marker = self._marker
        return marker is None or marker.is_set()

    def synchronize(self) -> None:
        self._driver._gate(self._ordinal)
        marker = self._marker
        if marker is not None:
            marker.wait()
        self._driver._check_after_sync(self._ordinal)

    def __repr__(self) -> str:
        state = "unrecorded" if self._marker is None else ("done" if self._marker.is_set() else "pending")
        return f"HostEvent(device={self._ordinal}, {state})"


_STOP = object()


class HostStream:
    """One emulated stream: a queue and the thread that drains it."""

    def __init__(self, driver: HostDriver, ordinal: int, epoch: int) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self.epoch = epoch
        self._id = next(_stream_ids)
        self._queue: deque[Callable[[], None] | object] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._submitted = 0
        self._completed = 0
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"xlog-host-stream-{ordinal}.{self._id}", daemon=True
        )
        self._thread.start()

    # -- protocol ---------------------------------------------------------------------------
    @property
    def id(self) -> int:
        return self._id

    @property
    def ordinal(self) -> int:
        return self._ordinal

    @property
    def handle(self) -> int:
        return _HANDLE_BASE + self._id

    def synchronize(self) -> None:
        self._driver._gate_stream(self)
        self._wait_idle()
        self._driver._check_after_sync(self._ordinal)

    def query(self) -> bool:
        self._driver._gate_stream(self)
        return self._completed == self._submitted

    def record_event(self) -> HostEvent:
        event = HostEvent(self._driver, self._ordinal)
        self.record(event)
        return event

    def record(self, event: HostEvent) -> None:  # type: ignore[override]
        self._driver._gate_stream(self)
        marker = threading.Event()
        event._marker = marker
        self.enqueue(marker.set, always=True)

    def wait(self, event: HostEvent) -> None:  # type: ignore[override]
        self._driver._gate_stream(self)
        marker = event._marker
        if marker is None or marker.is_set():
            return  # already satisfied: CUDA's wait is then a no-op as well
        self.enqueue(marker.wait, always=True)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.append(_STOP)
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        return f"HostStream(device={self._ordinal}, id={self._id}, epoch={self.epoch})"

    # -- driver side ------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def enqueue(self, op: Callable[[], None], *, always: bool = False) -> int:
        """Append ``op``; returns its sequence number on this stream. Unless ``always``, the op
        is skipped when the stream's context is gone by the time it runs (its memory is gone
        too); markers and waits always run so nobody waits forever."""
        if not always:
            op = self._driver._guarded(self, op)
        with self._cond:
            if self._closed:
                from ..errors import DriverError

                raise DriverError(
                    f"stream {self._id} of device {self._ordinal} is closed",
                    code="CUDA_ERROR_INVALID_HANDLE",
                )
            self._submitted += 1
            seq = self._submitted
            self._queue.append(op)
            self._cond.notify()
        return seq

    def _wait_idle(self) -> None:
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
                op()  # type: ignore[operator]
            finally:
                self._completed += 1
