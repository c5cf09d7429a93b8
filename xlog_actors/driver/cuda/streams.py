"""Streams and events: ``CudaStream``, ``CudaEvent``, the stream's gate and its retirement.

* **Streams** are ``CU_STREAM_NON_BLOCKING``; each has a process-unique ``id`` (from 1: 0 is
  ``StreamId.DEFAULT``), ``ordinal`` and ``handle`` (the ``CUstream`` as an int), and exports
  ``__cuda_stream__`` so cuda.core and CuPy can use it.
* **Events** are ``CU_EVENT_DISABLE_TIMING`` only. ``CU_EVENT_BLOCKING_SYNC`` is deliberately not
  used: these events are the allocator's hot-path markers for ``cuStreamWaitEvent`` and
  ``cuEventQuery`` (one per cross-stream use), where it buys nothing, and the host blocks on them
  only in reaps and tests; there the context's scheduling policy applies exactly as it does to
  ``cuStreamSynchronize`` (spin while the process has fewer contexts than cores, else yield).
* **Host buffers of async copies.** The source of ``copy_to_device``, and the destination of
  ``copy_to_host``/``copy_to_host_into``, stay referenced by the stream (``_keep_until_done``)
  until an event recorded right after the copy has fired (checked on later copies and at
  ``synchronize``), so no DMA ever touches freed host memory and the list stays short without a
  synchronize. A stream closed with copies in flight hands them to its device, which drops them as
  their events fire.
* **The GIL.** Recording, querying and waiting on events, and the copies' markers, go through
  :mod:`.held` (the GIL kept: they only enqueue or read a flag); a synchronize lets it go.
* **Garbage collection.** Finalizers never call CUDA (they may run on any thread, inside any
  lock): a collected stream or event hands its handles to its device's graveyard, which the next
  ``create_stream``/``create_event``/``record_event`` empties.

This module is over 400 lines because streams and events are one concept here: a stream records
and waits on events, keeps events as the markers of its copies, and shares their epoch checks;
the per-method docstrings do the rest.

Thread rule: every method may be called from any thread. Each stream's gate (a lock held across
its liveness check and the CUDA call) makes work on a stream and a rebuild exclusive: the rebuild
retires every stream through its gate before it synchronizes and frees, so stream work racing it
either ran before (and was waited for) or is refused; none runs on freed memory. A stream or
event of an older epoch raises ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) instead of
reaching CUDA with a dead handle.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from typing import Any, Final

from ...errors import DriverError, InvalidRequest
from .call import EVENT_FLAGS, NOT_READY, SUCCESS, cu
from .context import CudaDevice
from .current import tls
from .held import as_result

__all__ = ["CudaEvent", "CudaStream"]

_SPARE_EVENTS: Final[int] = 32  # keep-alive events a stream keeps for reuse
# Stream ids are process-unique (and so driver-unique); 0 is StreamId.DEFAULT.
_stream_ids = itertools.count(1)


class CudaEvent:
    """A ``CUevent`` (timing disabled) of one device's context incarnation.

    ``query()`` is True once the work before its latest record ran (or it was never recorded).
    An event of a context that was rebuilt or closed raises ``DriverError``
    (``CUDA_ERROR_INVALID_HANDLE``); its handle died with the context and is never passed to
    CUDA again. When garbage-collected its handle is destroyed by the device's next
    ``create_stream``/``create_event``/``record_event`` (finalizers never call CUDA).
    """

    __slots__ = ("__weakref__", "_cu", "_dev", "_epoch", "_h", "_incarnation", "_live")

    def __init__(self, dev: CudaDevice, event: Any, epoch: int, live: object | None) -> None:
        self._dev = dev
        self._cu = event
        self._h = int(event)  # the handle as an int, for the compiled core's direct calls
        self._epoch = epoch
        # The device's ``epoch_token`` of ``epoch`` (None if made for a dead stream): the
        # compiled core's one-identity check of device and epoch.
        self._live = live
        self._incarnation = dev.incarnation

    @property
    def ordinal(self) -> int:
        """The device ordinal whose context made this event. Thread rule: any thread.
        """
        return self._dev.ordinal

    @property
    def handle(self) -> int:
        """The ``CUevent`` as an int.

        Thread rule: any thread.
        """
        return int(self._cu)

    def _enter(self) -> CudaDevice:
        dev = self._dev
        token = dev.token
        if (  # hot path: see CudaStream._enter
            self._epoch == dev.epoch
            and dev.poisoned is None
            and token is not None
            and getattr(tls, "token", None) is token
        ):
            return dev
        if self._epoch != dev.epoch:
            if dev.poisoned is not None:
                raise dev.poisoned_error()
            raise DriverError(
                f"{self!r} belongs to a destroyed context (device {dev.ordinal} was rebuilt or closed)",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        dev.enter()
        return dev

    def query(self) -> bool:
        """Whether the work before the latest record ran (``cuEventQuery``); never blocks.

        Returns:
            True once it ran (or the event was never recorded), else False.
        Raises:
            DriverError: the event's context was rebuilt or closed (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; an allocator's hot path, so it takes no lock.
        """
        dev = self._enter()
        err = as_result(dev.held.event_query(self._h))  # a flag read: the GIL is kept (see .held)
        if err == SUCCESS:
            return True
        if err == NOT_READY:
            return False
        dev.fail(err, "cuEventQuery")

    def synchronize(self) -> None:
        """Block until the work before the latest record ran (``cuEventSynchronize``), spinning
        or yielding as the context's scheduling policy says.

        Raises:
            ContextPoisoned: the device saw a sticky error (perhaps raised by the awaited work).
            DriverError: the event's context was rebuilt or closed (``CUDA_ERROR_INVALID_HANDLE``).
        Thread rule: any thread; blocks the calling thread only.
        """
        dev = self._enter()
        (err,) = cu.cuEventSynchronize(self._cu)
        if err != SUCCESS:
            dev.fail(err, "cuEventSynchronize")

    def __repr__(self) -> str:
        return f"CudaEvent(device={self._dev.ordinal}, epoch={self._epoch})"

    def __del__(self) -> None:
        # No CUDA call here (any thread, perhaps inside one of our locks): the device destroys
        # the handle on its next create_* call, if the context that made it still exists (a
        # rebuild keeps it: the handle of an event of an older epoch is still valid).
        with contextlib.suppress(Exception):  # finalizers must not raise (interpreter exit)
            dev = self._dev
            if self._incarnation == dev.incarnation:
                dev.graveyard.append((self._incarnation, self._epoch, self._cu, None))


class CudaStream:
    """A non-blocking ``CUstream`` of one device's context incarnation.

    Work on it runs in order; ``wait`` orders it after an event without blocking the host.
    After its context is rebuilt or the driver closed, every method but ``close`` raises
    ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``). ``close`` destroys it once its queued work
    is done (``cuStreamDestroy`` semantics) and never blocks. Host buffers of copies in flight
    are kept referenced until those copies ran (see the module docstring).
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_cu",
        "_dev",
        "_epoch",
        "_gate",
        "_handle",
        "_id",
        "_keep",
        "_live",
        "_lock",
        "_spare",
    )

    def __init__(self, dev: CudaDevice, stream: Any, epoch: int) -> None:
        self._dev = dev
        self._cu = stream
        self._handle = int(stream)
        self._id = next(_stream_ids)
        self._epoch = epoch
        self._closed: str | None = None  # why, once closed, invalidated or collected
        # The device's ``epoch_token`` while the stream is usable, None from the moment it is
        # closed, invalidated or collected (set before ``_closed``): the compiled core checks
        # device, epoch and liveness by this one identity.
        self._live: object | None = dev.epoch_token if epoch == dev.epoch else None
        # Held across "is this stream live?" and the CUDA call that uses its handle, and by
        # whoever retires the stream (a rebuild, close): so no thread can slip work onto a
        # stream, or onto memory, that a rebuild is about to free. Taken before ``_lock``,
        # never while waiting for the device lock.
        self._gate = threading.Lock()
        self._lock = threading.Lock()
        self._keep: deque[tuple[Any, object]] = deque()
        self._spare: list[Any] = []

    # -- protocol ---------------------------------------------------------------------------
    @property
    def id(self) -> int:
        """The process-unique stream id, from 1. Thread rule: any thread.
        """
        return self._id

    @property
    def ordinal(self) -> int:
        """The device ordinal whose context made this stream. Thread rule: any thread.
        """
        return self._dev.ordinal

    @property
    def handle(self) -> int:
        """The ``CUstream`` as an int (kept after close, for messages). Thread rule: any thread.
        """
        return self._handle

    def __cuda_stream__(self) -> tuple[int, int]:
        """cuda.core's stream protocol: (version, handle).

        Returns:
            ``(0, handle)``.
        Thread rule: any thread.
        """
        return (0, self._handle)

    def _enter(self) -> CudaDevice:
        dev = self._dev
        token = dev.token
        # Hot path, the checks below and ``dev.enter()`` in one expression: a live stream of a
        # healthy context already current in this thread.
        if (
            self._epoch == dev.epoch
            and self._closed is None
            and dev.poisoned is None
            and token is not None
            and getattr(tls, "token", None) is token
        ):
            return dev
        if self._epoch != dev.epoch or self._closed is not None:
            if dev.poisoned is not None:
                raise dev.poisoned_error()
            raise DriverError(
                f"{self!r} belongs to a destroyed context or was closed "
                f"({self._closed or 'context rebuilt'})",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        dev.enter()
        return dev

    def synchronize(self) -> None:
        """Block until everything enqueued so far ran (``cuStreamSynchronize``), then drop the
        host buffers of the copies that ran.

        Raises:
            DriverError: stream was closed or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; holds the stream's gate across the wait.
        """
        with self._gate:
            dev = self._enter()
            (err,) = cu.cuStreamSynchronize(self._cu)
        if err != SUCCESS:
            dev.fail(err, f"cuStreamSynchronize(stream {self._id})")
        if self._keep:
            with self._lock:
                self._prune_locked()

    def query(self) -> bool:
        """Whether everything enqueued so far ran (``cuStreamQuery``); never blocks.

        Returns:
            True when the stream is idle, else False.
        Raises:
            DriverError: stream was closed or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        with self._gate:
            dev = self._enter()
            (err,) = cu.cuStreamQuery(self._cu)
        if err != SUCCESS and err != NOT_READY:
            dev.fail(err, f"cuStreamQuery(stream {self._id})")
        return bool(err == SUCCESS)

    def record_event(self) -> CudaEvent:
        """A new event (``cuEventCreate`` + ``cuEventRecord``) at the current end of this stream.

        Returns:
            The event, of this stream's device and epoch.
        Raises:
            DriverError: stream was closed or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        if self._dev.graveyard:
            self._enter().bury()  # outside the gate: it takes the device lock
        with self._gate:
            dev = self._enter()
            # Neither call blocks: the GIL is kept (see .held).
            code, handle = dev.held.new_event(EVENT_FLAGS)
            if code:
                dev.fail(as_result(code), "cuEventCreate")
            wrapped = CudaEvent(dev, cu.CUevent(handle), self._epoch, self._live)
            err = as_result(dev.held.event_record(handle, self._handle))
        if err != SUCCESS:
            dev.fail(err, f"cuEventRecord(stream {self._id})")
        return wrapped

    def record(self, event: CudaEvent) -> None:
        """Re-record ``event`` at the current end of this stream (``cuEventRecord``).

        Hot path: the gate is taken with acquire/release, cheaper than ``with``.

        Arguments and result: as ``Stream.record``.
        Raises:
            InvalidRequest: ``event`` is no ``CudaEvent`` of this stream's device.
            DriverError: stream was closed or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        if type(event) is not CudaEvent or event._dev is not self._dev:
            raise InvalidRequest(
                f"{self!r} can only record an event of its own device and driver, got {event!r}"
            )
        gate = self._gate
        gate.acquire()  # acquire/release: cheaper than ``with`` on this hot path
        try:
            dev = self._enter()
            event._enter()
            # It only enqueues: the GIL is kept (see .held).
            err = as_result(dev.held.event_record(event._h, self._handle))
        finally:
            gate.release()
        if err != SUCCESS:
            dev.fail(err, f"cuEventRecord(stream {self._id})")

    def wait(self, event: CudaEvent) -> None:
        """Make later work on this stream wait for ``event`` (``cuStreamWaitEvent``); never
        blocks the host.

        Hot path: the gate is taken with acquire/release, cheaper than ``with``.

        Arguments and result: as ``Stream.wait``.
        Raises:
            InvalidRequest: ``event`` is no ``CudaEvent``.
            DriverError: stream was closed or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        if type(event) is not CudaEvent:
            raise InvalidRequest(f"{self!r} can only wait on a CudaEvent, got {event!r}")
        gate = self._gate
        gate.acquire()
        try:
            dev = self._enter()
            if event._epoch != event._dev.epoch:
                event._enter()  # raises: the event's context is gone
            # It only enqueues: the GIL is kept (see .held).
            err = as_result(dev.held.stream_wait(self._handle, event._h, 0))
        finally:
            gate.release()
        if err != SUCCESS:
            dev.fail(err, f"cuStreamWaitEvent(stream {self._id})")

    def close(self) -> None:
        """Destroy the stream once its queued work is done (``cuStreamDestroy``); never blocks.

        Copies still in flight hand their host buffers to the device, which drops them as their
        events fire. Idempotent; never raises (best effort), and touches no handle of a context
        that is gone.

        Thread rule: any thread; takes the stream's gate, then the device lock.
        """
        with self._gate, self._lock:
            if self._closed is not None:
                return
            self._dev.assign_stamped(self, "_live", None)  # the compiled core's cached verdict ends
            self._closed = "closed"
        dev = self._dev
        with dev.lock:
            dev.streams.discard(self)
            if self._epoch != dev.epoch or dev.token is None:
                return  # its context is gone, and the handles with it
            if not dev.primary_active():
                return  # reset from outside: the handles dangle, and CUDA may crash on them
            with self._lock:
                # The copies that ran let their host buffers go now, in the closing thread: handed
                # to the device, they would be dropped by whichever copy comes next on any of its
                # streams, and freeing pinned memory there (cuMemFreeHost, milliseconds each)
                # stalled the next run's first copy by 20 ms on an H200.
                self._prune_locked()
                keep, self._keep = self._keep, deque()
                spare, self._spare = self._spare, []
            if keep:
                # Copies may still be reading or writing these buffers: the device holds them
                # until their events fire. The stream itself may go now.
                with dev.orphan_lock:
                    dev.orphans.extend(keep)
            with contextlib.suppress(Exception):  # close is best effort and idempotent
                for event in spare:
                    cu.cuEventDestroy(event)
                cu.cuStreamDestroy(self._cu)

    def __repr__(self) -> str:
        return f"CudaStream(device={self._dev.ordinal}, id={self._id}, epoch={self._epoch})"

    def __del__(self) -> None:
        # Like CudaEvent.__del__: hand the handles to the device instead of calling CUDA here.
        # Whoever flips ``_closed`` first (this, close, a rebuild's invalidation) owns the
        # handles' destruction: so a handle is never destroyed twice.
        with contextlib.suppress(Exception):  # finalizers must not raise
            if not self._lock.acquire(blocking=False):
                return  # someone is retiring it right now and will destroy it
            try:
                if self._closed is not None:
                    return
                # Not stamped: the compiled core's cached verdict holds its stream, so a stream
                # being collected is never the one cached (and a finalizer takes no lock).
                self._live = None
                self._closed = "collected"
            finally:
                self._lock.release()
            dev = self._dev
            state = (list(self._keep), list(self._spare))
            dev.graveyard.append((dev.incarnation, self._epoch, self._cu, state))

    # -- driver side ------------------------------------------------------------------------
    def _keep_until_done(self, obj: object) -> None:
        """Reference ``obj`` (a host buffer of the copy just enqueued) until the stream ran
        past this point: an event recorded now marks it. Older entries whose events fired are
        dropped on the way, so the list stays as long as the copies in flight."""
        dev = self._dev
        with self._lock:
            event = self._spare.pop() if self._spare else None
        if event is None:
            err, event = cu.cuEventCreate(EVENT_FLAGS)
            if err != SUCCESS:
                dev.fail(err, "cuEventCreate")
        err = as_result(dev.held.event_record(int(event), self._handle))  # only enqueues: see .held
        if err != SUCCESS:
            # Without a marker we cannot know when the copy ran: wait for it instead.
            cu.cuEventDestroy(event)
            cu.cuStreamSynchronize(self._cu)
            dev.fail(err, f"cuEventRecord(stream {self._id})")
        with self._lock:
            self._keep.append((event, obj))
            self._prune_locked()
        if dev.orphans:
            dev.drop_orphans(destroy=True)

    def _prune_locked(self) -> None:
        keep = self._keep
        query = self._dev.held.event_query
        while keep:
            event = keep[0][0]
            if query(int(event)) != 0:
                break  # not yet (or a sticky error: keep everything, nothing runs any more)
            keep.popleft()
            if len(self._spare) < _SPARE_EVENTS:
                self._spare.append(event)
            else:
                cu.cuEventDestroy(event)

    def _invalidate(self, reason: str) -> bool:
        """Under the device lock, on rebuild or close: the stream is dead from now on. Waits for
        an enqueue in flight on it (the gate); True when this call retired it (its handles are
        then the caller's to destroy), False when it was already closed or collected."""
        with self._gate, self._lock:
            if self._closed is None:
                self._dev.assign_stamped(self, "_live", None)  # the compiled core's cached verdict ends
                self._closed = reason
                return True
            return False

    def _destroy_handles(self) -> None:
        """Destroy the stream and its events while their context still exists (after a context
        synchronize, so no copy still uses a kept buffer). Errors are ignored: the context is
        about to go anyway."""
        with self._lock:
            keep, self._keep = self._keep, deque()
            spare, self._spare = self._spare, []
        with contextlib.suppress(Exception):  # best effort
            for event, _obj in keep:
                cu.cuEventDestroy(event)
            for event in spare:
                cu.cuEventDestroy(event)
            cu.cuStreamDestroy(self._cu)

