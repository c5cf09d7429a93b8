"""``IsolatedDevice``: the parent's proxy actor of a device that lives in its own process.

``DeviceActor.start(ordinal, ..., isolate=True)`` starts one (:func:`start_isolated`). Its
``ActorRef`` stays valid across child restarts. It forwards ``Allocate``, ``AllocateMany``,
``Free``, ``GetStats`` and ``Rebuild`` to the child (and the ``ChildFault`` test hook), and the
work of the device's parent-side library actors (``LibraryWork``, its handles mapped to the
child's by :func:`._library.to_child`); ``Subscribe``/``Unsubscribe`` live in the parent.

The pieces, one module each: :mod:`._process` (a child process and its boot handshake),
:mod:`._link` (the parent's record of a serving child: pipelined asks, frees, generations),
:mod:`._reader` (the reader thread: replies, and a child's death answering every asker),
:mod:`._lane` (the call lane), :mod:`._restarts` (the serving child, its reserve and restarts).

Invariants:

* **Forwarded asks are not answered here.** The proxy's thread only translates an ask (a
  parent-side handle to the child's address, or to nothing for a handle of an older child or
  generation) and sends it; the child's reply, read by the reader thread, sets the asker's
  future, so the proxy goes on to the next ask at once. A child found dead when an ask is sent
  is replaced, and the ask goes to the new one.
* **The fast path.** An ``Allocate``, an ``ExportHandle`` (a handle pickled, or the export of a
  copy's source) and a library actor's ``LibraryWork`` are sent from the asker's own thread when
  nothing is queued before them in the proxy's inbox and the proxy is idle
  (``CallerServedInbox`` says why each sender's order is kept): an ``Allocate`` through the
  child's call lane where it has one (``CALL_LANE``), else on the pipe, where the child's frame
  reader serves it itself when its device actor is quiet (``_child``); the others on the pipe,
  mapped and checked exactly as the proxy's own path does (a ``LibraryWork``'s handles by
  ``to_child``, counted in ``child.work`` before it is sent). Whatever the fast path cannot
  serve (no serving child, a refusal, a message that cannot be pickled) goes to the proxy's own
  path before anything was sent, which answers it as before. An asker of a parent-side library
  actor reaches this from its own thread too (``_library``), so its ask wakes no parent thread
  on its way out. On machines of four cores or more (``hot_waits.spin_budget``) the asker spins
  on its ``SpinningFuture`` before it sleeps.
* A handle belongs to the proxy that made it (its ``RemoteContext``'s owner); a ``Free`` or an
  export of another proxy's handle is refused.
* Frees of dropped parent handles go to the child they came from, batched, and never to a newer
  one (see :mod:`._remote` and :mod:`._link`).

Thread rules: handlers run on the proxy's thread; ``_send_direct`` on an asker's thread while the
proxy is idle; each child's reader thread resolves futures, marks the child's state and tells the
proxy what happened.

A little past 400 lines: ``start_isolated``'s checks of every argument sit beside the actor they
configure, so that what a caller may pass and what the proxy takes are read together.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

from ...driver.open import DRIVER_KINDS, env_driver_kind
from ...errors import DeviceUnavailable, GpuRefStale, InvalidRequest
from ...memory.stack import check_description, default_description
from .. import messages as m
from ..caller_inbox import CallerServedInbox
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, SpinningFuture, spin_budget
from ..pykka_internals import ResilientActor
from ..subscribers import tell_subscribers
from ..supervisor import Supervisor, checked_supervisor, stop_device
from ._lane import ask_in_lane
from ._library import payload_of
from ._link import ChildLink, Flush
from ._process import READY_TIMEOUT_S
from ._protocol import ChildFault, ExportBlock, ExportHandle, FreeBlock, LibraryStop, LibraryWork
from ._reader import ChildExited, ChildStopped, Notify, Reissue
from ._remote import RemoteContext
from ._restarts import ChildKeeper

__all__ = ["CALL_LANE", "READY_TIMEOUT_S", "ChildTimeline", "IsolatedDevice", "start_isolated"]

#: Whether a child's allocations go through its call lane (``_core.call_lane``): None (the
#: default) where the waits spin (``hot_waits.spin_budget``: four cores or more; with fewer, every
#: request would wake the sleeping child with a frame anyway, which the pipe path already does),
#: or True/False to force it (tests run it on two cores; ``scripts/isolated_anatomy.py``
#: measures both ways). Read when a child is launched.
CALL_LANE: bool | None = None

_FORWARDED = (
    m.Allocate, m.AllocateMany, m.Free, m.GetStats, m.Rebuild, ChildFault, ExportHandle, LibraryWork, LibraryStop,
)
#: The asks an asker's thread sends to the child itself while the proxy is idle (``_send_direct``).
_DIRECT = (m.Allocate, ExportHandle, LibraryWork)
_SERVED = "Allocate, AllocateMany, Free, GetStats, Rebuild, Subscribe or Unsubscribe"

_registry_lock = threading.Lock()
_registry: dict[tuple[str, int], str] = {}


def _want_lane() -> bool:
    """Whether the next child launched gets a call lane (``CALL_LANE``, read now)."""
    return bool(CALL_LANE or (CALL_LANE is None and spin_budget(FUTURE_SPIN_S) > 0))


@dataclass(frozen=True, slots=True)
class ChildTimeline:
    """Diagnostics: asked of an isolated device, the ``time.monotonic()`` marks of its serving
    child's start (what the restart bench breaks down).

    Reply: a dict: ``pid`` (the child's process id), ``spawned`` (the process started),
    ``booted`` (interpreter up, imports done), ``configured`` (the parent handed it the
    device), ``driver_open``, ``ready``, ``spare_pid`` (the reserve process's id, None while
    there is none); and, when it replaced a child, ``previous_poisoned``
    (when the parent heard of the sticky error met in the previous child, or None) and
    ``previous_exit_seen`` (the parent saw that child's pipe end).
    """


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
        hot_spare: bool = True,
    ) -> None:
        """Start the first child and wait until it serves.

        Args:
            ordinal: the device ordinal in the child's driver.
            kind: the child's driver kind, or None for ``XLOG_ACTORS_DRIVER`` (else ``"auto"``).
            resource: a stack description, a picklable factory, or None (the child's default).
            supervisor: the restart intensity (its ``max_restarts``/``within_s`` also bound the
                child's in-process rebuilds).
            ipc_pool: a CUDA child opens ``CudaDriver(ipc_pool=True)`` (see ``start_isolated``).
            hot_spare: the reserve process opens its driver and device ahead of need (see
                ``start_isolated``).
        Raises:
            InvalidRequest, DeviceUnavailable: as the child met them (a bad ordinal, no driver);
                nothing is left running.
        Thread rule: the caller's thread (``start`` runs it there).
        """
        super().__init__()
        self._ordinal = ordinal
        self._kind = kind
        self._subscribers: list[pykka.ActorRef[Any]] = []
        self._key = (kind or "auto", ordinal)
        with _registry_lock:
            if self._key in _registry:
                raise InvalidRequest(
                    f"device {ordinal} of the {self._key[0]} driver already has an isolated DeviceActor "
                    f"({_registry[self._key]}); one actor owns each ordinal"
                )
            _registry[self._key] = self.actor_urn
        try:
            self._keeper = ChildKeeper(
                ordinal, kind, resource, supervisor, ipc_pool, self.actor_ref, _want_lane, self._notify,
                hot_spare=hot_spare,
            )
        except BaseException:
            self._unregister()
            raise

    def __repr__(self) -> str:
        return f"IsolatedDevice(device={self._ordinal}, driver={self._kind or 'auto'})"

    @property
    def _child(self) -> ChildLink:
        """The serving child's link (diagnostics: tests and ``scripts/isolated_anatomy.py``)."""
        return self._keeper.child

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
        self._keeper.boot_spare()
        self._inbox().serve_in_caller(_DIRECT, self._send_direct)

    def _inbox(self) -> CallerServedInbox:
        inbox = self.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        return inbox

    def _send_direct(self, envelope: Any) -> Any:
        """Send ``envelope``'s ``Allocate``, ``ExportHandle`` or ``LibraryWork`` to the serving
        child from the asker's thread: None once sent, or ``envelope`` when the proxy must take it (no serving
        child, stopped, a refusal, a message that cannot be pickled: the proxy's own path answers
        it, with the same checks and the same error). Called by ``CallerServedInbox.put`` while
        the proxy is idle; a restart the proxy starts meanwhile marks the child dead, and an ask
        that reaches a dying child is answered with its death, as on the proxy's path."""
        keeper = self._keeper
        if keeper.stopped is not None:
            return envelope
        child = keeper.child
        if not child.alive or child.stopping:
            return envelope
        message = envelope.message
        if type(message) is LibraryWork:
            return self._send_work(child, envelope)
        try:
            payload: Any = message
            if type(message) is ExportHandle:
                payload = self._export_payload(message, child)
            elif child.lane is not None and ask_in_lane(child, message, envelope.reply_to):
                return None
            sent = child.send_ask(payload, envelope.reply_to, message)
        except Exception:  # noqa: BLE001 - the proxy's own path raises it to the asker
            return envelope
        return None if sent else envelope

    def _send_work(self, child: ChildLink, envelope: Any) -> Any:
        """``_send_direct`` of a ``LibraryWork``: its handles mapped as ``_forward`` maps them
        (``to_child``: a refusal sends nothing), counted in ``child.work`` before it is sent, as
        ``_forward`` counts it."""
        work: LibraryWork = envelope.message
        try:
            payload = payload_of(work, self.actor_urn, child, self._ordinal)
        except Exception:  # noqa: BLE001 - refused: the proxy's own path raises the same error to the asker
            return envelope
        child.work.count_sent()
        try:
            sent = child.send_ask(payload, envelope.reply_to, work)
        except Exception:  # noqa: BLE001 - it cannot be pickled: nothing went, and the proxy's path says so
            child.work.uncount_sent()
            return envelope
        if not sent:
            child.work.uncount_sent()  # the child had died: the proxy's path sends it to the next one
            return envelope
        return None

    def on_stop(self) -> None:
        """Stop the child (killed if it does not end in 10 s) and the reserve; every handle is
        ``"device shutting down"``. Thread rule: the proxy's thread (pykka calls it)."""
        self._inbox().serve_in_caller((), None)
        try:
            self._keeper.stop()
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
        keeper = self._keeper
        if isinstance(message, ChildExited):
            keeper.restart(message.child)
        elif isinstance(message, ChildStopped):
            if message.child is keeper.child:
                keeper.stop_for_good(f"the device in process {message.child.proc.process.pid} stopped for good")
        elif isinstance(message, Notify):
            self._notify(message.message)
        elif isinstance(message, Flush):
            keeper.child.flush_frees()
        elif isinstance(message, Reissue):
            try:
                self._forward(message.message, message.future)
            except Exception as error:  # noqa: BLE001 - the asker's answer: DeviceUnavailable, when none serves
                message.future.set_exception((type(error), error, None))
        elif isinstance(message, ChildTimeline):
            timeline = dict(keeper.child.timeline)
            timeline["spare_pid"] = None if keeper.spare is None else keeper.spare.process.pid
            return timeline
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
        keeper = self._keeper
        for _ in range(2):  # a child found dead here is replaced, and the ask goes to the new one
            child = keeper.serving()
            if child is None:
                if isinstance(message, m.GetStats):
                    self._answer(future, keeper.stopped_stats())
                    return
                if isinstance(message, LibraryStop):
                    self._answer(future, None)  # the child, and its library actors, are gone
                    return
                assert keeper.stopped is not None
                raise DeviceUnavailable(str(keeper.stopped))
            payload: Any = message
            if isinstance(message, m.Free):
                payload = self._free_payload(message, child)
                if payload is None:
                    self._answer(future, None)
                    return
            elif isinstance(message, ExportHandle):
                payload = self._export_payload(message, child)
            elif isinstance(message, LibraryWork):
                payload = payload_of(message, self.actor_urn, child, self._ordinal)
                child.work.count_sent()  # before it can run: see _library's kept exports
            try:
                sent = child.send_ask(payload, future, message)
            except InvalidRequest:
                if isinstance(message, LibraryWork):
                    child.work.uncount_sent()  # it could not be pickled: nothing went
                raise
            if sent:
                return
            keeper.restart(child)
        raise DeviceUnavailable(f"isolated device {self._ordinal}: no child process could take the request")

    @staticmethod
    def _answer(future: pykka.Future[Any] | None, value: Any) -> None:
        if future is not None:
            future.set(value)

    def _free_payload(self, message: m.Free, child: ChildLink) -> FreeBlock | None:
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

    def _export_payload(self, message: ExportHandle, child: ChildLink) -> ExportBlock:
        ref = message.ref
        ctx = ref.context
        if not isinstance(ctx, RemoteContext) or ctx.owner != self.actor_urn:
            raise InvalidRequest(
                f"export: {ref!r} belongs to another device actor, not to isolated device {self._ordinal}"
            )
        if not ctx.is_current() or ctx is not child.ctx:
            raise GpuRefStale("context rebuilt", f"{ref!r}: its process or generation was replaced")
        return ExportBlock(ref.block.ptr, ctx.child_generation)

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
    hot_spare: object = True,
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
        hot_spare: True (the default): the reserve process is handed the device as soon as it
            has booted, so it opens its driver, its context and its pool ahead of need, and a
            restart only switches to it (a sticky error's first ``Allocate`` on the new
            generation then waits for no driver start). It costs a second context on the device
            while the device serves (its memory: ``docs/fault-model.md`` gives the figure) and
            the reserve's driver on the host. False: the reserve only boots Python and its
            imports, and opens the driver when it takes over.
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
    if type(hot_spare) is not bool:
        raise InvalidRequest(f"hot_spare must be a bool, got {hot_spare!r}")
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
    ref: pykka.ActorRef[Any] = IsolatedDevice.start(ordinal, driver, resource, supervisor, ipc_pool, hot_spare)
    return ref
