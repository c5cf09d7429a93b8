"""``ChildKeeper``: keeps one child process serving an isolated device: launches it, replaces it
when it dies, and stops the device for good past the restart intensity.

Invariants:

* **One serving child** at a time (``child``); a dead one is replaced once per death, by the
  proxy's thread, after its reader marked the death and answered its askers (the replacement
  waits for that reader). A child replaced is never sent anything again.
* **Restarts** go through the ``Supervisor``'s restart intensity (per ordinal); past it the device
  stops for good (``stopped``) as an in-process one does: a ``GenerationChanged(..., "stopped")``
  to the subscribers, and every later ask ``DeviceUnavailable``. A launch that fails counts as a
  restart, and the next attempt follows.
* **A booted child is kept in reserve** (``spare``, spawned when the proxy starts and after each
  restart) so that a restart does not wait for an interpreter to start and import; a *hot*
  reserve (``hot_spare``, the default) is also handed the device at once, so it opens its driver,
  context and pool while the device serves, and a restart only reads its ``ready`` frame. An
  unused reserve is killed when the device stops. Only a death of the serving child is a restart: a
  reserve found dead when a restart comes, or one that fails as it is handed the device (one
  round trip confirms it serves before it is announced: a reserve killed a moment before may
  still look alive), is replaced by a fresh process (``SPARE_RETRIES`` times per restart) and
  logged as the spare's.
* **Generations continue across children**: a new child's first generation is the one its
  predecessor's death left next (bumped, or past a poisoned one), so every handle of the dead
  child is stale and none of the new child's is.
* **The call lane** is opened for a child at its launch when ``want_lane()`` says so (read then,
  so a change applies from the next child), and its shared segment is closed if the launch fails.

Thread rules: every method runs on the proxy's thread (the first launch on the thread that starts
the proxy); asker threads only read ``child`` and ``stopped`` (the fast path), each a single
attribute read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pykka

from ..._core.call_lane import CallLane
from ...driver.shared_memory import SharedSegment, unlink_segments_of
from ...errors import DeviceUnavailable
from .. import messages as m
from ..supervisor import Supervisor
from ._lane import lane_spin, open_lane
from ._link import ChildLink, Flush
from ._process import STOP_TIMEOUT_S, ChildProcess
from ._reader import ChildExited, start_reader

__all__ = ["SPARE_RETRIES", "ChildKeeper"]

#: How many times one restart hands the device to a reserve that fails to take it before a fresh
#: process does (a reserve that cannot start must not loop, nor count as restarts of the device).
SPARE_RETRIES = 1

#: How long a spare that took over has to answer its first ask (see ``ChildKeeper._confirm``).
CONFIRM_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


def _told_nobody(message: m.GenerationChanged) -> None:
    """What a stopped keeper tells its subscribers: nothing (see ``ChildKeeper.stop``)."""


class ChildKeeper:
    """The serving child of one isolated device, its reserve and its restarts; see the module
    docstring.

    Thread rule: the proxy's thread; any thread may read ``child`` and ``stopped``.
    """

    def __init__(
        self,
        ordinal: int,
        kind: str | None,
        resource: str | Callable[..., Any] | None,
        supervisor: Supervisor,
        ipc_pool: bool,
        proxy: pykka.ActorRef[Any],
        want_lane: Callable[[], bool],
        notify: Callable[[m.GenerationChanged], None],
        *,
        hot_spare: bool = True,
    ) -> None:
        """Launch the first child and wait until it serves.

        Args:
            ordinal, kind, resource, supervisor, ipc_pool: the device's configuration (see
                ``IsolatedDevice``).
            proxy: the proxy's ``ActorRef``, told what a child's threads report.
            want_lane: whether the next child launched gets a call lane.
            notify: tells the subscribers a status change (on the proxy's thread).
            hot_spare: configure the reserve as soon as it is spawned (see the module docstring).
        Raises:
            InvalidRequest, DeviceUnavailable: as the child met them; nothing is left running.
        """
        self.ordinal = ordinal
        self.kind = kind
        self.resource = resource
        self.supervisor = supervisor
        self.ipc_pool = ipc_pool
        self._proxy = proxy
        self._want_lane = want_lane
        self._notify = notify
        self.restarts = 0
        self.hot_spare = hot_spare
        self.stopped: DeviceUnavailable | None = None
        self.spare: ChildProcess | None = None
        #: A hot reserve's configuration, sent already: its call lane (or None) and when.
        self._spare_config: tuple[tuple[SharedSegment, CallLane] | None, float] | None = None
        self.child: ChildLink = self.launch(0, ChildProcess(ordinal))

    def _configure(self, proc: ChildProcess) -> tuple[tuple[SharedSegment, CallLane] | None, float]:
        """Hand ``proc`` the device (it opens its driver and device on receipt): its call lane,
        opened here when ``want_lane()`` says so, and when. The lane is closed if sending fails."""
        configured = time.monotonic()
        supervisor = self.supervisor
        lane: tuple[SharedSegment, CallLane] | None = None
        try:
            if self._want_lane():
                lane = open_lane(self.ordinal)
            proc.channel.send(
                ("config", self.ordinal, self.kind, self.resource, supervisor.max_restarts, supervisor.within_s,
                 self.ipc_pool, None if lane is None else lane[0].name)
            )
        except BaseException:
            if lane is not None:
                lane[0].close()
            raise
        return lane, configured

    def launch(self, generation: int, proc: ChildProcess,
               configured: tuple[tuple[SharedSegment, CallLane] | None, float] | None = None) -> ChildLink:
        """Hand ``proc`` the device (unless ``configured`` says it has it: a hot reserve) and
        wait until it serves; its link, its reader started."""
        lane: tuple[SharedSegment, CallLane] | None = None
        try:
            lane, at = configured if configured is not None else self._configure(proc)
            booted, frame = proc.await_ready(self.ordinal)
        except BaseException:
            proc.end(0.0)
            if lane is not None:
                lane[0].close()
            raise
        child = ChildLink(
            proc, self._proxy.actor_urn, self.ordinal, self.kind or "auto", generation, self.restarts, lane,
            lane_spin(),
        )
        child.timeline.update(
            pid=proc.process.pid, spawned=proc.spawned, booted=booted, configured=at,
            driver_open=frame[1], ready=frame[2],
        )
        me = self._proxy

        def tell(message: Any) -> None:
            try:
                me.tell(message)
            except pykka.ActorDeadError:
                pass  # the proxy stopped meanwhile

        child.wake = lambda: tell(Flush())
        child.ctx = child.context(0, child.state.token)
        start_reader(child, lambda c: tell(ChildExited(c)), tell)
        return child

    def _confirm(self, child: ChildLink) -> None:
        """One round trip to a spare that just took over: a reserve killed a moment before the
        restart that handed it the device may still look alive and have said ``ready`` (a process
        holding a CUDA context takes a while to end); such a one fails here, as a spare that
        failed to take over, and is not announced.

        Raises:
            DeviceUnavailable: it did not answer within ``CONFIRM_TIMEOUT_S`` (it is ended).
        """
        future: pykka.Future[Any] = pykka.ThreadingFuture()
        message = m.GetStats()
        try:
            if not child.send_ask(message, future, message):
                raise DeviceUnavailable(f"isolated device {self.ordinal}: the spare ended as it took over")
            future.get(timeout=CONFIRM_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - whatever the dying spare answered, it did not serve
            child.stopping = True
            child.proc.end(0.0)
            if child.reader is not None:
                child.reader.join(STOP_TIMEOUT_S)
            raise DeviceUnavailable(f"isolated device {self.ordinal}: the spare process "
                                    f"{child.proc.process.pid} did not serve as it took over ({exc!r})") from None

    def boot_spare(self) -> None:
        """Spawn the reserve child (it boots while the device serves); a hot one is handed the
        device at once, so it opens its driver and device while the device serves too. A hot
        reserve that cannot be configured is kept cold (it is configured when it takes over)."""
        self.spare = ChildProcess(self.ordinal)
        self._spare_config = None
        if self.hot_spare:
            try:
                self._spare_config = self._configure(self.spare)
            except Exception as exc:  # noqa: BLE001 - a reserve's trouble is met when it takes over
                logger.warning("isolated device %d: the spare process could not be configured ahead: %r",
                               self.ordinal, exc)

    def serving(self) -> ChildLink | None:
        """The serving child, replacing a dead one first; None once stopped for good."""
        if self.stopped is None and not self.child.alive:
            self.restart(self.child)
        return None if self.stopped is not None else self.child

    def restart(self, dead: ChildLink) -> None:
        """Replace ``dead`` if it is still the serving child (once per death)."""
        if dead is not self.child or self.stopped is not None:
            return
        if dead.reader is not None:
            dead.reader.join(STOP_TIMEOUT_S)  # its death is marked and its askers answered
        generation = dead.next_generation
        spare_failures = 0
        while True:
            if not self.supervisor.allow_restart(self.ordinal):
                self.stop_for_good(f"restart intensity exceeded; the last process ended: {dead.poisoned!r}")
                return
            self.restarts += 1
            while True:
                proc, self.spare = self._live_spare(), None
                configured, self._spare_config = self._spare_config, None
                from_spare = proc is not None
                try:
                    if proc is None:
                        child = self.launch(generation, ChildProcess(self.ordinal))
                    else:
                        child = self.launch(generation, proc, configured)
                        self._confirm(child)
                except Exception as exc:  # noqa: BLE001 - a spare's failure is retried; a fresh one's counted
                    if from_spare and spare_failures < SPARE_RETRIES:
                        # The reserve died or failed as it was handed the device: that is no
                        # restart of the device, which a fresh process now serves.
                        spare_failures += 1
                        logger.warning("isolated device %d: the spare process failed as it took over (%r); "
                                       "a fresh process takes over", self.ordinal, exc)
                        continue
                    logger.error("isolated device %d: a new process failed: %r", self.ordinal, exc)
                    child = None
                break
            if child is not None:
                break
        child.timeline.update(previous_poisoned=dead.poisoned_at, previous_exit_seen=dead.timeline.get("exit_seen"))
        self.child = child
        logger.warning(
            "isolated device %d: process %s ended; process %s serves generation %d",
            self.ordinal, dead.proc.process.pid, child.proc.process.pid, generation,
        )
        self._notify(m.GenerationChanged(self.ordinal, generation, "running"))
        self.boot_spare()

    def stop_for_good(self, reason: str) -> None:
        """Stop the device for good (idempotent): end the child and the reserve, tell the
        subscribers ``"stopped"``; every later ask is ``DeviceUnavailable`` with ``reason``."""
        if self.stopped is not None:
            return
        logger.error("isolated device %d: stopped for good: %s", self.ordinal, reason)
        self.stopped = DeviceUnavailable(f"isolated device {self.ordinal} was stopped for good: {reason}")
        child = self.child
        child.state.begin_shutdown()
        if child.alive:
            child.stopping = True
            child.proc.end(STOP_TIMEOUT_S)
        self._discard_spare()
        self._notify(m.GenerationChanged(self.ordinal, child.state.generation, "stopped"))

    def stop(self) -> None:
        """The proxy stops: end the child (killed if it does not end in ``STOP_TIMEOUT_S``) and
        the reserve; every handle is ``"device shutting down"``."""
        child = self.child
        child.stopping = True
        child.state.begin_shutdown()
        child.proc.end(STOP_TIMEOUT_S)
        if child.reader is not None:
            child.reader.join(STOP_TIMEOUT_S)
        self._discard_spare()
        # The proxy's ``_notify`` is a bound method of the proxy, which holds this keeper: a
        # cycle that would keep the child's link, and through it the device state and its
        # export table (a shared segment and a sweeper thread), until a garbage collection.
        # Nothing is told after a stop.
        self._notify = _told_nobody

    def stopped_stats(self) -> m.DeviceStats:
        """The statistics of a device stopped for good."""
        return m.DeviceStats(
            device_id=self.ordinal, generation=self.child.state.generation, bytes_outstanding=0, live_blocks=0,
            restarts=self.restarts, status="stopped", driver=self.kind or "auto", stack="",
        )

    def _live_spare(self) -> ChildProcess | None:
        """The reserve, if its process still runs; a dead one is discarded (and logged as the
        spare's death, which is not a restart of the device)."""
        spare = self.spare
        if spare is None:
            return None
        if spare.process.is_alive():
            return spare
        logger.warning("isolated device %d: the spare process %s had ended (exit code %s); a fresh process "
                       "takes over", self.ordinal, spare.process.pid, spare.process.exitcode)
        self._discard_spare()
        return None

    def _discard_spare(self) -> None:
        spare, self.spare = self.spare, None
        configured, self._spare_config = self._spare_config, None
        if configured is not None and configured[0] is not None:
            configured[0][0].close()  # the hot reserve's call lane
        if spare is not None:
            spare.discard()
            if spare.process.pid is not None:
                unlink_segments_of(spare.process.pid)  # what a configured reserve may have made
