"""``DeviceClient``: direct, thread-safe allocation without an actor round trip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pykka

from .._core.client_core import ClientCore
from ..errors import (
    ContextLost,
    ContextPoisoned,
    CorruptionDetected,
    DeviceUnavailable,
    InvalidRequest,
)
from ..memory.block import AllocTag, StreamId
from ..memory.cache_share import CacheShares
from .device_context import DeviceContext
from .gpu_ref import GpuRef
from .lifecycle import DeviceLifecycle
from .messages import Allocate, AllocateMany, Free, ReportFailure

__all__ = ["ContextCell", "DeviceClient"]


class ContextCell:
    """What a ``DeviceClient`` shares with its device actor: the device's lifecycle (its status
    and current context), its ordinal, the actor's ref, and ``cache_shares``, where caches above
    the device (``xlog_actors.interop``) say what they hold idle, for its memory reports.

    Thread rule: the actor alone changes the lifecycle; clients read it from any thread with
    single attribute loads, and ``report_failure`` and ``cache_shares`` may be used from any
    thread.
    """

    __slots__ = ("actor_ref", "cache_shares", "lifecycle", "ordinal")

    def __init__(self, ordinal: int, actor_ref: pykka.ActorRef[Any], lifecycle: DeviceLifecycle[DeviceContext]) -> None:
        """Args:
            ordinal: the device's ordinal.
            actor_ref: the device actor's ref (the slow path and failure reports go there).
            lifecycle: the device's lifecycle, owned by the actor.
        Thread rule: any thread (the actor makes one in its constructor).
        """
        self.ordinal = ordinal
        self.actor_ref = actor_ref
        self.lifecycle = lifecycle
        self.cache_shares = CacheShares()

    def report_failure(self, error: BaseException, generation: int) -> None:
        """Tell the device's supervisor about a context failure met outside the actor.

        Args:
            error: the ``ContextLost``/``ContextPoisoned`` met.
            generation: the generation of the context it was met in.
        Thread rule: any thread. A stopped device is not told (the caller already has its error).
        """
        try:
            self.actor_ref.tell(ReportFailure(error, generation))
        except pykka.ActorDeadError:
            pass  # the device is gone; the caller already has its error


class DeviceClient(ClientCore):
    """Allocates through the device's current runtime in the calling thread.

    A pykka ``ask`` costs about fifteen raw allocations; code that allocates in a loop uses a
    client (``device.ask(GetClient())``) instead. It yields the same ``GpuRef``s as ``Allocate``:
    same generation, same validation, frees handed back to the actor. It follows rebuilds (it
    reads the actor's current context on every call), and a context loss or poisoning it meets
    is reported to the actor, whose supervisor then acts as if the actor had met it.

    While the device has no running context (a rebuild in progress, a broken, poisoned or
    stopped device) a call goes through the actor instead, as the matching message: it then
    waits for the rebuild, or gets the status's typed error, exactly like an ``ask``. A call
    whose context a rebuild took away while it ran is retried the same way, so a client never
    hands out a handle that is stale from birth.

    ``allocate`` and ``free`` are compiled
    (:class:`~xlog_actors._core.client_core.ClientCore`); their slow paths, and everything else,
    are here.

    Thread rules: any thread, any number of threads at once (not the device actor's own
    thread: the slow path asks that actor).
    """

    __slots__ = ()

    def __init__(self, cell: ContextCell) -> None:
        """Args:
            cell: what the client shares with its device actor.
        Thread rule: the device actor's thread (it hands clients out through ``GetClient``).
        """
        super().__init__(cell, GpuRef)

    def _current(self) -> DeviceContext | None:
        ctx = self._cell.lifecycle.context
        return ctx if ctx is not None and ctx.is_current() else None

    def _ask(self, message: Any) -> Any:
        """The slow path: the actor serves ``message`` (after a rebuild in progress). No timeout:
        the device actor never waits on a client, and a rebuild takes as long as the driver."""
        try:
            return self._cell.actor_ref.ask(message)
        except pykka.ActorDeadError as exc:
            raise DeviceUnavailable(f"device {self._cell.ordinal}: its DeviceActor was stopped") from exc

    def _allocate_slow(self, nbytes: int, stream: StreamId, tag: AllocTag) -> GpuRef:
        """``allocate`` when the compiled fast path could not serve it (no running context, or a
        rebuild took it away during the call)."""
        return cast(GpuRef, self._direct(lambda ctx: ctx.allocate(nbytes, stream, tag), Allocate(nbytes, stream, tag)))

    def allocate_many(
        self, sizes: list[int] | tuple[int, ...], stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> list[GpuRef]:
        """Allocate one block per size, all or none, as ``AllocateMany`` does, in the calling thread.

        Args:
            sizes: a list or tuple of positive ints.
            stream: the stream the allocations are ordered on.
            tag: what the allocations are for.
        Returns:
            one ``GpuRef`` per size, in order.
        Raises:
            as :meth:`allocate`; on any error nothing stays allocated.
        Thread rule: any thread but the device actor's own.
        """
        return cast(
            "list[GpuRef]",
            self._direct(lambda ctx: ctx.allocate_many(sizes, stream, tag), AllocateMany(sizes, stream, tag)),
        )

    def _direct(self, work: Callable[[DeviceContext], Any], fallback: Any) -> Any:
        """``work`` on the current context in this thread; the actor serves ``fallback`` when
        there is no running context, or when a rebuild took the context away during ``work``
        (the result, or the error, belonged to the old context)."""
        ctx = self._current()
        if ctx is not None:
            try:
                result = work(ctx)
            except (ContextLost, ContextPoisoned) as exc:
                self._cell.report_failure(exc, ctx.generation)
                raise
            except BaseException:
                if ctx.is_current():
                    raise
            else:
                if ctx.is_current():
                    return result
        return self._ask(fallback)

    def _free_slow(self, ref: GpuRef) -> None:
        """``free`` with every rule (the compiled fast path serves only a plain handle of the
        current context)."""
        if not isinstance(ref, GpuRef):
            raise InvalidRequest(f"free needs a GpuRef, got {type(ref).__name__}")
        ctx = self._cell.lifecycle.context
        if ctx is None or ref.context is not ctx or not ctx.is_current():
            # Another generation (its memory went with its context) or another device: the
            # actor sorts it out with the same rules as a Free message.
            if ref.context.actor_ref.actor_urn != self._cell.actor_ref.actor_urn:
                raise InvalidRequest(
                    f"free: {ref!r} belongs to another device actor (device {ref.block.device_ordinal}), "
                    f"not to device {self._cell.ordinal}"
                )
            if not self._cell.actor_ref.is_alive():
                ref._mark_released()  # the stopped device freed its memory
                return
            self._ask(Free(ref))
            return
        if ref._mark_released():
            try:
                ctx.free(ref.block)
            except BaseException as exc:
                if isinstance(exc, CorruptionDetected):
                    raise  # the guard freed the block before it reported: the handle stays released
                if not ctx.is_current() and not isinstance(exc, (ContextLost, ContextPoisoned)):
                    return  # a rebuild took the context, and the memory, away under this call
                ref._unmark_released()
                if isinstance(exc, (ContextLost, ContextPoisoned)):
                    self._cell.report_failure(exc, ctx.generation)
                raise

    @property
    def device_id(self) -> int:
        """The device's ordinal. Thread rule: any thread."""
        ordinal: int = self._cell.ordinal
        return ordinal

    def __repr__(self) -> str:
        return f"DeviceClient(device={self._cell.ordinal}, status={self._cell.lifecycle.status.value})"
