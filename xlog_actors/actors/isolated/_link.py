"""``ChildLink``: the parent's record of one serving child process: its asks in flight, its queue
of frees and its generations.

Invariants:

* **Pipelined asks.** Sending an ask only registers it under a fresh request id with its asker's
  future (the ``pending`` table) and pickles it onto the pipe; the child's reader thread
  (:mod:`._reader`) resolves the future when the reply with that id arrives, so many asks are in
  flight at once, answered in whatever order the child serves them. An ask is registered only
  while the child is alive: one sent to a child that died meanwhile is answered by its death.
* **Frees ride the frames.** Dropped parent handles queue ``(child generation, address)`` in the
  link's ``frees`` (their context's ``reclaim``); the frees of the current generation go with the
  next ask, in its frame (the child frees them before it serves the ask), or in a ``free`` frame
  of their own when the proxy is woken for them (``Flush``). Those of an older generation are
  dropped: their memory went with their context, and nothing is ever freed into a newer one.
* **The parent holds the generation.** Each child has its own ``DeviceState`` in the parent,
  starting at ``base``, where the previous child's generation ended, plus one. The child's
  generation ``g`` is the parent's ``base + g``; a reply made in a newer child generation than the
  current context's advances the state to it (``context_for``), and its handles validate against
  it on every ``access()``. A child's death bumps or poisons it (:mod:`._reader`).

* **An ask wakes a sleeping reader.** Where the reader spins (``_reader``), it sleeps only once
  it looked a while for nothing; an ask sent then writes a byte to the reader's wake-up pipe, so
  the reader spins through the ask and reads its reply the moment it comes, instead of being woken
  by the reply itself (30 to 230 µs on the GPU machines, on the ask's path). ``asks`` counts the
  asks sent, so that the reader, as it goes to sleep, sees one sent since it last looked.

Thread rules: the proxy's thread (or an asker's, on the fast path) sends asks and frees; the
reader thread resolves them. ``pending``, ``alive`` and the current context ``ctx`` change under
``lock``; ``frees`` is a ``deque`` any thread may append to (a garbage collector's included).
"""

from __future__ import annotations

import itertools
import os
import select
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

from ..._core.call_lane import CallLane
from ...driver.shared_memory import SharedSegment
from ...errors import InvalidRequest
from ..device_state import DeviceState
from ._process import ChildProcess
from ._protocol import dumps
from ._remote import LibraryWorkCount, RemoteContext, RemoteDriverFace

__all__ = ["ChildLink", "Flush"]


@dataclass(frozen=True, slots=True)
class Flush:
    """Told to the proxy by a context's wake-up: the free queue of its child grew; the proxy
    sends it (``ChildLink.flush_frees``). Thread rule: told from any thread."""


class ChildLink:
    """One serving child process, its requests in flight and its generations, in the parent.

    Thread rule: see the module docstring; ``lock`` guards ``pending``, ``alive`` and ``ctx``.
    """

    def __init__(
        self, proc: ChildProcess, owner: str, ordinal: int, kind: str, generation: int, restarts: int,
        lane: tuple[SharedSegment, CallLane] | None, lane_spin: float,
    ) -> None:
        """Args:
            proc: the configured child process.
            owner: the proxy's actor URN (the owner of the parent-side handles).
            ordinal: the device ordinal.
            kind: the child's driver kind (what the handles say their driver is).
            generation: the parent's generation of the child's first context (``base``).
            restarts: the proxy's restarts so far (added to the child's own in its statistics).
            lane: the child's call lane, its shared segment and the parent's view, or None.
            lane_spin: how long an asker spins for the child's answer in the lane.
        """
        self.proc = proc
        self.lane_segment: SharedSegment | None = None if lane is None else lane[0]
        self.lane: CallLane | None = None if lane is None else lane[1]
        #: Diagnostics: the allocations answered in the lane (tests and the anatomy script).
        self.lane_answers = 0
        self.lane_spin = lane_spin
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
        #: The library work sent to this child and answered (see ``LibraryWorkCount``).
        self.work = LibraryWorkCount()
        #: The last kept-source copy sent to this child, its key and its pickled payload
        #: (``_library.payload_of``); replaced whole, by whichever thread sends.
        self.last_work: tuple[tuple[Any, ...], Any] | None = None
        self.ctx = self.context(0, self.state.token)
        self.reader: threading.Thread | None = None
        #: Asks sent (under ``lock``), and whether the reader sleeps waiting on its wake-up pipe
        #: (see the module docstring); both read and written with the GIL held.
        self.asks = 0
        self.reader_asleep = False
        #: Diagnostics: the reader's sleeps that an ask ended (tests).
        self.reader_wakes = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def context(self, child_generation: int, token: object) -> RemoteContext:
        """A new context of the child's ``child_generation``, validated against ``token``."""
        return RemoteContext(
            self.owner, self.state, self.base + child_generation, token, child_generation, self.frees,
            self.wake, self.face, self.work,
        )

    # -- asks and frees (the proxy's side) ------------------------------------------------------
    def send_ask(self, payload: Any, future: pykka.Future[Any] | None, message: Any) -> bool:
        """Send one ask, with the frees queued before it in the same frame (one write, one
        read in the child, which frees them first); False when the child is known dead (nothing
        was sent)."""
        with self.lock:
            if not self.alive:
                return False
            rid = next(self.ids)
            self.pending[rid] = (future, message)
            self.asks += 1
        frees = self.take_frees()
        try:
            # The message pickled on its own: a child that cannot read it answers its rid.
            self.proc.channel.send(("ask", rid, dumps(payload), frees))
        except InvalidRequest as exc:  # (before ValueError, its base) it cannot be pickled: nothing sent
            with self.lock:
                self.pending.pop(rid, None)
            self.send_frees(frees)  # they were taken for this frame: they still go
            what = type(getattr(message, "message", message)).__name__
            raise InvalidRequest(
                f"isolated device {self.ordinal}: {what} cannot cross to the device process (it must "
                f"pickle; a kernel's host implementation must be a module-level function): {exc}"
            ) from None
        except (OSError, ValueError):
            pass  # the child died: the reader answers this ask with the death's error
        if self.reader_asleep:
            self._wake_reader()
        return True

    def _wake_reader(self) -> None:
        # Under the lock: the reader closes the pipe under it once it read the last frame.
        with self.lock:
            self.reader_asleep = False
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\x01")
                except OSError:  # full (BlockingIOError): the reader has bytes to wake on already
                    pass

    # -- the reader's sleep ---------------------------------------------------------------------
    def sleep_until_readable(self, fd: int, seen: int) -> bool:
        """Block until ``fd`` (the child's end of the pipe) can be read, or an ask sent since the
        reader's last look began (``seen``: ``asks`` then) wakes the reader.

        Returns:
            True when ``fd`` can be read (a frame, or the end of the pipe); False when an ask
            woke the reader (it spins for the reply then) or was sent before it could sleep.
        Thread rule: the reader thread.
        """
        self.reader_asleep = True
        if self.asks != seen:  # sent before the flag was up: that ask did not wake anyone
            self.reader_asleep = False
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ready = {ready_fd for ready_fd, _ in poller.poll()}
        self.reader_asleep = False
        if self._wake_r in ready:
            self.reader_wakes += 1
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        return fd in ready

    def close_wake(self) -> None:
        """Close the reader's wake-up pipe (the reader read the last frame). Idempotent.
        Thread rule: the reader thread."""
        with self.lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def flush_frees(self) -> None:
        """Send the frees of dropped handles of the current generation in a frame of their own."""
        self.send_frees(self.take_frees())

    def take_frees(self) -> tuple[int, list[int]] | None:
        """Empty the free queue: ``(child generation, addresses)`` of the current generation, or
        None when none is (older ones went with their context). Several senders may take at once
        (the proxy and askers on the fast path): each free goes with exactly one of them."""
        frees = self.frees
        if not frees:
            return None
        current = self.ctx.child_generation
        ptrs = []
        while True:
            try:
                generation, ptr = frees.popleft()
            except IndexError:  # emptied, by this thread or another taking them at once (askers' fast paths)
                break
            if generation == current:
                ptrs.append(ptr)
        return (current, ptrs) if ptrs else None

    def send_frees(self, frees: tuple[int, list[int]] | None) -> None:
        """Send ``frees`` (what ``take_frees`` returned) in a ``free`` frame; nothing for None."""
        if frees is not None:
            try:
                self.proc.channel.send(("free", *frees))
            except (OSError, ValueError):
                pass  # the child is gone, and its memory with it

    # -- generations (the reader's side) --------------------------------------------------------
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
                self.ctx = self.context(child_generation, self.state.token)
                return self.ctx
        stale = self.context(child_generation, object())  # replaced already: stale from birth
        stale.open = False
        return stale
