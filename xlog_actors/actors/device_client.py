"""``DeviceClient``: direct, thread-safe allocation without an actor round trip."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ContextLost, ContextPoisoned, DeviceUnavailable, InvalidRequest
from ..memory.block import AllocTag, StreamId
from .gpu_ref import GpuRef
from .messages import Free

if TYPE_CHECKING:
    from .device_actor import ContextCell

__all__ = ["DeviceClient"]


class DeviceClient:
    """Allocates through the device's current runtime in the calling thread.

    A pykka ``ask`` costs about fifteen raw allocations; code that allocates in a loop uses a
    client (``device.ask(GetClient())``) instead. It yields the same ``GpuRef``s as ``Allocate``:
    same generation, same validation, frees handed back to the actor. It follows rebuilds (it
    reads the actor's current context on every call), and a context loss or poisoning it meets
    is reported to the actor, whose supervisor then acts as if the actor had met it.

    Thread rules: any thread, any number of threads at once.
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: ContextCell) -> None:
        self._cell = cell

    def _context(self):  # type: ignore[no-untyped-def]
        ctx = self._cell.ctx
        if ctx is None:
            raise DeviceUnavailable(f"device {self._cell.ordinal} has no usable context ({self._cell.status})")
        ctx.check_usable()
        return ctx

    def allocate(self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED) -> GpuRef:
        ctx = self._context()
        try:
            return ctx.allocate(nbytes, stream, tag)
        except (ContextLost, ContextPoisoned) as exc:
            self._cell.report_failure(exc, ctx.generation)
            raise

    def allocate_many(
        self, sizes: list[int] | tuple[int, ...], stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> list[GpuRef]:
        ctx = self._context()
        try:
            return ctx.allocate_many(sizes, stream, tag)
        except (ContextLost, ContextPoisoned) as exc:
            self._cell.report_failure(exc, ctx.generation)
            raise

    def free(self, ref: GpuRef) -> None:
        """Free ``ref`` now, in this thread. Idempotent, like the ``Free`` message."""
        if not isinstance(ref, GpuRef):
            raise InvalidRequest(f"free needs a GpuRef, got {type(ref).__name__}")
        ctx = self._cell.ctx
        if ctx is None or ref.context is not ctx:
            # Another generation (its memory went with its context) or another device: the
            # actor sorts it out with the same rules as a Free message.
            self._cell.actor_ref.ask(Free(ref))
            return
        if ref._mark_released():
            try:
                ctx.free(ref.block)
            except BaseException as exc:
                ref._unmark_released()
                if isinstance(exc, (ContextLost, ContextPoisoned)):
                    self._cell.report_failure(exc, ctx.generation)
                raise

    @property
    def device_id(self) -> int:
        return self._cell.ordinal

    def __repr__(self) -> str:
        return f"DeviceClient(device={self._cell.ordinal}, status={self._cell.status})"
