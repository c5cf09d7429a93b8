"""``DeviceActor``: one pykka actor per device ordinal, owning its context, generation counter
and resource stack, behind an ``ActorRef`` that stays valid across context rebuilds.

The actor routes each message to its handler and each failure to its ``Supervisor``; the phases
of the device (starting, running, rebuilding, broken, poisoned, stopped) are a
``DeviceLifecycle``, and the pykka loop that keeps the actor alive through a bad told message is
``ResilientActor``'s.

The module is past 400 lines because the handlers and the supervision paths share the actor's
state (lifecycle, subscribers, last error, supervisor); split apart, they would pass all of it
back and forth.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from typing import Any, ClassVar

import pykka
from pykka._envelope import Envelope

from ..driver.protocol import Driver
from ..errors import (
    ContextLost,
    ContextPoisoned,
    CorruptionDetected,
    DeviceUnavailable,
    DriverError,
    InvalidRequest,
    XlogError,
)
from ..memory.history import MemoryHistory, check_max_entries, origin_capture
from ..memory.pinned import PinnedAllocator, PinnedBuffer
from ..memory.report import MemoryReport, memory_report
from ..memory.stream_pool import StreamPool
from ..runtime.device_runtime import XlogDeviceRuntime
from . import messages as m
from . import ranges
from .caller_inbox import CallerServedInbox
from .device_client import ContextCell, DeviceClient
from .device_config import DeviceConfig, ResourceSpec
from .device_context import DeviceContext
from .device_state import DeviceState
from .gpu_ref import GpuRef
from .latch_future import LatchFuture
from .lifecycle import DeviceLifecycle, DeviceStatus
from .pykka_internals import ResilientActor
from .subscribers import tell_subscribers
from .supervisor import Directive, SupervisedFailure, Supervisor

__all__ = ["DeviceActor"]

logger = logging.getLogger(__name__)

_registry_lock = threading.Lock()
_registry: weakref.WeakKeyDictionary[Driver, dict[int, str]] = weakref.WeakKeyDictionary()

#: The messages a user may send, for the answer to one the actor does not understand.
_PUBLIC_MESSAGES = (
    "Allocate, AllocateMany, AllocatePinned, Free, Rebuild, Subscribe, Unsubscribe, GetStats, GetReport, GetClient, "
    "RecordMemoryHistory or GetMemorySnapshot"
)



def _detached(exc: BaseException) -> BaseException:
    """A copy of ``exc`` that holds no frames, to keep as the device's last error.

    pykka re-raises the very exception object in the asker's thread, whose traceback then reaches
    the asker's frames and their locals (its ``GpuRef`` handles among them): keeping the original
    would keep those handles, and their memory, alive until the next failure.
    """
    try:
        clone = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied: keep its text and code
        clone = DriverError(repr(exc), code=getattr(exc, "code", None))
    clone.__traceback__ = None
    clone.__cause__ = None
    clone.__context__ = None
    return clone

class DeviceActor(ResilientActor):
    """The one actor of a device ordinal: ``DeviceActor.start(ordinal=0, driver=None,
    resource=None, supervisor=None)`` returns its ``ActorRef``.

    It answers the messages of ``xlog_actors.actors.messages``. A device that is not running
    still answers every message (with the typed error of its status); no message, told or
    asked, well-formed or not, stops it: only ``stop()`` does. Failures go to its
    ``Supervisor``, which resumes, rebuilds the context behind the same ref, poisons the
    device, or stops it for good past the restart intensity.

    Thread rule: handlers run on the actor's thread, where ``on_start`` made the context
    current. ``DeviceClient``s allocate from other threads through the same runtime.
    """

    #: The handler of each message type, by name: looked up on the actor for each message, so the
    #: table holds no bound method (an actor holding bound methods of itself is a reference cycle,
    #: which kept a stopped device's state, export table, segment and sweeper thread until a
    #: garbage collection), and a subclass's or a test's replacement of a handler is the one called.
    _handlers: ClassVar[dict[type, str]] = {
        m.Allocate: "_on_allocate",
        m.AllocateMany: "_on_allocate_many",
        m.AllocatePinned: "_on_allocate_pinned",
        m.Free: "_on_free",
        m.Rebuild: "_on_rebuild",
        m.Subscribe: "_on_subscribe",
        m.Unsubscribe: "_on_unsubscribe",
        m.GetStats: "_on_stats",
        m.GetClient: "_on_client",
        m.GetReport: "_on_report",
        m.Attach: "_on_attach",
        m.Reclaim: "_on_reclaim",
        m.ReportFailure: "_on_report_failure",
        m.FailedInCaller: "_on_failed_in_caller",
        m.RecordMemoryHistory: "_on_record_history",
        m.GetMemorySnapshot: "_on_memory_snapshot",
    }

    def __init__(
        self,
        ordinal: int = 0,
        driver: Driver | str | None = None,
        resource: ResourceSpec = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        """Check the whole configuration and claim the ordinal; the stack is built on the
        actor's thread once it starts.

        Args:
            ordinal: the device ordinal, below the driver's device count.
            driver: the driver; a driver kind (``"cuda"``, ``"host"``, ``"auto"``) for the process-wide
                driver of that kind (``driver_of_kind``, shared by every device started so); None for
                ``default_driver()``.
            resource: a stack description (``"async+stats"``), a factory ``(driver, ordinal,
                stream_pool) -> resource``, or None for ``XLOG_ACTORS_RESOURCE`` (else
                ``"async"``).
            supervisor: the ``Supervisor``; None for the defaults (3 restarts in 60 s).
        Raises:
            InvalidRequest: a bad ordinal, driver, resource description or supervisor, or the
                ordinal already has a ``DeviceActor`` on this driver. Nothing is left running.
            DeviceUnavailable: ``driver`` is None or a kind, and no such driver can be opened.
        Thread rule: the caller's thread (``start`` runs it there, before the actor exists).
        """
        config = DeviceConfig.check(ordinal, driver, resource, supervisor)
        super().__init__()
        self._driver = config.driver
        self._ordinal = config.ordinal
        self._resource_spec = config.resource
        self._supervisor = config.supervisor
        self._lifecycle: DeviceLifecycle[DeviceContext] = DeviceLifecycle(DeviceState(self._ordinal))
        self._cell = ContextCell(self._ordinal, self.actor_ref, self._lifecycle)
        inbox = self.actor_inbox
        assert isinstance(inbox, CallerServedInbox)
        inbox.serve_in_caller((m.Allocate, m.AllocateMany), self._serve_in_caller, wake_types=(m.Reclaim,))
        self._subscribers: list[pykka.ActorRef[Any]] = []
        self._last_error: BaseException | None = None
        # Wake-ups that served a batch of queued allocations and frees (see on_batch).
        self._batches = 0
        self._batched_messages = 0
        self._largest_batch = 0
        # The memory history (RecordMemoryHistory): the device's, not a context's; each new
        # context's runtime records into it. ``_recording`` holds messages' origin capture on.
        self._history: MemoryHistory | None = None
        self._recording: contextlib.ExitStack | None = None
        # Pinned host memory is the device's, not a context's: it outlives rebuilds.
        self._pinned = PinnedAllocator(self._driver, self._ordinal)
        with _registry_lock:
            taken = _registry.setdefault(self._driver, {})
            if self._ordinal in taken:
                raise InvalidRequest(
                    f"device {self._ordinal} of this {self._driver.kind} driver already has a DeviceActor "
                    f"({taken[self._ordinal]}); one actor owns each ordinal"
                )
            taken[self._ordinal] = self.actor_urn

    @classmethod
    def start(cls, *args: Any, isolate: bool = False, **kwargs: Any) -> pykka.ActorRef[Any]:
        """Start the device actor of an ordinal and return its ``ActorRef``; arguments as
        :meth:`__init__`.

        With ``isolate=True`` the device lives in a child process of its own (spawned), behind a
        proxy actor in this process whose ``ActorRef`` is returned and stays valid across
        restarts of the child (``xlog_actors.actors.isolated``); ``driver`` is then a kind
        (``"auto"``, ``"cuda"``, ``"host"``) or None (the child follows ``XLOG_ACTORS_DRIVER``),
        ``ipc_pool=True`` gives a CUDA child an IPC-capable pool, and ``hot_spare`` (default True)
        has the reserve process open its driver and device ahead of need (``start_isolated``).

        Raises:
            InvalidRequest, DeviceUnavailable: as :meth:`__init__` (or, isolated, as
                ``start_isolated``); nothing is left running.
        Thread rule: any thread.
        """
        if type(isolate) is not bool:
            raise InvalidRequest(f"isolate must be a bool, got {isolate!r}")
        if not isolate and "ipc_pool" in kwargs:
            raise InvalidRequest(
                "ipc_pool is an option of isolate=True; an in-process device takes a CudaDriver(ipc_pool=True)"
            )
        if not isolate and "hot_spare" in kwargs:
            raise InvalidRequest("hot_spare is an option of isolate=True (the reserve process of an isolated device)")
        if isolate:
            from .isolated._proxy import start_isolated  # here: the isolated child imports this module

            return start_isolated(*args, **kwargs)
        return super().start(*args, **kwargs)

    @staticmethod
    def _create_actor_inbox() -> CallerServedInbox:
        """The inbox (pykka calls it): ``Allocate`` and ``AllocateMany`` asks that find the
        device idle are served in the asker's thread (see :meth:`_serve_in_caller`).
        Thread rule: any thread."""
        return CallerServedInbox()

    def _serve_in_caller(self, envelope: Any) -> Any:
        """Answer an ``Allocate``/``AllocateMany`` ask in the asker's thread, as the actor would:
        through the running context, which any thread may use (as ``DeviceClient`` does).

        Returns:
            None when answered. Else the envelope to queue: ``envelope`` itself, with nothing
            changed, when the actor must serve it (the device is not running or is being
            rebuilt, its context was reset from outside, a rebuild raced the allocation, or the
            history is recording: origins are the actor's bookkeeping); or, when the allocation
            raised, a ``FailedInCaller`` ask with the same reply, so that the
            actor's supervisor acts on the error before the asker gets it, as when a handler
            raises (an allocation that fails changes nothing, so it is not tried twice).
        Thread rule: the asking thread (``CallerServedInbox.put``), while the actor is idle.
        """
        if self._recording is not None:
            return envelope
        ctx = self._lifecycle.context
        if ctx is None or not ctx.is_current():
            return envelope
        try:
            # What the actor checks before every message: a primary context reset by another
            # library leaves the pool's handle dangling, and CUDA may crash on it (a segfault,
            # seen on an H200). The actor finds the reset again and rebuilds.
            self._driver.check_context(self._ordinal)
        except Exception:  # noqa: BLE001 - the actor's business
            return envelope
        if ctx.reclaims:
            # Dropped handles wait to be freed (perhaps with their Reclaim wake-up queued: the
            # inbox lets this ask by it): free them here first, as the actor would before any
            # message, so that what they held is free for this allocation.
            try:
                ctx.drain_reclaims()
            except Exception as exc:  # noqa: BLE001 - the supervisor's business, not this ask's
                self.actor_ref.tell(m.ReportFailure(exc, ctx.generation))
                return envelope
        msg = envelope.message
        tracer = ranges.RANGES
        if tracer is not None:
            tracer.push(type(self), type(msg))
        try:
            m.check_stream_and_tag(msg)
            if type(msg) is m.Allocate:
                value: Any = ctx.allocate(msg.nbytes, msg.stream, msg.tag)
            else:
                value = ctx.allocate_many(msg.sizes, msg.stream, msg.tag)
        except Exception as exc:  # noqa: BLE001 - answered through the actor, below
            if not ctx.is_current():
                return envelope  # a rebuild raced it (and may be why it failed): served anew
            return Envelope(m.FailedInCaller(exc, ctx.generation), reply_to=envelope.reply_to)
        finally:
            if tracer is not None:
                tracer.pop()
        if not ctx.is_current():
            return envelope  # a rebuild took the context meanwhile: those handles are stale
        envelope.reply_to.set(value)
        return None

    def _on_failed_in_caller(self, msg: m.FailedInCaller) -> None:
        # What _dispatch does with a handler's error: the supervisor acts (when the context the
        # error was met in is still the running one), then the asker gets the error.
        ctx = self._lifecycle.context
        if ctx is not None and msg.generation == ctx.generation:
            self._after_failure(msg.error, counting=True)
        raise SupervisedFailure(msg.error)

    @staticmethod
    def _create_future() -> LatchFuture:
        """The future of every ``ask`` of this actor (pykka calls it): a :class:`LatchFuture`,
        one lock where pykka's own future takes a condition. Thread rule: any thread."""
        return LatchFuture()

    def __repr__(self) -> str:
        return f"DeviceActor(device={self._ordinal}, driver={self._driver.kind}, status={self._lifecycle.status.value})"

    # -- pykka hooks ------------------------------------------------------------------------------
    def on_start(self) -> None:
        """Build the first context. Thread rule: the actor's thread (pykka calls it)."""
        # pykka calls no on_failure for an on_start that raises and stops the actor: catch
        # everything here so the device stays reachable and answers with a typed error.
        try:
            self._driver.make_current(self._ordinal)
            self._build()
        except BaseException as exc:  # noqa: BLE001 - routed to the supervisor
            self._after_failure(exc, counting=False)

    def on_stop(self) -> None:
        """Stop for good, freeing every live block, and give the ordinal back.
        Thread rule: the actor's thread (pykka calls it)."""
        # The inbox outlives the actor (every ActorRef holds it): it must not keep the actor.
        self.actor_inbox.serve_in_caller((), None)  # type: ignore[attr-defined]
        try:
            if self._lifecycle.status is not DeviceStatus.STOPPED:
                ctx = self._lifecycle.stop()
                if ctx is not None:
                    for error in ctx.close(free_blocks=True):
                        logger.warning("device %d: while stopping: %r", self._ordinal, error)
        finally:
            self._stop_recording()
            self._unregister()

    def on_receive(self, message: Any) -> Any:
        """Serve ``message``: the reply, or its typed error after the supervisor acted on it.

        Raises:
            InvalidRequest: a message this actor does not understand, or a malformed one.
            XlogError: the message's own error (see each message).
        Thread rule: the actor's thread (pykka calls it).
        """
        self._before_messages()
        return self._dispatch(message)

    #: Allocations and frees waiting together at the head of the inbox are served in one
    #: wake-up (see ``ResilientActor``): the checks ``on_receive`` makes before every other
    #: message run once for all of them (``on_batch``).
    batch_types = (m.Allocate, m.AllocateMany, m.Free)

    def on_batch(self, size: int) -> None:
        """Before a batch of ``size`` queued ``Allocate``/``AllocateMany``/``Free`` messages:
        the checks ``on_receive`` makes before a single message, once, and the batch counted in
        ``DeviceStats``. Thread rule: the actor's thread (the loop calls it)."""
        self._batches += 1
        self._batched_messages += size
        if size > self._largest_batch:
            self._largest_batch = size
        self._before_messages()

    def on_receive_batched(self, message: Any) -> Any:
        """Serve one message of a batch (``on_batch`` made the checks). Raises as
        :meth:`on_receive`. Thread rule: the actor's thread (the loop calls it)."""
        return self._dispatch(message)

    def _before_messages(self) -> None:
        """What every wake-up does before it serves its message(s): find a context reset from
        outside, and free the blocks of dropped handles. Raises nothing: a failure is the
        supervisor's business, not the message's."""
        if self._lifecycle.status is DeviceStatus.RUNNING:
            # A context reset from outside (another library) is found here, before a dangling
            # handle reaches the driver: the supervisor rebuilds, and this message is served by
            # the new context.
            try:
                self._driver.check_context(self._ordinal)
            except XlogError as exc:
                self._after_failure(exc, counting=True)
        ctx = self._lifecycle.context
        if ctx is not None and ctx.reclaims:
            # Frees of dropped handles ride along with whatever message comes next (see
            # DeviceContext.reclaim); one that fails is the supervisor's business, not this
            # message's.
            try:
                ctx.drain_reclaims()
            except Exception as exc:
                logger.warning("device %d: freeing dropped handles failed: %r", self._ordinal, exc, exc_info=exc)
                self._after_failure(exc, counting=True)

    def _dispatch(self, message: Any) -> Any:
        name = self._handlers.get(type(message))
        if name is None:
            raise InvalidRequest(
                f"DeviceActor {self._ordinal} does not understand {type(message).__name__} messages; "
                f"expected {_PUBLIC_MESSAGES}"
            )
        try:
            return getattr(self, name)(message)
        except SupervisedFailure as wrapped:
            error = wrapped.error
            raise error from error.__cause__
        except BaseException as exc:
            self._after_failure(exc, counting=True)
            raise

    # -- supervision ------------------------------------------------------------------------------
    def _after_failure(self, exc: BaseException, *, counting: bool) -> None:
        """Apply the supervisor's directive for ``exc``."""
        self._last_error = _detached(exc)
        directive = self._supervisor.decide(exc)
        if isinstance(exc, DeviceUnavailable) and self._lifecycle.context is None:
            self._stop_for_good(exc)
            return
        if directive is Directive.RESUME:
            return
        if self._lifecycle.ended:
            # Nothing left to rebuild or poison: every request is already answered with the
            # device's final status.
            logger.warning("device %d: %r after it ended (%s)", self._ordinal, exc, self._lifecycle.status.value)
            return
        if directive is Directive.POISON:
            self._poison(exc)
            return
        logger.warning("device %d: %r; rebuilding the context", self._ordinal, exc)
        if counting and not self._supervisor.allow_restart(self._ordinal):
            self._stop_for_good(exc)
            return
        self._try_rebuild(reason=repr(exc))

    def _try_rebuild(self, reason: str) -> None:
        try:
            self._rebuild(reason)
        except ContextPoisoned as exc:
            self._poison(exc)
        except BaseException as exc:  # noqa: BLE001 - left broken; the next request retries
            self._mark_broken(exc)
            logger.error("device %d: rebuild failed: %r", self._ordinal, exc)

    def _mark_broken(self, exc: BaseException) -> None:
        self._last_error = _detached(exc)
        if self._lifecycle.status is DeviceStatus.REBUILDING:
            self._lifecycle.rebuild_failed()

    def _build(self) -> None:
        spec = self._resource_spec
        if isinstance(spec, str):
            runtime = XlogDeviceRuntime.build(self._driver, self._ordinal, spec)
        else:
            pool = StreamPool(self._driver, self._ordinal)
            try:
                resource = spec(self._driver, self._ordinal, pool)
            except BaseException:
                pool.close()
                raise
            runtime = XlogDeviceRuntime.with_resource(self._driver, self._ordinal, pool, resource)
        if self._recording is not None:
            try:
                runtime.set_history(self._history)
            except InvalidRequest as exc:  # a factory's new stack cannot record: say so, run anyway
                logger.warning("device %d: the memory history stops: %s", self._ordinal, exc)
        self._lifecycle.built(DeviceContext(runtime, self._lifecycle.state, self.actor_ref))

    def _rebuild(self, reason: str) -> int:
        old, generation = self._lifecycle.begin_rebuild()  # every older handle is stale from here on
        if old is not None:
            # No frees block by block: the driver's rebuild below frees everything it allocated
            # in the context at once (and after a reset from outside there is nothing to free).
            for error in old.close(free_blocks=False):
                logger.debug("device %d: closing generation %d: %r", self._ordinal, old.generation, error)
        if self._history is not None:
            self._history.forget_device(self._ordinal, "context rebuilt")
        self._driver.rebuild_context(self._ordinal)
        self._driver.make_current(self._ordinal)
        self._build()
        logger.info("device %d: context rebuilt, generation %d (%s)", self._ordinal, generation, reason or "no reason")
        self._notify(m.GenerationChanged(self._ordinal, generation, DeviceStatus.RUNNING.value))
        return generation

    def _poison(self, exc: BaseException) -> None:
        if self._lifecycle.ended:
            return
        ctx = self._lifecycle.poison()
        if ctx is not None:
            ctx.open = False  # nothing can be freed into a poisoned context
        self._notify(m.GenerationChanged(self._ordinal, self._lifecycle.state.generation, DeviceStatus.POISONED.value))
        try:
            self._supervisor.on_poisoned(self._ordinal, exc)
        except Exception as hook_error:  # noqa: BLE001 - a failing hook must not kill the device
            logger.error("device %d: on_poisoned hook failed: %r", self._ordinal, hook_error)

    def _stop_for_good(self, exc: BaseException) -> None:
        if self._lifecycle.status is DeviceStatus.STOPPED:
            return  # already: no second log line or notification
        logger.error("device %d: stopped for good after %r", self._ordinal, exc)
        ctx = self._lifecycle.stop()
        if ctx is not None:
            ctx.close(free_blocks=False)
            if self._history is not None:
                self._history.forget_device(self._ordinal, "device stopped")
        self._notify(m.GenerationChanged(self._ordinal, self._lifecycle.state.generation, DeviceStatus.STOPPED.value))

    def _notify(self, message: m.GenerationChanged) -> None:
        self._subscribers = tell_subscribers(self._subscribers, message)

    def _unregister(self) -> None:
        with _registry_lock:
            taken = _registry.get(self._driver)
            if taken is not None and taken.get(self._ordinal) == self.actor_urn:
                del taken[self._ordinal]

    def _context(self) -> DeviceContext:
        """The running context; a broken one is rebuilt first, with one attempt per request
        (a request must not spend the whole restart intensity on its own); else the status's
        typed error. The errors raised here are answers, not new failures: they are wrapped in
        ``SupervisedFailure`` so that ``on_receive`` does not act on them again."""
        lifecycle = self._lifecycle
        ctx = lifecycle.context
        if ctx is not None:
            return ctx
        if lifecycle.needs_build:
            if not self._supervisor.allow_restart(self._ordinal):
                error = DeviceUnavailable(f"device {self._ordinal}: restart intensity exceeded: {self._last_error!r}")
                self._stop_for_good(error)
                raise SupervisedFailure(error)
            self._try_rebuild(reason=f"broken context: {self._last_error!r}")
            ctx = lifecycle.context
            if ctx is not None:
                return ctx
        raise SupervisedFailure(self._status_error())

    def _status_error(self) -> XlogError:
        """The typed error of a device that has no running context."""
        status = self._lifecycle.status
        if status is DeviceStatus.POISONED:
            return ContextPoisoned(
                f"device {self._ordinal} is poisoned: {self._last_error!r}",
                code=getattr(self._last_error, "code", None),
            )
        if status is DeviceStatus.STOPPED:
            return DeviceUnavailable(f"device {self._ordinal} was stopped for good: {self._last_error!r}")
        error = DeviceUnavailable(
            f"device {self._ordinal}: its context could not be rebuilt ({self._last_error!r}); "
            "the next request tries again"
        )
        error.__cause__ = self._last_error
        return error

    # -- handlers ---------------------------------------------------------------------------------
    def _on_allocate(self, msg: m.Allocate) -> GpuRef:
        m.check_stream_and_tag(msg)
        ctx = self._context()
        if self._recording is None or msg.origin is None:
            return ctx.allocate(msg.nbytes, msg.stream, msg.tag)
        assert self._history is not None
        with self._history.asked_from(msg.origin):  # the asker's stack, not this thread's
            return ctx.allocate(msg.nbytes, msg.stream, msg.tag)

    def _on_allocate_many(self, msg: m.AllocateMany) -> list[GpuRef]:
        m.check_stream_and_tag(msg)
        ctx = self._context()
        if self._recording is None or msg.origin is None:
            return ctx.allocate_many(msg.sizes, msg.stream, msg.tag)
        assert self._history is not None
        with self._history.asked_from(msg.origin):
            return ctx.allocate_many(msg.sizes, msg.stream, msg.tag)

    def _on_allocate_pinned(self, msg: m.AllocatePinned) -> PinnedBuffer:
        # Checked before the context: a bad request is refused whatever the device's status.
        if isinstance(msg.nbytes, bool) or not isinstance(msg.nbytes, int) or msg.nbytes <= 0:
            raise InvalidRequest(f"AllocatePinned.nbytes must be a positive int, got {msg.nbytes!r}")
        if not isinstance(msg.tag, str):
            raise InvalidRequest(f"AllocatePinned.tag must be an AllocTag (a str), got {msg.tag!r}")
        self._context()  # a device that is not running answers with its status's error
        return self._pinned.allocate(msg.nbytes, msg.tag)

    def _on_free(self, msg: m.Free) -> None:
        ref = msg.ref
        if not isinstance(ref, GpuRef):
            raise InvalidRequest(f"Free.ref must be a GpuRef, got {type(ref).__name__}")
        m.check_origin(msg)
        if ref.context.state_ref() is not self._lifecycle.state:
            raise InvalidRequest(
                f"Free: {ref!r} belongs to another device actor (device {ref.block.device_ordinal}), "
                f"not to device {self._ordinal}"
            )
        ctx = self._lifecycle.context
        if ctx is None or ref.context is not ctx:
            ref._mark_released()  # an older generation: its memory went with its context
            return
        if ref._mark_released():
            try:
                if self._recording is not None and msg.origin is not None:
                    assert self._history is not None
                    with self._history.asked_from(msg.origin):
                        ctx.free(ref.block)
                else:
                    ctx.free(ref.block)
            except CorruptionDetected:
                raise  # the guard freed the block before it reported: the handle stays released
            except BaseException:
                ref._unmark_released()
                raise

    def _on_reclaim(self, msg: m.Reclaim) -> None:
        # A wake-up: the block is in its context's queue (an earlier drain may have freed it).
        ctx = self._lifecycle.context
        if ctx is not None and msg.generation == ctx.generation:
            ctx.drain_reclaims()

    def _on_rebuild(self, msg: m.Rebuild) -> int:
        if not isinstance(msg.reason, str):
            raise InvalidRequest(f"Rebuild.reason must be a str, got {type(msg.reason).__name__}")
        if self._lifecycle.ended:
            status = self._lifecycle.status
            if status is DeviceStatus.POISONED:
                error: XlogError = ContextPoisoned(f"device {self._ordinal} is poisoned; a rebuild needs a new process")
            else:
                error = DeviceUnavailable(f"device {self._ordinal} was stopped for good")
            raise SupervisedFailure(error)
        try:
            return self._rebuild(msg.reason)
        except ContextPoisoned as exc:
            self._poison(exc)
            raise SupervisedFailure(exc) from None
        except BaseException as exc:  # noqa: BLE001 - handed to the asker, wrapped
            self._mark_broken(exc)
            raise SupervisedFailure(exc) from None

    def _on_subscribe(self, msg: m.Subscribe) -> None:
        m.check_actor_ref(msg)
        if msg.actor_ref not in self._subscribers:
            self._subscribers.append(msg.actor_ref)

    def _on_unsubscribe(self, msg: m.Unsubscribe) -> None:
        m.check_actor_ref(msg)
        if msg.actor_ref in self._subscribers:
            self._subscribers.remove(msg.actor_ref)

    def _on_stats(self, msg: m.GetStats) -> m.DeviceStats:
        ctx = self._lifecycle.context
        status = self._lifecycle.status
        mem_free = mem_total = None
        outstanding = live = 0
        stack = ""
        report: dict[str, Any] = {}
        if ctx is not None:
            try:
                ctx.drain_reclaims()
                ctx.runtime.reap_pending()
                outstanding = ctx.runtime.bytes_outstanding()
                live = ctx.live_count()
                stack = ctx.runtime.describe()
                mem_free, mem_total = self._driver.mem_info(self._ordinal)
                cached = self._cell.cache_shares.usage()
                report = memory_report(ctx.runtime.resource, self._pinned.usage(), cached).as_dict()
                del report["blocks"]  # the groups say it in a size that does not grow per block
            except (ContextLost, ContextPoisoned) as exc:
                # A report is what a caller asks for to learn the device's state: act on the
                # failure, then report the state it left.
                self._after_failure(exc, counting=True)
                return self._on_stats(msg)
        pinned = self._pinned.usage()
        return m.DeviceStats(
            device_id=self._ordinal,
            generation=self._lifecycle.state.generation,
            bytes_outstanding=outstanding,
            live_blocks=live,
            restarts=self._lifecycle.restarts,
            status=status.value,
            driver=self._driver.kind,
            stack=stack,
            mem_free=mem_free,
            mem_total=mem_total,
            report=report,
            pinned_count=pinned.count,
            pinned_bytes=pinned.nbytes,
            pinned_by_tag=pinned.as_dict()["by_tag"],
            batches=self._batches,
            batched_messages=self._batched_messages,
            largest_batch=self._largest_batch,
        )

    def _on_report(self, _msg: m.GetReport) -> MemoryReport:
        ctx = self._context()
        ctx.drain_reclaims()
        return memory_report(ctx.runtime.resource, self._pinned.usage(), self._cell.cache_shares.usage())

    def _on_record_history(self, msg: m.RecordMemoryHistory) -> None:
        # Everything is checked before anything changes.
        if not isinstance(msg.enabled, bool):
            raise InvalidRequest(f"RecordMemoryHistory.enabled must be a bool, got {msg.enabled!r}")
        check_max_entries(msg.max_entries, "RecordMemoryHistory.max_entries")
        ctx = self._lifecycle.context
        if not msg.enabled:
            if ctx is not None and self._recording is not None:
                ctx.runtime.set_history(None)
            self._stop_recording()
            return
        if self._recording is not None:
            assert self._history is not None
            self._history.resize(msg.max_entries)
            return
        history = MemoryHistory(msg.max_entries)
        if ctx is not None:
            ctx.runtime.set_history(history)  # InvalidRequest for a base that cannot record: nothing changed
        self._history = history
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(origin_capture())

    def _stop_recording(self) -> None:
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def _on_memory_snapshot(self, _msg: m.GetMemorySnapshot) -> dict[str, Any]:
        # Dropped handles were freed (and recorded) before this message, as before every one.
        if self._history is None:
            return MemoryHistory(1).snapshot()
        return self._history.snapshot()

    def _on_client(self, _msg: m.GetClient) -> DeviceClient:
        return DeviceClient(self._cell)

    def _on_attach(self, _msg: m.Attach) -> DeviceContext:
        return self._context()

    def _on_report_failure(self, msg: m.ReportFailure) -> None:
        if not isinstance(msg.error, BaseException):
            raise InvalidRequest(f"ReportFailure.error must be an exception, got {type(msg.error).__name__}")
        ctx = self._lifecycle.context
        if ctx is not None and msg.generation in (None, ctx.generation):
            self._after_failure(msg.error, counting=True)
