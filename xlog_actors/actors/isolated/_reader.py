"""The reader thread of a child: it reads the child's frames, answers the askers and marks the
child's death.

Invariants:

* **One reader per child** reads every frame the child sends: replies resolve the futures
  registered in the link's ``pending`` table by request id (decoded into parent-side handles of
  the right generation, :meth:`ChildLink.context_for`); a ``generation`` frame advances the
  parent's generation or tells the proxy that the child's device stopped for good; a
  ``poisoned`` frame records the sticky error that the child's exit follows.
* **The fast path's waits**: on machines of four cores or more
  (``hot_waits.spin_budget``) the reader spins on the pipe while a reply is due, and a shorter
  while after each frame, before it sleeps (and the longer while once more when an ask was sent
  during the shorter one, so it stays awake through the next copy of a back-to-back asker). It
  sleeps on the pipe and on the link's wake-up pipe: an ask sent while it sleeps wakes it, so it
  spins through the ask and reads the reply at once instead of being woken by the reply
  (``ChildLink.sleep_until_readable``; an ask sent while it looked counts as one, ``asks``); an
  answered asker's ``SpinningFuture`` (a library actor's asker's too, behind its
  ``_library.LibraryAnswer``) is rung only once the reader let go of the GIL
  (``RING_AFTER_RELEASE``), so the asker takes it at once.
* **Every asker is answered.** When the pipe ends (the child died or was stopped), every ask sent
  to it and not answered gets a typed error at once, from this thread:
  ``GpuRefStale("context poisoned")`` after a sticky error (the generation is poisoned),
  ``DeviceUnavailable`` otherwise (the generation is bumped, ``"context rebuilt"``); the child's
  lane is marked dead, which ends every asker's wait there. Asks that arrive afterwards are
  served by the next child.
* A killed child cannot unlink its shared device memory: its death unlinks the segments its pid
  named (importers keep their maps).

Thread rules: only the reader thread runs these functions; it changes the link's ``pending``,
``alive`` and ``ctx`` under the link's lock, and tells the proxy what happened (``ChildExited``,
``ChildStopped``, ``Notify``) rather than acting on the proxy's state itself.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

from ..._core.doorbell import Doorbell
from ...driver.shared_memory import unlink_segments_of
from ...errors import CorruptionDetected, DeviceUnavailable, DriverError, GpuRefStale, XlogError
from .. import messages as m
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, INBOX_SPIN_S, SpinningFuture, spin_budget
from ..pykka_internals import answer
from ..supervisor import EXIT_POISONED
from ._library import LibraryAnswer
from ._link import ChildLink
from ._protocol import LibraryWork, RemoteBlock, decode_error

__all__ = ["RING_AFTER_RELEASE", "ChildExited", "ChildStopped", "Notify", "Reissue", "start_reader"]

#: Whether the reply reader rings an answered asker's ``SpinningFuture`` only once it released
#: the GIL (``_read``), rather than as it sets the reply. Set it both ways to measure it
#: (docs/performance.md, "Isolated Allocate round trip").
RING_AFTER_RELEASE = True

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChildExited:
    """Told to the proxy: ``child``'s pipe ended while it was not being stopped (a restart is
    due). Thread rule: told by the reader thread."""

    child: ChildLink


@dataclass(frozen=True, slots=True)
class ChildStopped:
    """Told to the proxy: ``child``'s device stopped for good (past its own restart intensity).
    Thread rule: told by the reader thread."""

    child: ChildLink


@dataclass(frozen=True, slots=True)
class Reissue:
    """Told to the proxy: an allocation (``Allocate``/``AllocateMany``) that was in flight when
    its child died; the proxy sends it to the child that serves next, with the same future, or
    answers it ``DeviceUnavailable`` when none can. An allocation names no handle, so the death
    of the process that was to serve it is no reason to refuse it. Thread rule: told by the
    reader thread."""

    message: Any
    future: pykka.Future[Any]


@dataclass(frozen=True, slots=True)
class Notify:
    """Told to the proxy: tell the subscribers ``message``. Thread rule: told by the reader
    thread."""

    message: m.GenerationChanged


def start_reader(link: ChildLink, on_exit: Callable[[ChildLink], None], tell: Callable[[Any], None]) -> None:
    """Start ``link``'s reader thread (``link.reader``). ``on_exit(link)`` runs on it once the
    pipe ended while the child was not being stopped; ``tell`` sends the proxy a message.
    Thread rule: the proxy's thread, once per link."""
    link.reader = threading.Thread(
        target=_read, args=(link, on_exit, tell), name=f"xlog-device-{link.ordinal}-reader", daemon=True
    )
    link.reader.start()


def _read(link: ChildLink, on_exit: Callable[[ChildLink], None], tell: Callable[[Any], None]) -> None:
    channel = link.proc.channel
    spin, idle_spin = spin_budget(FUTURE_SPIN_S), spin_budget(INBOX_SPIN_S)
    bell: Doorbell | None = None  # of the asker answered last, rung once the GIL is let go
    while True:
        try:
            # A reply is due: look for it a while before sleeping. Else look a shorter while:
            # an asker answered just now sends its next ask a few µs later, and a reader that
            # went to sleep in between would be woken for that reply (tens of µs on a VM). An
            # ask sent during that shorter look (the answered asker's next one, a copy taking
            # milliseconds) makes its reply due: look the longer while for it then.
            if spin:
                seen = link.asks
                ready = channel.spin(spin if link.pending else idle_spin, bell)
                bell = None
                if not ready and link.pending:
                    seen = link.asks
                    ready = channel.spin(spin)
                if not ready and not link.sleep_until_readable(channel.fileno(), seen):
                    continue  # an ask woke it, or came before it slept: spin for its reply
            elif bell is not None:
                bell.ring()
                bell = None
            frame = channel.recv()
        except (EOFError, OSError):
            break
        try:
            bell = _serve_frame(link, frame, tell)
        except Exception as exc:  # this thread must go on reading frames
            logger.error("isolated device %d: a frame from the child failed: %r", link.ordinal, exc, exc_info=exc)
    if bell is not None:
        bell.ring()
    link.close_wake()
    _died(link, tell)
    if not link.stopping:
        on_exit(link)


def _serve_frame(link: ChildLink, frame: tuple[Any, ...], tell: Callable[[Any], None]) -> Doorbell | None:
    """Serve one frame of the child; the bell of an asker it answered, for the caller to ring."""
    kind = frame[0]
    if kind == "reply":
        return _resolve(link, frame[1], frame[2], frame[3])
    if kind == "generation":
        _, generation, status = frame
        if status == "running":
            link.context_for(generation)
            tell(Notify(m.GenerationChanged(link.ordinal, link.base + generation, status)))
        elif status == "stopped":
            tell(ChildStopped(link))
    elif kind == "poisoned":
        link.poisoned_at = time.monotonic()
        link.poisoned = decode_error(frame[1])
    return None


def _resolve(link: ChildLink, rid: int, ok: bool, value: Any) -> Doorbell | None:
    """Answer the asker of ``rid``; a ``SpinningFuture``'s bell is returned unrung (the reader
    rings it once it let go of the GIL: see ``_read``), any other reply is set as usual."""
    with link.lock:
        entry = link.pending.pop(rid, None)
    if entry is None:
        return None
    future, message = entry
    if type(message) is LibraryWork:
        link.work.answered += 1  # before the asker hears: a copy it asks next sees the write counted
    error: BaseException | None = None
    if ok:
        try:
            value = _decode(link, message, value)
        except Exception as exc:  # noqa: BLE001 - the asker's answer
            error = exc
    else:
        try:
            error = decode_error(value)
        except Exception as exc:  # noqa: BLE001 - the asker is answered whatever came
            error = DriverError(f"isolated device {link.ordinal}: the child's error could not be read: {exc!r}")
        if isinstance(message, m.Free) and not isinstance(error, CorruptionDetected):
            message.ref._unmark_released()  # the child kept the block: the handle stays usable
    if future is None:
        return None  # told: the value (a handle, say) is dropped, and freed
    exc_info = None if error is None else (type(error), error, None)
    if RING_AFTER_RELEASE:
        if type(future) is SpinningFuture:
            return future.fill(value, exc_info)
        reply: Any = future  # the pending table's replies are pykka_internals.Reply objects
        if type(reply) is LibraryAnswer:  # a library actor's asker's, behind its error mapping
            return reply.fill(value, exc_info)
    answer(future, value, exc_info)
    return None


def _decode(link: ChildLink, message: Any, value: Any) -> Any:
    if isinstance(value, RemoteBlock):
        return GpuRef._new(value.block, link.context_for(value.generation))  # type: ignore[arg-type]
    if isinstance(message, m.AllocateMany):
        return [GpuRef._new(r.block, link.context_for(r.generation)) for r in value]  # type: ignore[arg-type]
    if isinstance(message, m.Rebuild):
        return link.context_for(value).generation
    if isinstance(message, m.GetStats):
        return dataclasses.replace(
            value, generation=link.base + value.generation, restarts=link.restarts + value.restarts
        )
    return value


def _died(link: ChildLink, tell: Callable[[Any], None]) -> None:
    proc = link.proc
    proc.process.join(5.0)  # its pipe ended: the exit follows at once
    code = proc.process.exitcode
    if code is not None and proc.process.pid is not None:
        # A killed child cannot unlink its shared device memory; importers keep their maps.
        unlink_segments_of(proc.process.pid)
    seen = time.monotonic()
    with link.lock:
        link.alive = False
        pending, link.pending = link.pending, {}
        link.ctx.open = False
        link.frees.clear()
    if link.lane is not None:
        link.lane.mark_dead()  # an asker spinning on its slot stops: its future is answered below
        assert link.lane_segment is not None
        link.lane_segment.close()  # the name only: the lane's view keeps the mapping
    link.timeline["exit_seen"] = seen
    poisoned = link.poisoned is not None or code == EXIT_POISONED
    where = f"device {link.ordinal}, generation {link.state.generation}, process {proc.process.pid}"
    error_type: type[XlogError] = DeviceUnavailable
    if link.stopping:
        text = f"{where}: the device was stopped"
    elif poisoned:
        link.state.poison()
        link.next_generation = link.state.generation + 1
        error_type, text = GpuRefStale, f"{where} exited with code {code} after {link.poisoned!r}"
    else:
        link.next_generation = link.state.bump_generation()
        text = f"{where} ended (exit code {code}) with the request in flight; a new process is started"
    proc.channel.close()
    for future, message in pending.values():
        if future is not None and not link.stopping and isinstance(message, (m.Allocate, m.AllocateMany)):
            tell(Reissue(message, future))  # served by the next child (see Reissue)
            continue
        if future is not None:  # one fresh error per asker: each raise adds its own traceback
            error = GpuRefStale("context poisoned", text) if error_type is GpuRefStale else DeviceUnavailable(text)
            future.set_exception((type(error), error, None))
