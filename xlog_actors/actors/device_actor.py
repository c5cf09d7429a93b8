"""``DeviceActor``: one pykka actor per device ordinal, owning its context, generation counter
and resource stack, behind an ``ActorRef`` that stays valid across context rebuilds."""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import pykka

from ..driver.open import default_driver
from ..driver.protocol import Driver
from ..errors import (
    ContextLost,
    ContextPoisoned,
    CorruptionDetected,
    DeviceUnavailable,
    InvalidRequest,
    XlogError,
)
from ..memory.report import MemoryReport, memory_report
from ..memory.resource import DeviceMemoryResource
from ..memory.stream_pool import StreamPool
from ..runtime.device_runtime import XlogDeviceRuntime, check_device_ordinal
from .device_client import DeviceClient
from .device_context import DeviceContext
from .device_state import DeviceState
from .gpu_ref import GpuRef
from .messages import (
    Allocate,
    AllocateMany,
    Attach,
    DeviceStats,
    Free,
    GenerationChanged,
    GetClient,
    GetReport,
    GetStats,
    Rebuild,
    Reclaim,
    Subscribe,
    Unsubscribe,
)
from .supervisor import Directive, Supervisor

__all__ = ["ContextCell", "DeviceActor", "ReportFailure", "ResourceSpec"]

logger = logging.getLogger("xlog_actors.device")
pykka_logger = logging.getLogger("pykka")  # where pykka's own loop logs

ResourceFactory = Callable[[Driver, int, StreamPool], DeviceMemoryResource]
ResourceSpec = str | ResourceFactory | None

_registry_lock = threading.Lock()
_registry: weakref.WeakKeyDictionary[Driver, dict[int, str]] = weakref.WeakKeyDictionary()


class ReportFailure:
    """Internal: a ``DeviceClient`` or a library actor met a context failure in another
    thread. ``generation`` is the context it met it in (None: the current one); a report about
    an older context is ignored, since a rebuild already replaced it."""

    __slots__ = ("error", "generation")

    def __init__(self, error: BaseException, generation: int | None) -> None:
        self.error = error
        self.generation = generation


class ContextCell:
    """What a ``DeviceClient`` shares with its actor: the current context and status.
    Swapped by the actor only; read by clients with single attribute loads."""

    __slots__ = ("actor_ref", "ctx", "ordinal", "status")

    def __init__(self, ordinal: int, actor_ref: pykka.ActorRef[Any]) -> None:
        self.ctx: DeviceContext | None = None
        self.status = "starting"
        self.ordinal = ordinal
        self.actor_ref = actor_ref

    def report_failure(self, error: BaseException, generation: int) -> None:
        try:
            self.actor_ref.tell(ReportFailure(error, generation))
        except pykka.ActorDeadError:
            pass  # the device is gone; the caller already has its error


class DeviceActor(pykka.ThreadingActor):
    """See the module docstring and SPEC section 6.

    Status: ``running``; ``broken`` (the context is gone and the next request rebuilds it);
    ``poisoned`` (a sticky error: every request answered with ``ContextPoisoned``); ``stopped``
    (past the restart intensity or stopped by its hook: ``DeviceUnavailable``). A device that is
    not running still answers every message; it never dies of a bad request.

    Thread rules: handlers run on the actor's thread, where ``on_start`` made the context
    current. ``DeviceClient``s allocate from other threads through the same runtime.
    """

    def __init__(
        self,
        ordinal: int = 0,
        driver: Driver | None = None,
        resource: ResourceSpec = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        super().__init__()
        self._driver: Driver = driver if driver is not None else default_driver()
        self._ordinal = check_device_ordinal(ordinal, self._driver)
        if resource is not None and not isinstance(resource, str) and not callable(resource):
            raise InvalidRequest(f"resource must be a stack description or a factory, got {resource!r}")
        self._resource_spec = resource
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._state = DeviceState(self._ordinal)
        self._cell = ContextCell(self._ordinal, self.actor_ref)
        self._restarts = 0
        self._subscribers: list[pykka.ActorRef[Any]] = []
        self._last_error: BaseException | None = None
        with _registry_lock:
            taken = _registry.setdefault(self._driver, {})
            if self._ordinal in taken:
                raise InvalidRequest(
                    f"device {self._ordinal} of this {self._driver.kind} driver already has a DeviceActor "
                    f"({taken[self._ordinal]}); one actor owns each ordinal"
                )
            taken[self._ordinal] = self.actor_urn
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Allocate: self._on_allocate,
            AllocateMany: self._on_allocate_many,
            Free: self._on_free,
            Rebuild: self._on_rebuild,
            Subscribe: self._on_subscribe,
            Unsubscribe: self._on_unsubscribe,
            GetStats: self._on_stats,
            GetClient: self._on_client,
            GetReport: self._on_report,
            Attach: self._on_attach,
            Reclaim: self._on_reclaim,
            ReportFailure: self._on_report_failure,
        }

    def __repr__(self) -> str:
        return f"DeviceActor(device={self._ordinal}, driver={self._driver.kind}, status={self._cell.status})"

    # -- lifecycle ------------------------------------------------------------------------------
    def on_start(self) -> None:
        # pykka calls no on_failure for an on_start that raises and stops the actor: catch
        # everything here so the device stays reachable and answers with a typed error.
        try:
            self._driver.make_current(self._ordinal)
            self._build()
        except BaseException as exc:  # noqa: BLE001 - routed to the supervisor
            self._after_failure(exc, counting=False)

    def on_stop(self) -> None:
        self._state.begin_shutdown()
        ctx, self._cell.ctx = self._cell.ctx, None
        self._cell.status = "stopped"
        if ctx is not None:
            for error in ctx.close(free_blocks=True):
                logger.warning("device %d: while stopping: %r", self._ordinal, error)
        self._unregister()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # pykka calls this after a told message raised; ``_handle_failure`` below kept the actor
        # running, so it still owns its ordinal. Unregistering here would let a second actor
        # take the ordinal while this one lives on.
        if self.actor_stopped.is_set():
            self._unregister()

    def _handle_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # pykka stops an actor whose ``tell`` handler raised. A device must outlive a bad
        # message: the supervisor already acted on the error in on_receive; log and go on.
        logger.warning(
            "device %d: a told message failed: %r", self._ordinal, exception_value,
            exc_info=(exception_type, exception_value, traceback),  # type: ignore[arg-type]
        )

    def _actor_loop_running(self) -> None:
        # pykka's loop (4.x), with one change: the envelope and the reply are dropped as soon as
        # the reply is set. pykka keeps both in locals until the next message has been handled,
        # so the GpuRefs of an Allocate reply (or of a reply whose asker timed out) stayed alive
        # through the next message: a GetStats sent right after the caller dropped them still
        # counted them. Failure handling is pykka's, unchanged.
        while not self.actor_stopped.is_set():
            envelope = self.actor_inbox.get()
            try:
                response = self._handle_receive(envelope.message)
                if envelope.reply_to is not None:
                    envelope.reply_to.set(response)
            except Exception:
                if envelope.reply_to is not None:
                    pykka_logger.info(f"Exception returned from {self} to caller:", exc_info=sys.exc_info())
                    envelope.reply_to.set_exception()
                else:
                    self._handle_failure(*sys.exc_info())
                    try:
                        self.on_failure(*sys.exc_info())
                    except Exception:  # noqa: BLE001
                        self._handle_failure(*sys.exc_info())
            except BaseException:  # noqa: BLE001
                pykka_logger.debug(f"{sys.exc_info()[1]!r} in {self}. Stopping all actors.")
                self._stop()
                pykka.ActorRegistry.stop_all()
            envelope = response = None  # type: ignore[assignment]

    def _unregister(self) -> None:
        with _registry_lock:
            taken = _registry.get(self._driver)
            if taken is not None and taken.get(self._ordinal) == self.actor_urn:
                del taken[self._ordinal]

    def _build(self) -> None:
        spec = self._resource_spec
        if spec is None or isinstance(spec, str):
            runtime = XlogDeviceRuntime.build(self._driver, self._ordinal, spec)
        else:
            pool = StreamPool(self._driver, self._ordinal)
            try:
                resource = spec(self._driver, self._ordinal, pool)
            except BaseException:
                pool.close()
                raise
            runtime = XlogDeviceRuntime.with_resource(self._driver, self._ordinal, pool, resource)
        self._cell.ctx = DeviceContext(runtime, self._state, self.actor_ref)
        self._cell.status = "running"

    # -- dispatch and supervision -----------------------------------------------------------------
    def on_receive(self, message: Any) -> Any:
        if self._cell.status == "running":
            # A context reset from outside (another library) is found here, before a dangling
            # handle reaches the driver: the supervisor rebuilds, and this message is served by
            # the new context.
            try:
                self._driver.check_context(self._ordinal)
            except XlogError as exc:
                self._after_failure(exc, counting=True)
        ctx = self._cell.ctx
        if ctx is not None and ctx.reclaims:
            # Frees of dropped handles ride along with whatever message comes next (see
            # DeviceContext.reclaim); one that fails is the supervisor's business, not this
            # message's.
            try:
                ctx.drain_reclaims()
            except Exception as exc:
                logger.warning("device %d: freeing dropped handles failed: %r", self._ordinal, exc, exc_info=exc)
                self._after_failure(exc, counting=True)
        handler = self._handlers.get(type(message))
        if handler is None:
            raise InvalidRequest(f"DeviceActor {self._ordinal} does not understand {type(message).__name__} messages")
        try:
            return handler(message)
        except BaseException as exc:
            if not getattr(exc, "_xlog_supervised", False):
                self._after_failure(exc, counting=True)
            raise

    def _after_failure(self, exc: BaseException, *, counting: bool) -> None:
        """Apply the supervisor's directive for ``exc``."""
        try:
            exc._xlog_supervised = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        self._last_error = exc
        directive = self._supervisor.decide(exc)
        if isinstance(exc, DeviceUnavailable) and self._cell.ctx is None:
            self._stop_for_good(exc)
            return
        if directive is Directive.RESUME:
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
            self._last_error = exc
            self._cell.status = "broken"
            logger.error("device %d: rebuild failed: %r", self._ordinal, exc)

    def _rebuild(self, reason: str) -> int:
        old, self._cell.ctx = self._cell.ctx, None
        generation = self._state.bump_generation()  # every older handle is stale from here on
        self._cell.status = "broken"
        if old is not None:
            # No frees block by block: the driver's rebuild below frees everything it allocated
            # in the context at once (and after a reset from outside there is nothing to free).
            for error in old.close(free_blocks=False):
                logger.debug("device %d: closing generation %d: %r", self._ordinal, old.generation, error)
        self._driver.rebuild_context(self._ordinal)
        self._driver.make_current(self._ordinal)
        self._build()
        self._restarts += 1
        logger.info("device %d: context rebuilt, generation %d (%s)", self._ordinal, generation, reason or "no reason")
        self._notify(GenerationChanged(self._ordinal, generation, "running"))
        return generation

    def _poison(self, exc: BaseException) -> None:
        if self._cell.status == "poisoned":
            return
        self._state.poison()
        ctx, self._cell.ctx = self._cell.ctx, None
        if ctx is not None:
            ctx.open = False  # nothing can be freed into a poisoned context
        self._cell.status = "poisoned"
        self._notify(GenerationChanged(self._ordinal, self._state.generation, "poisoned"))
        try:
            self._supervisor.on_poisoned(self._ordinal, exc)
        except Exception as hook_error:  # noqa: BLE001 - a failing hook must not kill the device
            logger.error("device %d: on_poisoned hook failed: %r", self._ordinal, hook_error)

    def _stop_for_good(self, exc: BaseException) -> None:
        if self._cell.status == "stopped":
            return  # already: no second log line or notification
        logger.error("device %d: stopped for good after %r", self._ordinal, exc)
        self._state.begin_shutdown()
        ctx, self._cell.ctx = self._cell.ctx, None
        self._cell.status = "stopped"
        if ctx is not None:
            ctx.close(free_blocks=False)
        self._notify(GenerationChanged(self._ordinal, self._state.generation, "stopped"))

    def _notify(self, message: GenerationChanged) -> None:
        alive = []
        for subscriber in self._subscribers:
            try:
                subscriber.tell(message)
                alive.append(subscriber)
            except pykka.ActorDeadError:
                pass  # a stopped subscriber unsubscribes itself this way
        self._subscribers = alive

    def _context(self) -> DeviceContext:
        """The running context; a broken one is rebuilt first, with one attempt per request
        (a request must not spend the whole restart intensity on its own); else the status's
        typed error. The errors raised here are answers, not new failures: they are marked as
        supervised so that ``on_receive`` does not act on them again."""
        ctx = self._cell.ctx
        if self._cell.status == "running" and ctx is not None:
            return ctx
        if self._cell.status in ("broken", "starting"):
            if not self._supervisor.allow_restart(self._ordinal):
                error = DeviceUnavailable(f"device {self._ordinal}: restart intensity exceeded: {self._last_error!r}")
                self._stop_for_good(error)
                raise _supervised(error)
            self._try_rebuild(reason=f"broken context: {self._last_error!r}")
            ctx = self._cell.ctx
            if self._cell.status == "running" and ctx is not None:
                return ctx
        status = self._cell.status
        if status == "poisoned":
            raise _supervised(
                ContextPoisoned(
                    f"device {self._ordinal} is poisoned: {self._last_error!r}",
                    code=getattr(self._last_error, "code", None),
                )
            )
        if status == "stopped":
            raise _supervised(DeviceUnavailable(f"device {self._ordinal} was stopped for good: {self._last_error!r}"))
        raise _supervised(
            DeviceUnavailable(
                f"device {self._ordinal}: its context could not be rebuilt ({self._last_error!r}); "
                "the next request tries again"
            )
        ) from self._last_error

    # -- handlers ---------------------------------------------------------------------------------
    def _on_allocate(self, msg: Allocate) -> GpuRef:
        return self._context().allocate(msg.nbytes, msg.stream, msg.tag)

    def _on_allocate_many(self, msg: AllocateMany) -> list[GpuRef]:
        return self._context().allocate_many(msg.sizes, msg.stream, msg.tag)

    def _on_free(self, msg: Free) -> None:
        ref = msg.ref
        if not isinstance(ref, GpuRef):
            raise InvalidRequest(f"Free needs a GpuRef, got {type(ref).__name__}")
        if ref.context.state_ref() is not self._state:
            raise InvalidRequest(
                f"Free: {ref!r} belongs to another device actor (device {ref.block.device_ordinal}), "
                f"not to device {self._ordinal}"
            )
        ctx = self._cell.ctx
        if ref.context is not ctx:
            ref._mark_released()  # an older generation: its memory went with its context
            return
        if ref._mark_released():
            try:
                ctx.free(ref.block)
            except CorruptionDetected:
                raise  # the guard freed the block before it reported: the handle stays released
            except BaseException:
                ref._unmark_released()
                raise

    def _on_reclaim(self, msg: Reclaim) -> None:
        # A wake-up: the block is in its context's queue (an earlier drain may have freed it).
        ctx = self._cell.ctx
        if ctx is not None and msg.generation == ctx.generation:
            ctx.drain_reclaims()

    def _on_rebuild(self, msg: Rebuild) -> int:
        status = self._cell.status
        if status == "poisoned":
            raise _supervised(ContextPoisoned(f"device {self._ordinal} is poisoned; a rebuild needs a new process"))
        if status == "stopped":
            raise _supervised(DeviceUnavailable(f"device {self._ordinal} was stopped for good"))
        try:
            return self._rebuild(msg.reason)
        except ContextPoisoned as exc:
            self._poison(exc)
            exc._xlog_supervised = True  # type: ignore[attr-defined]
            raise
        except BaseException as exc:
            self._last_error = exc
            self._cell.status = "broken"
            exc._xlog_supervised = True  # type: ignore[attr-defined]
            raise

    def _on_subscribe(self, msg: Subscribe) -> None:
        if not isinstance(msg.actor_ref, pykka.ActorRef):
            raise InvalidRequest(f"Subscribe needs a pykka ActorRef, got {type(msg.actor_ref).__name__}")
        if msg.actor_ref not in self._subscribers:
            self._subscribers.append(msg.actor_ref)

    def _on_unsubscribe(self, msg: Unsubscribe) -> None:
        if msg.actor_ref in self._subscribers:
            self._subscribers.remove(msg.actor_ref)

    def _on_stats(self, _msg: GetStats) -> DeviceStats:
        ctx = self._cell.ctx
        status = self._cell.status
        mem_free = mem_total = None
        outstanding = live = 0
        stack = ""
        report: dict[str, Any] = {}
        if ctx is not None and status == "running":
            try:
                ctx.drain_reclaims()
                ctx.runtime.reap_pending()
                outstanding = ctx.runtime.bytes_outstanding()
                live = len(ctx.blocks)
                stack = ctx.runtime.describe()
                mem_free, mem_total = self._driver.mem_info(self._ordinal)
                report = memory_report(ctx.runtime.resource).as_dict()
                del report["blocks"]  # the groups say it in a size that does not grow per block
            except (ContextLost, ContextPoisoned) as exc:
                # A report is what a caller asks for to learn the device's state: act on the
                # failure, then report the state it left.
                self._after_failure(exc, counting=True)
                return self._on_stats(_msg)
        return DeviceStats(
            device_id=self._ordinal,
            generation=self._state.generation,
            bytes_outstanding=outstanding,
            live_blocks=live,
            restarts=self._restarts,
            status=status,
            driver=self._driver.kind,
            stack=stack,
            mem_free=mem_free,
            mem_total=mem_total,
            report=report,
        )

    def _on_report(self, _msg: GetReport) -> MemoryReport:
        ctx = self._context()
        ctx.drain_reclaims()
        return memory_report(ctx.runtime.resource)

    def _on_client(self, _msg: GetClient) -> DeviceClient:
        return DeviceClient(self._cell)

    def _on_attach(self, _msg: Attach) -> DeviceContext:
        return self._context()

    def _on_report_failure(self, msg: ReportFailure) -> None:
        ctx = self._cell.ctx
        if ctx is not None and msg.generation in (None, ctx.generation):
            self._after_failure(msg.error, counting=True)


def _supervised(exc: BaseException) -> BaseException:
    """Mark ``exc`` as already acted on, so ``on_receive`` only passes it to the asker."""
    exc._xlog_supervised = True  # type: ignore[attr-defined]
    return exc
