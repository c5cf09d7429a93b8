"""``DeviceContext``: one generation of a device's context, as actors and handles see it."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._core.context_core import RECLAIM_BATCH, RECLAIM_WAKE_BYTES, ContextCore
from ..errors import (
    ContextPoisoned,
    DeviceUnavailable,
    GpuRefStale,
    InvalidRequest,
    OutOfMemory,
)
from ..memory.block import AllocTag, DeviceBlock, StreamId
from ..memory.report import enrich_out_of_memory
from ..runtime.device_runtime import XlogDeviceRuntime
from .device_state import DeviceState
from .gpu_ref import GpuRef
from .messages import Reclaim

if TYPE_CHECKING:
    import pykka

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "DeviceContext"]


class DeviceContext(ContextCore):
    """The runtime of one generation plus what handles need to validate and free themselves.

    ``allocate``, ``free`` and ``is_current`` are compiled
    (:class:`~xlog_actors._core.context_core.ContextCore`, which also holds ``runtime``,
    ``generation``, ``state_ref``, ``token``, ``blocks`` and ``open``); this class adds the
    rest.

    ``blocks`` holds every block handed out as a ``GpuRef`` of this generation and not yet freed;
    a rebuild drops the whole context (the driver freed its memory), so nothing of it is freed
    twice or into the next context. ``reclaims`` holds the blocks whose last handle went away,
    until the actor frees them (``drain_reclaims``).

    Thread rules: ``allocate``/``free`` may run on any thread (the runtime is thread-safe;
    ``blocks`` changes by single dict operations made with the GIL held);
    ``reclaim`` only appends to ``reclaims`` (atomic) and ``tell``s the owning actor, so a
    garbage collector may call it anywhere; ``drain_reclaims`` runs on the actor's thread only.
    """

    def __init__(
        self,
        runtime: XlogDeviceRuntime,
        state: DeviceState,
        actor_ref: pykka.ActorRef[Any],
    ) -> None:
        """Args:
            runtime: the generation's runtime (stream pool and resource stack).
            state: the device state; the context takes its current generation and token.
            actor_ref: the device actor, which frees the blocks ``reclaim`` queues.
        Thread rule: the device actor's thread.
        """
        super().__init__(runtime, state.generation, weakref.ref(state), state.token, GpuRef)
        self.driver = runtime.driver
        self.ordinal = runtime.device_ordinal
        self.actor_ref = actor_ref
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeviceContext(device={self.ordinal}, generation={self.generation}, stack={self.runtime.describe()!r})"

    # -- validation -----------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise the typed error of a device that cannot take new work right now.

        Raises:
            DeviceUnavailable: stopped. ContextPoisoned: poisoned. GpuRefStale: this generation
            was replaced ("context rebuilt").
        Thread rule: any thread.
        """
        state = self.state_ref()
        if state is None or not state.accepting_ops:
            raise DeviceUnavailable(f"device {self.ordinal} was stopped")
        if state.poisoned:
            raise ContextPoisoned(f"device {self.ordinal}: the context is poisoned; no new work is accepted")
        if state.generation != self.generation or not self.open:
            raise GpuRefStale("context rebuilt", f"device {self.ordinal} moved to generation {state.generation}")

    def check_ref(self, ref: GpuRef) -> DeviceBlock:
        """Validate ``ref`` and that it belongs to this device.

        Args:
            ref: the handle.
        Returns:
            its block.
        Raises:
            GpuRefStale: the handle cannot be used. InvalidRequest: a handle of another device.
        Thread rule: any thread.
        """
        block = ref.access()
        if block.device_ordinal != self.ordinal:
            raise InvalidRequest(
                f"GpuRef of device {block.device_ordinal} (block {block.ptr:#x}) given to device {self.ordinal}"
            )
        return block

    # -- allocation -----------------------------------------------------------------------------
    if TYPE_CHECKING:  # the compiled method's precise type (the core cannot name GpuRef)

        def allocate(self, nbytes: int, stream: StreamId, tag: AllocTag) -> GpuRef: ...

        def allocate_many(
            self, sizes: list[int] | tuple[int, ...], stream: StreamId, tag: AllocTag
        ) -> list[GpuRef]: ...

    def _out_of_memory(self, exc: OutOfMemory) -> OutOfMemory:
        """``exc`` with the stack's figures added to its message (the compiled ``allocate``
        raises what this returns)."""
        return enrich_out_of_memory(exc, self.runtime.resource)

    def _send_wake(self, block: DeviceBlock) -> None:
        """Wake the owning actor to drain the reclaimed blocks (the compiled ``reclaim`` calls it
        for a large block or a full batch)."""
        self.actor_ref.tell(Reclaim(block, self.generation))

    def close(self, free_blocks: bool) -> list[BaseException]:
        """End this generation. With ``free_blocks`` (an orderly stop), give every live block
        back and reap; otherwise (a rebuild) the driver already dropped the memory. Returns the
        errors met on the way, for the caller to report. Idempotent.

        Args:
            free_blocks: give every live block back first.
        Returns:
            the errors met (none is raised).
        Thread rule: the device actor's thread.
        """
        errors: list[BaseException] = []
        with self._lock:
            if not self.open:
                return errors
            if free_blocks:
                for block in list(self.blocks.values()):
                    try:
                        self.runtime.deallocate(block)
                    except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                        errors.append(exc)
                try:
                    self.runtime.reap_pending()
                except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                    errors.append(exc)
            self.open = False
            self.blocks.clear()
            self.reclaims.clear()  # freed above, or gone with the context
            try:
                self.runtime.close()
            except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                errors.append(exc)
        return errors
