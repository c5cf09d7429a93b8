"""``IsolatedDevice``: the parent's proxy actor of a device that lives in its own process.

``DeviceActor.start(ordinal, ..., isolate=True)`` starts one. Its ``ActorRef`` stays valid across
child restarts. It forwards ``Allocate``, ``AllocateMany``, ``Free``, ``GetStats`` and ``Rebuild``
to the child (and the ``ChildFault`` test hook), and the work of the device's parent-side library
actors (``LibraryWork``, its handles mapped to the child's by :func:`._library.to_child`);
``Subscribe``/``Unsubscribe`` live in the parent.

Invariants:

* **Pipelined asks.** The proxy's thread only pickles and sends an ask, registered under a request
  id with its asker's future; a reader thread per child resolves the futures as replies arrive.
  Many asks are in flight at once. The frees of dropped handles queued before an ask ride in its
  frame (the child frees them before it serves the ask).
* **The fast path** (issue #18). An ``Allocate`` is sent from the asker's own thread when nothing
  is queued before it in the proxy's inbox and the proxy is idle (``CallerServedInbox`` says why each
  sender's order is kept); the child's frame reader serves it itself when its device actor is
  quiet (``_child``). On machines of four cores or more (``hot_waits.spin_budget``) the reader
  spins on the pipe while a reply is due and the asker on its ``SpinningFuture`` before either
  sleeps.
* **The call lane** (``CALL_LANE``; ``_core.call_lane``). Where the waits spin, that ``Allocate``
  is posted in a slot of memory the child maps, with the frees queued before it and the count of
  frames sent before it; the asker spins for the answer in the slot and makes the handle itself.
  An answer that does not fit a slot (an error, a busy device actor, an asker that stopped
  waiting) comes on the pipe under the request's id, as any ask's. A child's death marks its
  lane dead, which ends every asker's wait there.
* **The parent holds the generation.** Each child process has its own ``DeviceState`` in the
  parent, starting where the previous child's generation ended, plus one: a child's own rebuild
  bumps it, its death bumps it (``"context rebuilt"``) or poisons it (``"context poisoned"``,
  when the child reported a sticky error or exited with ``EXIT_POISONED``). Handles validate
  against it on every ``access()``.
* **Every asker is answered.** When a child dies, every ask sent to it and not answered gets a
  typed error (``GpuRefStale("context poisoned")`` after a sticky error, ``DeviceUnavailable``
  otherwise), at once, from the reader thread. Asks that arrive afterwards are served by the next
  child.
* **Restarts** go through the ``Supervisor``'s restart intensity (per ordinal); past it the device
  stops for good as an in-process one does. A booted child is kept in reserve so that a restart
  does not wait for an interpreter to start and import.
* Frees of dropped parent handles go to the child they came from, batched, and never to a newer
  one (see :mod:`._remote`).

Thread rules: handlers run on the proxy's thread; each child's reader thread resolves futures,
marks the child's state and tells the proxy what happened. A child's ``pending`` table and its
current context change under its lock.

Past 400 lines: the child record and the proxy share the restart protocol (the reader thread
marks a death, the proxy restarts), and each needs the other's half in view.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

from ..._core import call_lane as lanes
from ..._core.call_lane import CallLane
from ..._core.doorbell import Doorbell
from ...driver.open import DRIVER_KINDS, env_driver_kind
from ...driver.shared_memory import SharedSegment, segment_name, unlink_segments_of
from ...errors import CorruptionDetected, DeviceUnavailable, DriverError, GpuRefStale, InvalidRequest, XlogError
from ...memory.block import AllocTag, StreamId
from ...memory.stack import check_description, default_description
from .. import messages as m
from ..caller_inbox import CallerServedInbox
from ..device_state import DeviceState
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, INBOX_SPIN_S, SpinningFuture, spin_budget
from ..pykka_internals import ResilientActor
from ..subscribers import tell_subscribers
from ..supervisor import EXIT_POISONED, Supervisor, checked_supervisor, stop_device
from ._library import to_child
from ._protocol import (
    Channel,
    ChildFault,
    ExportBlock,
    ExportHandle,
    FreeBlock,
    LibraryStop,
    LibraryWork,
    RemoteBlock,
    block_of,
    child_entry,
    decode_error,
)
from ._remote import RemoteContext, RemoteDriverFace

__all__ = [
    "CALL_LANE", "READY_TIMEOUT_S", "RING_AFTER_RELEASE", "ChildTimeline", "IsolatedDevice", "start_isolated",
]

#: Whether the reply reader rings an answered asker's ``SpinningFuture`` only once it released
#: the GIL (``_read``), rather than as it sets the reply. ``scripts/isolated_anatomy.py`` sets it
#: both ways to measure it (docs/performance.md, "Isolated Allocate round trip").
RING_AFTER_RELEASE = True

#: Whether a child's allocations go through its call lane (``_core.call_lane``): None (the
#: default) where the waits spin (``hot_waits.spin_budget``: four cores or more; with fewer, every
#: request would wake the sleeping child with a frame anyway, which the pipe path already does),
#: or True/False to force it (tests run it on two cores; ``scripts/isolated_anatomy.py``
#: measures both ways). Read when a child is launched.
CALL_LANE: bool | None = None
#: How long an asker waits for the child to claim its call-lane request when nothing spins
#: (``CALL_LANE`` forced on a small machine) before it leaves the answer to the pipe.
_LANE_MIN_SPIN_S = 0.005

logger = logging.getLogger(__name__)

#: How long a child may take from its configuration to serving (a first CUDA initialisation
#: takes seconds); past it the child is killed and the start or restart fails.
READY_TIMEOUT_S = 60.0
#: How long ``stop()`` waits for a child to end by itself before it kills it.
_STOP_TIMEOUT_S = 10.0
_CHILD_MODULE = "xlog_actors.actors.isolated._child"
_SPAWN = multiprocessing.get_context("spawn")

_FORWARDED = (
    m.Allocate, m.AllocateMany, m.Free, m.GetStats, m.Rebuild, ChildFault, ExportHandle, LibraryWork, LibraryStop,
)
_SERVED = "Allocate, AllocateMany, Free, GetStats, Rebuild, Subscribe or Unsubscribe"

_registry_lock = threading.Lock()
_registry: dict[tuple[str, int], str] = {}


@dataclass(frozen=True, slots=True)
class ChildTimeline:
    """Diagnostics: asked of an isolated device, the ``time.monotonic()`` marks of its serving
    child's start (what the restart bench breaks down).

    Reply: a dict: ``pid`` (the child's process id), ``spawned`` (the process started),
    ``booted`` (interpreter up, imports done), ``configured`` (the parent handed it the
    device), ``driver_open``, ``ready``; and, when it replaced a child, ``previous_poisoned``
    (when the parent heard of the sticky error met in the previous child, or None) and
    ``previous_exit_seen`` (the parent saw that child's pipe end).
    """


@dataclass(frozen=True, slots=True)
class _ChildExited:
    child: _Child


@dataclass(frozen=True, slots=True)
class _ChildStopped:
    child: _Child


@dataclass(frozen=True, slots=True)
class _Notify:
    message: m.GenerationChanged


@dataclass(frozen=True, slots=True)
class _Flush:
    pass


class _Process:
    """A spawned child process and the parent's end of its pipe."""

    def __init__(self, ordinal: int) -> None:
        parent_end, child_end = _SPAWN.Pipe()
        self.process = _SPAWN.Process(
            target=child_entry, args=(child_end, _CHILD_MODULE), name=f"xlog-device-{ordinal}", daemon=True
        )
        self.spawned = time.monotonic()
        self.process.start()
        child_end.close()  # the child's death must end the parent's reads
        self.channel = Channel(parent_end)

    def discard(self) -> None:
        """End a reserve that was never configured: it holds no driver, so it is killed."""
        self.process.kill()
        self.process.join()
        self.channel.close()

    def end(self, timeout: float) -> int | None:
        """Ask the process to stop, wait ``timeout`` s, then kill it; its exit code."""
        try:
            self.channel.send(("stop",))
        except (OSError, ValueError):
            pass  # already gone
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.channel.close()
        return self.process.exitcode


class _Child:
    """One serving child process, its requests in flight and its generations, in the parent."""

    def __init__(
        self, proc: _Process, owner: str, ordinal: int, kind: str, generation: int, restarts: int,
        lane: tuple[SharedSegment, CallLane] | None = None,
    ) -> None:
        self.proc = proc
        self.lane_segment: SharedSegment | None = None if lane is None else lane[0]
        self.lane: CallLane | None = None if lane is None else lane[1]
        #: Diagnostics: the allocations answered in the lane (tests and the anatomy script).
        self.lane_answers = 0
        self.lane_spin = spin_budget(FUTURE_SPIN_S) or _LANE_MIN_SPIN_S
        self.owner = owner
        self.ordinal = ordinal
        self.base = generation
        self.restarts = restarts
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[pykka.Future[Any] | None, Any]] = {}
        self.ids = itertools.count(1)
        self.alive = True
        self.stopping = False
        self.poisoned: BaseException | None = None
        self.poisoned_at: float | None = None
        self.next_generation = generation + 1
        self.timeline: dict[str, Any] = {}
        self.state = DeviceState(ordinal, generation)
        self.frees: deque[tuple[int, int]] = deque()
        self.face = RemoteDriverFace(kind)
        self.wake: Callable[[], None] = lambda: None
        self.ctx = self._context(0, self.state.token)
        self.reader: threading.Thread | None = None

    def _context(self, child_generation: int, token: object) -> RemoteContext:
        return RemoteContext(
            self.owner, self.state, self.base + child_generation, token, child_generation, self.frees,
            self.wake, self.face,
        )

    def start_reader(self, on_exit: Callable[[_Child], None], tell: Callable[[Any], None]) -> None:
        self.reader = threading.Thread(
            target=self._read, args=(on_exit, tell), name=f"xlog-device-{self.ordinal}-reader", daemon=True
        )
        self.reader.start()

    # -- the proxy's side ---------------------------------------------------------------------
    def send_ask(self, payload: Any, future: pykka.Future[Any] | None, message: Any) -> bool:
        """Send one ask, with the frees queued before it in the same frame (one write, one
        read in the child, which frees them first); False when the child is known dead (nothing
        was sent)."""
        with self.lock:
            if not self.alive:
                return False
            rid = next(self.ids)
            self.pending[rid] = (future, message)
        frees = self._take_frees()
        try:
            self.proc.channel.send(("ask", rid, payload, frees))
        except InvalidRequest as exc:  # (before ValueError, its base) it cannot be pickled: nothing sent
            with self.lock:
                self.pending.pop(rid, None)
            self._send_frees(frees)  # they were taken for this frame: they still go
            what = type(getattr(message, "message", message)).__name__
            raise InvalidRequest(
                f"isolated device {self.ordinal}: {what} cannot cross to the device process (it must "
                f"pickle; a kernel's host implementation must be a module-level function): {exc}"
            ) from None
        except (OSError, ValueError):
            pass  # the child died: the reader answers this ask with the death's error
        return True

    def call_lane(self, message: m.Allocate, future: pykka.Future[Any]) -> bool:
        """Serve an asked ``Allocate`` through the call lane from the asker's thread: post it
        (with the frees queued before it), spin for the child's answer and set ``future``; or,
        when the child answers on the pipe instead (an error, a busy device actor, an asker that
        stopped waiting), leave ``future`` to the reader. False when the message does not fit
        the lane or no slot is free: nothing was sent, the pipe path takes it.
        Thread rule: the asker's thread (the proxy idle)."""
        lane = self.lane
        nbytes, stream, tag = message.nbytes, message.stream, message.tag
        if (lane is None or message.origin is not None or type(nbytes) is not int or not 0 < nbytes < 1 << 63
                or type(stream) is not StreamId or type(tag) is not AllocTag):
            return False
        tag_bytes = tag.encode()
        if len(tag_bytes) > lanes.MAX_TAG:
            return False
        slot = lane.claim()
        if slot < 0:
            return False
        with self.lock:
            if not self.alive:
                lane.release(slot, False)
                return False
            rid = next(self.ids)
            self.pending[rid] = (future, message)
        frees = self._take_frees()
        if frees is not None and len(frees[1]) > lanes.MAX_FREES:
            self._send_frees(frees)  # ahead in the pipe: the request is served after it
            frees = None
        channel = self.proc.channel
        generation, ptrs = frees if frees is not None else (0, [])
        try:
            asleep = lane.post(slot, rid, channel.sent, nbytes, int(stream), tag_bytes, generation, ptrs)
        except (ValueError, OverflowError):  # a field out of a slot's range: the pipe takes it
            with self.lock:
                self.pending.pop(rid, None)
            lane.release(slot, False)
            self._send_frees(frees)
            return False
        if asleep:
            try:
                channel.send(("wake",))
            except (OSError, ValueError):
                pass  # the child died: the reader marks the lane dead
        state = lane.wait_reply(slot, self.lane_spin)
        if state != lanes.DONE:
            lane.release(slot, state == lanes.PIPED)
            return True  # the reader answers it: the pipe's reply, or the child's death
        ptr, size, align, alloc_stream, block_generation, state_index, ref_generation = lane.reply(slot)
        self.lane_answers += 1
        with self.lock:
            entry = self.pending.pop(rid, None)
        if entry is not None:  # else the child died meanwhile and its asker heard of it
            block = block_of(ptr, self.ordinal, alloc_stream, size, align, tag, block_generation, state_index)
            future.set(GpuRef._new(block, self.context_for(ref_generation)))  # type: ignore[arg-type]
        return True

    def flush_frees(self) -> None:
        """Send the frees of dropped handles of the current generation in a frame of their own."""
        self._send_frees(self._take_frees())

    def _take_frees(self) -> tuple[int, list[int]] | None:
        """Empty the free queue: ``(child generation, addresses)`` of the current generation, or
        None when none is (older ones went with their context)."""
        frees = self.frees
        if not frees:
            return None
        current = self.ctx.child_generation
        ptrs = []
        while frees:
            generation, ptr = frees.popleft()
            if generation == current:
                ptrs.append(ptr)
        return (current, ptrs) if ptrs else None

    def _send_frees(self, frees: tuple[int, list[int]] | None) -> None:
        if frees is not None:
            try:
                self.proc.channel.send(("free", *frees))
            except (OSError, ValueError):
                pass  # the child is gone, and its memory with it

    # -- the reader's side ----------------------------------------------------------------------
    def context_for(self, child_generation: int) -> RemoteContext:
        """The context of the child's ``child_generation``, advancing to it when it is newer."""
        with self.lock:
            ctx = self.ctx
            if child_generation == ctx.child_generation:
                return ctx
            if child_generation > ctx.child_generation and self.alive:
                ctx.open = False
                while self.state.generation < self.base + child_generation:
                    self.state.bump_generation()
                self.ctx = self._context(child_generation, self.state.token)
                return self.ctx
        stale = self._context(child_generation, object())  # replaced already: stale from birth
        stale.open = False
        return stale

    def _read(self, on_exit: Callable[[_Child], None], tell: Callable[[Any], None]) -> None:
        channel = self.proc.channel
        spin, idle_spin = spin_budget(FUTURE_SPIN_S), spin_budget(INBOX_SPIN_S)
        bell: Doorbell | None = None  # of the asker answered last, rung once the GIL is let go
        while True:
            try:
                # A reply is due: look for it a while before sleeping. Else look a shorter while:
                # an asker answered just now sends its next ask a few µs later, and a reader that
                # went to sleep in between would be woken for that reply (tens of µs on a VM).
                if spin:
                    channel.spin(spin if self.pending else idle_spin, bell)
                elif bell is not None:
                    bell.ring()
                bell = None
                frame = channel.recv()
            except (EOFError, OSError):
                break
            try:
                bell = self._serve_frame(frame, tell)
            except Exception as exc:  # this thread must go on reading frames
                logger.error("isolated device %d: a frame from the child failed: %r", self.ordinal, exc, exc_info=exc)
        if bell is not None:
            bell.ring()
        self._died()
        if not self.stopping:
            on_exit(self)

    def _serve_frame(self, frame: tuple[Any, ...], tell: Callable[[Any], None]) -> Doorbell | None:
        """Serve one frame of the child; the bell of an asker it answered, for the caller to ring."""
        kind = frame[0]
        if kind == "reply":
            return self._resolve(frame[1], frame[2], frame[3])
        if kind == "generation":
            _, generation, status = frame
            if status == "running":
                self.context_for(generation)
                tell(_Notify(m.GenerationChanged(self.ordinal, self.base + generation, status)))
            elif status == "stopped":
                tell(_ChildStopped(self))
        elif kind == "poisoned":
            self.poisoned_at = time.monotonic()
            self.poisoned = decode_error(frame[1])
        return None

    def _resolve(self, rid: int, ok: bool, value: Any) -> Doorbell | None:
        """Answer the asker of ``rid``; a ``SpinningFuture``'s bell is returned unrung (the reader
        rings it once it let go of the GIL: see ``_read``), any other reply is set as usual."""
        with self.lock:
            entry = self.pending.pop(rid, None)
        if entry is None:
            return None
        future, message = entry
        error: BaseException | None = None
        if ok:
            try:
                value = self._decode(message, value)
            except Exception as exc:  # noqa: BLE001 - the asker's answer
                error = exc
        else:
            try:
                error = decode_error(value)
            except Exception as exc:  # noqa: BLE001 - the asker is answered whatever came
                error = DriverError(f"isolated device {self.ordinal}: the child's error could not be read: {exc!r}")
            if isinstance(message, m.Free) and not isinstance(error, CorruptionDetected):
                message.ref._unmark_released()  # the child kept the block: the handle stays usable
        if future is None:
            return None  # told: the value (a handle, say) is dropped, and freed
        exc_info = None if error is None else (type(error), error, None)
        if RING_AFTER_RELEASE and type(future) is SpinningFuture:
            return future.fill(value, exc_info)
        if exc_info is None:
            future.set(value)
        else:
            future.set_exception(exc_info)
        return None

    def _decode(self, message: Any, value: Any) -> Any:
        if isinstance(value, RemoteBlock):
            return GpuRef._new(value.block, self.context_for(value.generation))  # type: ignore[arg-type]
        if isinstance(message, m.AllocateMany):
            return [GpuRef._new(r.block, self.context_for(r.generation)) for r in value]  # type: ignore[arg-type]
        if isinstance(message, m.Rebuild):
            return self.context_for(value).generation
        if isinstance(message, m.GetStats):
            return dataclasses.replace(
                value, generation=self.base + value.generation, restarts=self.restarts + value.restarts
            )
        return value

    def _died(self) -> None:
        self.proc.process.join(5.0)  # its pipe ended: the exit follows at once
        code = self.proc.process.exitcode
        if code is not None and self.proc.process.pid is not None:
            # A killed child cannot unlink its shared device memory; importers keep their maps.
            unlink_segments_of(self.proc.process.pid)
        seen = time.monotonic()
        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
            self.ctx.open = False
            self.frees.clear()
        if self.lane is not None:
            self.lane.mark_dead()  # an asker spinning on its slot stops: its future is answered below
            assert self.lane_segment is not None
            self.lane_segment.close()  # the name only: the lane's view keeps the mapping
        self.timeline["exit_seen"] = seen
        poisoned = self.poisoned is not None or code == EXIT_POISONED
        where = f"device {self.ordinal}, generation {self.state.generation}, process {self.proc.process.pid}"
        error_type: type[XlogError] = DeviceUnavailable
        if self.stopping:
            text = f"{where}: the device was stopped"
        elif poisoned:
            self.state.poison()
            self.next_generation = self.state.generation + 1
            error_type, text = GpuRefStale, f"{where} exited with code {code} after {self.poisoned!r}"
        else:
            self.next_generation = self.state.bump_generation()
            text = f"{where} ended (exit code {code}) with the request in flight; a new process is started"
        self.proc.channel.close()
        for future, _message in pending.values():
            if future is not None:  # one fresh error per asker: each raise adds its own traceback
                error = GpuRefStale("context poisoned", text) if error_type is GpuRefStale else DeviceUnavailable(text)
                future.set_exception((type(error), error, None))


class IsolatedDevice(ResilientActor):
    """The parent's proxy of a device served by its own child process; see the module docstring.

    Made by ``DeviceActor.start(ordinal, ..., isolate=True)``, which returns its ``ActorRef``.

    Thread rule: as any pykka actor; ask or tell it from any thread.
    """

    def __init__(
        self,
        ordinal: int,
        kind: str | None,
        resource: str | Callable[..., Any] | None,
        supervisor: Supervisor,
        ipc_pool: bool = False,
    ) -> None:
        """Start the first child and wait until it serves.

        Args:
            ordinal: the device ordinal in the child's driver.
            kind: the child's driver kind, or None for ``XLOG_ACTORS_DRIVER`` (else ``"auto"``).
            resource: a stack description, a picklable factory, or None (the child's default).
            supervisor: the restart intensity (its ``max_restarts``/``within_s`` also bound the
                child's in-process rebuilds).
            ipc_pool: a CUDA child opens ``CudaDriver(ipc_pool=True)`` (see ``start_isolated``).
        Raises:
            InvalidRequest, DeviceUnavailable: as the child met them (a bad ordinal, no driver);
                nothing is left running.
        Thread rule: the caller's thread (``start`` runs it there).
        """
        super().__init__()
        self._ordinal = ordinal
        self._kind = kind
        self._ipc_pool = ipc_pool
        self._resource = resource
        self._supervisor = supervisor
        self._subscribers: list[pykka.ActorRef[Any]] = []
        self._restarts = 0
        self._stopped: DeviceUnavailable | None = None
        self._last_generation = 0
        self._spare: _Process | None = None
        self._key = (kind or "auto", ordinal)
        with _registry_lock:
            if self._key in _registry:
                raise InvalidRequest(
                    f"device {ordinal} of the {self._key[0]} driver already has an isolated DeviceActor "
                    f"({_registry[self._key]}); one actor owns each ordinal"
                )
            _registry[self._key] = self.actor_urn
        try:
            self._child: _Child = self._launch(0, _Process(ordinal))
        except BaseException:
            self._unregister()
            raise

    def __repr__(self) -> str:
        return f"IsolatedDevice(device={self._ordinal}, driver={self._kind or 'auto'})"

    # -- pykka hooks ------------------------------------------------------------------------------
    @staticmethod
    def _create_actor_inbox() -> CallerServedInbox:
        return CallerServedInbox()

    @staticmethod
    def _create_future() -> SpinningFuture:
        # pykka's hook, for ``ask``: the asker spins a while for the reader's answer before it
        # sleeps (hot_waits; nothing spins on a machine of fewer than four cores).
        return SpinningFuture(spin_budget(FUTURE_SPIN_S))

    def on_start(self) -> None:
        """Boot the reserve child, and let askers send allocations to the child directly (see
        ``CallerServedInbox``). Thread rule: the proxy's thread (pykka calls it)."""
        self._spare = _Process(self._ordinal)
        self._inbox().serve_in_caller((m.Allocate,), self._send_direct)

    def _inbox(self) -> CallerServedInbox:
        inbox = self.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        return inbox

    def _send_direct(self, envelope: Any) -> Any:
        """Send ``envelope``'s ``Allocate`` to the serving child from the asker's thread: None
        once sent, or ``envelope`` when the proxy must take it (no serving child, stopped).
        Called by ``CallerServedInbox.put`` while the proxy is idle; a restart the proxy starts
        meanwhile marks the child dead, and an ask that reaches a dying child is answered with
        its death, as on the proxy's path."""
        if self._stopped is not None:
            return envelope
        child = self._child
        if not child.alive or child.stopping:
            return envelope
        try:
            if child.lane is not None and child.call_lane(envelope.message, envelope.reply_to):
                return None
            sent = child.send_ask(envelope.message, envelope.reply_to, envelope.message)
        except Exception:  # noqa: BLE001 - the proxy's own path raises it to the asker
            return envelope
        return None if sent else envelope

    def on_stop(self) -> None:
        """Stop the child (killed if it does not end in 10 s) and the reserve; every handle is
        ``"device shutting down"``. Thread rule: the proxy's thread (pykka calls it)."""
        self._inbox().serve_in_caller((), None)
        try:
            child = self._child
            child.stopping = True
            child.state.begin_shutdown()
            child.proc.end(_STOP_TIMEOUT_S)
            if child.reader is not None:
                child.reader.join(_STOP_TIMEOUT_S)
            if self._spare is not None:
                self._spare.discard()
                self._spare = None
        finally:
            self._unregister()

    def on_receive(self, message: Any) -> Any:
        """Serve the messages answered in the parent. Thread rule: the proxy's thread.

        Raises:
            InvalidRequest: a message an isolated device does not serve, or a malformed one.
        """
        if isinstance(message, (m.Subscribe, m.Unsubscribe)):
            m.check_actor_ref(message)
            if isinstance(message, m.Subscribe) and message.actor_ref not in self._subscribers:
                self._subscribers.append(message.actor_ref)
            elif isinstance(message, m.Unsubscribe) and message.actor_ref in self._subscribers:
                self._subscribers.remove(message.actor_ref)
            return None
        if isinstance(message, _ChildExited):
            self._restart(message.child)
        elif isinstance(message, _ChildStopped):
            if message.child is self._child:
                self._stop_for_good(f"the device in process {message.child.proc.process.pid} stopped for good")
        elif isinstance(message, _Notify):
            self._notify(message.message)
        elif isinstance(message, _Flush):
            self._child.flush_frees()
        elif isinstance(message, ChildTimeline):
            return dict(self._child.timeline)
        else:
            raise InvalidRequest(
                f"an isolated DeviceActor {self._ordinal} does not serve {type(message).__name__} messages; "
                f"expected {_SERVED}"
            )
        return None

    def _handle_envelope(self, envelope: Any, receive: Callable[[Any], Any] | None = None) -> None:
        # Forwarded asks are not answered here: the child's reply, read by the reader thread,
        # sets the asker's future, so this thread goes on to the next ask at once.
        if type(envelope.message) not in _FORWARDED:
            super()._handle_envelope(envelope, receive)
            return
        try:
            self._forward(envelope.message, envelope.reply_to)
        except Exception as error:  # noqa: BLE001 - the asker's answer, or on_told_failure's
            self._answer_failure(envelope, error, sys.exc_info())

    # -- forwarding -------------------------------------------------------------------------------
    def _forward(self, message: Any, future: pykka.Future[Any] | None) -> None:
        for _ in range(2):  # a child found dead here is replaced, and the ask goes to the new one
            child = self._serving()
            if child is None:
                if isinstance(message, m.GetStats):
                    self._answer(future, self._stopped_stats())
                    return
                if isinstance(message, LibraryStop):
                    self._answer(future, None)  # the child, and its library actors, are gone
                    return
                assert self._stopped is not None
                raise DeviceUnavailable(str(self._stopped))
            payload: Any = message
            if isinstance(message, m.Free):
                payload = self._free_payload(message, child)
                if payload is None:
                    self._answer(future, None)
                    return
            elif isinstance(message, ExportHandle):
                payload = self._export_payload(message, child)
            elif isinstance(message, LibraryWork):
                payload = dataclasses.replace(
                    message, message=to_child(message.message, self.actor_urn, child.ctx, self._ordinal)
                )
            if child.send_ask(payload, future, message):
                return
            self._restart(child)
        raise DeviceUnavailable(f"isolated device {self._ordinal}: no child process could take the request")

    @staticmethod
    def _answer(future: pykka.Future[Any] | None, value: Any) -> None:
        if future is not None:
            future.set(value)

    def _free_payload(self, message: m.Free, child: _Child) -> FreeBlock | None:
        ref = message.ref
        if not isinstance(ref, GpuRef):
            raise InvalidRequest(f"Free.ref must be a GpuRef, got {type(ref).__name__}")
        m.check_origin(message)
        ctx = ref.context
        if not isinstance(ctx, RemoteContext) or ctx.owner != self.actor_urn:
            raise InvalidRequest(
                f"Free: {ref!r} belongs to another device actor, not to isolated device {self._ordinal}"
            )
        if not ctx.is_current() or ctx is not child.ctx:
            ref._mark_released()  # an older generation or child: its memory went with it
            return None
        if not ref._mark_released():
            return None
        return FreeBlock(ref.block.ptr, ctx.child_generation)

    def _export_payload(self, message: ExportHandle, child: _Child) -> ExportBlock:
        ref = message.ref
        ctx = ref.context
        if not isinstance(ctx, RemoteContext) or ctx.owner != self.actor_urn:
            raise InvalidRequest(
                f"export: {ref!r} belongs to another device actor, not to isolated device {self._ordinal}"
            )
        if not ctx.is_current() or ctx is not child.ctx:
            raise GpuRefStale("context rebuilt", f"{ref!r}: its process or generation was replaced")
        return ExportBlock(ref.block.ptr, ctx.child_generation)

    # -- children ---------------------------------------------------------------------------------
    def _serving(self) -> _Child | None:
        """The serving child, replacing a dead one first; None once stopped for good."""
        if self._stopped is None and not self._child.alive:
            self._restart(self._child)
        return None if self._stopped is not None else self._child

    def _launch(self, generation: int, proc: _Process) -> _Child:
        """Hand ``proc`` the device and wait until it serves."""
        configured = time.monotonic()
        supervisor = self._supervisor
        lane: tuple[SharedSegment, CallLane] | None = None
        try:
            if CALL_LANE or (CALL_LANE is None and spin_budget(FUTURE_SPIN_S) > 0):
                segment = SharedSegment.create(segment_name("lane", self._ordinal), lanes.SIZE)
                lane = (segment, CallLane(segment.mm))
            proc.channel.send(
                ("config", self._ordinal, self._kind, self._resource, supervisor.max_restarts, supervisor.within_s,
                 self._ipc_pool, None if lane is None else lane[0].name)
            )
            booted, frame = self._await_ready(proc)
        except BaseException:
            proc.end(0.0)
            if lane is not None:
                lane[0].close()
            raise
        child = _Child(proc, self.actor_urn, self._ordinal, self._kind or "auto", generation, self._restarts, lane)
        child.timeline.update(
            pid=proc.process.pid, spawned=proc.spawned, booted=booted, configured=configured,
            driver_open=frame[1], ready=frame[2],
        )
        me = self.actor_ref

        def tell(message: Any) -> None:
            try:
                me.tell(message)
            except pykka.ActorDeadError:
                pass  # the proxy stopped meanwhile

        child.wake = lambda: tell(_Flush())
        child.ctx = child._context(0, child.state.token)
        child.start_reader(lambda c: tell(_ChildExited(c)), tell)
        self._last_generation = generation
        return child

    def _await_ready(self, proc: _Process) -> tuple[float | None, tuple[Any, ...]]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        booted: float | None = None
        where = f"isolated device {self._ordinal}: process {proc.process.pid}"
        while True:
            if not proc.channel.poll(max(0.0, deadline - time.monotonic())):
                raise DeviceUnavailable(f"{where} did not serve within {READY_TIMEOUT_S} s")
            try:
                frame = proc.channel.recv()
            except (EOFError, OSError):
                proc.process.join(5.0)
                raise DeviceUnavailable(
                    f"{where} exited with code {proc.process.exitcode} before it served"
                ) from None
            if frame[0] == "booted":
                booted = frame[1]
            elif frame[0] == "ready":
                return booted, frame
            elif frame[0] == "failed":
                raise decode_error(frame[1])

    def _restart(self, dead: _Child) -> None:
        """Replace ``dead`` if it is still the serving child (once per death)."""
        if dead is not self._child or self._stopped is not None:
            return
        if dead.reader is not None:
            dead.reader.join(_STOP_TIMEOUT_S)  # its death is marked and its askers answered
        generation = dead.next_generation
        while True:
            if not self._supervisor.allow_restart(self._ordinal):
                self._stop_for_good(f"restart intensity exceeded; the last process ended: {dead.poisoned!r}")
                return
            self._restarts += 1
            proc, self._spare = self._spare or _Process(self._ordinal), None
            try:
                child = self._launch(generation, proc)
            except Exception as exc:  # noqa: BLE001 - counted; the next attempt follows
                logger.error("isolated device %d: a new process failed: %r", self._ordinal, exc)
                continue
            break
        child.timeline.update(previous_poisoned=dead.poisoned_at, previous_exit_seen=dead.timeline.get("exit_seen"))
        self._child = child
        logger.warning(
            "isolated device %d: process %s ended; process %s serves generation %d",
            self._ordinal, dead.proc.process.pid, child.proc.process.pid, generation,
        )
        self._notify(m.GenerationChanged(self._ordinal, generation, "running"))
        self._spare = _Process(self._ordinal)

    def _stop_for_good(self, reason: str) -> None:
        if self._stopped is not None:
            return
        logger.error("isolated device %d: stopped for good: %s", self._ordinal, reason)
        self._stopped = DeviceUnavailable(f"isolated device {self._ordinal} was stopped for good: {reason}")
        child = self._child
        child.state.begin_shutdown()
        if child.alive:
            child.stopping = True
            child.proc.end(_STOP_TIMEOUT_S)
        if self._spare is not None:
            self._spare.discard()
            self._spare = None
        self._notify(m.GenerationChanged(self._ordinal, child.state.generation, "stopped"))

    def _stopped_stats(self) -> m.DeviceStats:
        return m.DeviceStats(
            device_id=self._ordinal, generation=self._child.state.generation, bytes_outstanding=0, live_blocks=0,
            restarts=self._restarts, status="stopped", driver=self._kind or "auto", stack="",
        )

    def _notify(self, message: m.GenerationChanged) -> None:
        self._subscribers = tell_subscribers(self._subscribers, message)

    def _unregister(self) -> None:
        with _registry_lock:
            if _registry.get(self._key) == self.actor_urn:
                del _registry[self._key]


def start_isolated(
    ordinal: object = 0,
    driver: object = None,
    resource: object = None,
    supervisor: object = None,
    *,
    ipc_pool: object = False,
) -> pykka.ActorRef[Any]:
    """``DeviceActor.start(..., isolate=True)``: check the configuration, start the proxy and
    its first child, and return the proxy's ``ActorRef`` once the child serves.

    Args:
        ordinal: the device ordinal (an int >= 0; the child checks it against its driver).
        driver: a kind, ``"auto"``, ``"cuda"`` or ``"host"``, or None (the child follows
            ``XLOG_ACTORS_DRIVER`` as ``open_driver`` does). A driver object cannot cross to a
            child process.
        resource: a stack description, a picklable factory, or None.
        supervisor: a ``Supervisor`` without an ``on_poisoned`` hook of its own (a poisoned
            child always ends and is replaced), or None for the defaults.
        ipc_pool: True: a child on the CUDA driver opens ``CudaDriver(ipc_pool=True)``, so the
            blocks of its ``async`` stack come from an IPC-capable pool and its handles open in
            other processes through ``cuMemPoolImportPointer`` (without it only the ``direct``
            stack's blocks cross, through legacy ``cuIpc*``). A host-driver child's memory is
            shared memory either way, so there it changes nothing.
    Returns:
        the proxy's ``ActorRef``.
    Raises:
        InvalidRequest: a bad argument, or the ordinal already has an isolated device of that
            driver kind; nothing is left running.
        DeviceUnavailable: the child could not open its driver or device.
    Thread rule: any thread.
    """
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        raise InvalidRequest(f"ordinal must be a non-negative int, got {ordinal!r}")
    if type(ipc_pool) is not bool:
        raise InvalidRequest(f"ipc_pool must be a bool, got {ipc_pool!r}")
    if driver is not None and driver not in DRIVER_KINDS:
        raise InvalidRequest(
            f"with isolate=True, driver must be a kind, one of {DRIVER_KINDS}, or None (the child opens "
            f"its own driver), got {driver!r}"
        )
    if driver is None:
        env_driver_kind()  # a bad XLOG_ACTORS_DRIVER is refused here, before a child starts
    if resource is None:
        resource = default_description()
    if isinstance(resource, str):
        check_description(resource)
        resource = resource.strip()
    elif callable(resource):
        try:
            pickle.dumps(resource)
        except Exception as exc:  # noqa: BLE001 - reported as the bad argument it is
            raise InvalidRequest(
                f"with isolate=True, a resource factory must be picklable (a module-level function): {exc}"
            ) from None
    else:
        raise InvalidRequest(f"resource must be a stack description or a factory, got {resource!r}")
    supervisor = checked_supervisor(supervisor)
    if supervisor.on_poisoned is not stop_device:
        raise InvalidRequest(
            "with isolate=True a poisoned device's process always ends and is replaced: give a Supervisor "
            "without on_poisoned"
        )
    ref: pykka.ActorRef[Any] = IsolatedDevice.start(ordinal, driver, resource, supervisor, ipc_pool)
    return ref
