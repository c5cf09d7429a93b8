"""``DeviceContext``: one generation of a device's context, as actors and handles see it."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest
from ..memory.block import AllocTag, DeviceBlock, StreamId
from ..runtime.device_runtime import XlogDeviceRuntime
from .device_state import DeviceState
from .messages import Reclaim

if TYPE_CHECKING:
    import pykka

    from .gpu_ref import GpuRef

__all__ = ["DeviceContext"]


class DeviceContext:
    """The runtime of one generation plus what handles need to validate and free themselves.

    ``blocks`` holds every block handed out as a ``GpuRef`` of this generation and not yet freed;
    a rebuild drops the whole context (the driver freed its memory), so nothing of it is freed
    twice or into the next context.

    Thread rules: ``allocate``/``free`` may run on any thread (the runtime is thread-safe and
    ``blocks`` is only touched by single dict operations, atomic under the GIL); ``reclaim``
    only ``tell``s the owning actor.
    """

    def __init__(
        self,
        runtime: XlogDeviceRuntime,
        state: DeviceState,
        actor_ref: pykka.ActorRef[Any],
    ) -> None:
        self.runtime = runtime
        self.driver = runtime.driver
        self.ordinal = runtime.device_ordinal
        self.generation = state.generation
        self.state_ref: weakref.ref[DeviceState] = weakref.ref(state)
        self.token = state.token
        self.actor_ref = actor_ref
        self.blocks: dict[int, DeviceBlock] = {}
        self.open = True
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeviceContext(device={self.ordinal}, generation={self.generation}, stack={self.runtime.describe()!r})"

    # -- validation -----------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise the typed error of a device that cannot take new work right now."""
        state = self.state_ref()
        if state is None or not state.accepting_ops:
            raise DeviceUnavailable(f"device {self.ordinal} was stopped")
        if state.poisoned:
            raise ContextPoisoned(f"device {self.ordinal}: the context is poisoned; no new work is accepted")
        if state.generation != self.generation or not self.open:
            raise GpuRefStale("context rebuilt", f"device {self.ordinal} moved to generation {state.generation}")

    def check_ref(self, ref: GpuRef) -> DeviceBlock:
        """Validate ``ref`` and that it belongs to this device; its block."""
        block = ref.access()
        if block.device_ordinal != self.ordinal:
            raise InvalidRequest(
                f"GpuRef of device {block.device_ordinal} (block {block.ptr:#x}) given to device {self.ordinal}"
            )
        return block

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, nbytes: int, stream: StreamId, tag: AllocTag) -> GpuRef:
        from .gpu_ref import GpuRef

        block = self.runtime.allocate(nbytes, stream, tag)
        self.blocks[block.ptr] = block
        return GpuRef._new(block, self)

    def allocate_many(self, sizes: list[int] | tuple[int, ...], stream: StreamId, tag: AllocTag) -> list[GpuRef]:
        from ..memory.validate import check_nbytes
        from .gpu_ref import GpuRef

        if not isinstance(sizes, (list, tuple)):
            raise InvalidRequest(f"AllocateMany needs a list or tuple of sizes, got {type(sizes).__name__}")
        for size in sizes:
            check_nbytes(size)
        allocate = self.runtime.allocate
        blocks: list[DeviceBlock] = []
        try:
            for size in sizes:
                blocks.append(allocate(size, stream, tag))
        except BaseException:
            for block in blocks:
                self.runtime.deallocate(block)
            raise
        table = self.blocks
        refs = []
        for block in blocks:
            table[block.ptr] = block
            refs.append(GpuRef._new(block, self))
        return refs

    def free(self, block: DeviceBlock) -> bool:
        """Free ``block`` if it is still one of this context's; False when it was not."""
        live = self.blocks.get(block.ptr)
        if live is None or live.generation != block.generation or not self.open:
            return False
        self.runtime.deallocate(block)
        # Only after the resource took it back: a failed deallocate leaves the block ours.
        self.blocks.pop(block.ptr, None)
        return True

    def reclaim(self, block: DeviceBlock) -> None:
        """Hand the free of ``block`` to the owning actor (safe from any thread, GC included)."""
        if self.open:
            self.actor_ref.tell(Reclaim(block, self.generation))

    def close(self, free_blocks: bool) -> list[BaseException]:
        """End this generation. With ``free_blocks`` (an orderly stop), give every live block
        back and reap; otherwise (a rebuild) the driver already dropped the memory. Returns the
        errors met on the way, for the caller to report."""
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
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            self.open = False
            self.blocks.clear()
            try:
                self.runtime.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        return errors

    # -- interop ----------------------------------------------------------------------------------
    def _require_cuda(self, what: str) -> None:
        if self.driver.kind != "cuda":
            raise AttributeError(f"{what} is only offered on the CUDA driver (this device runs on {self.driver.kind})")

    def stream_handle(self, stream_id: StreamId | None) -> int | None:
        if stream_id is None:
            return None
        stream = self.runtime.stream_pool.resolve(stream_id)
        return None if stream is None else stream.handle

    def cuda_array_interface(self, ref: GpuRef) -> dict[str, Any]:
        self._require_cuda("__cuda_array_interface__")
        block = ref.access()
        handle = self.stream_handle(ref.last_write_stream)
        return {
            "shape": (block.nbytes,),
            "typestr": "|u1",
            "data": (block.ptr, False),
            "version": 3,
            "strides": None,
            # CAI v3: the stream the data was last written on; None means "already
            # synchronized". A non-blocking stream has a handle above 2, as the spec asks.
            "stream": handle,
        }

    def dlpack(self, ref: GpuRef, stream: Any, kwargs: dict[str, Any]) -> Any:
        self._require_cuda("__dlpack__")
        from ..driver.cuda_interop import export_dlpack

        return export_dlpack(ref, self, stream, kwargs)

    def dlpack_device(self, ref: GpuRef) -> tuple[int, int]:
        self._require_cuda("__dlpack_device__")
        return (2, self.ordinal)  # kDLCUDA
