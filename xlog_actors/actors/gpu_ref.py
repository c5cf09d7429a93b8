"""``GpuRef``, the handle users and worker actors hold, and ``DeviceContext``, the generation of a
device's context that makes it.

The two types refer to each other (a context makes handles; each handle holds the context it was
made in and hands its free back to it), so they live in one module: apart, each module would
import the other. ``Reclaim``, the wake-up a context tells its device actor when dropped handles
wait to be freed, lives here with them (``messages`` re-exports it). ``DeviceContext`` is also
importable from :mod:`.device_context`.

Invariants: a handle validates on every ``access()`` against its device's state (generation,
status, poison) and its own released flag; a context frees only its own generation's blocks, and
a dropped handle's free goes to its device actor (a ``tell``), never a driver call from a
garbage collector's thread. The classes' docstrings give the details.

Thread rules: a ``GpuRef`` may be used from any thread; a ``DeviceContext`` allocates and frees
from any thread, ``reclaim`` may run anywhere (a garbage collector's thread included), and
``drain_reclaims``/``close`` run on the device actor's thread.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from .._core.context_core import RECLAIM_BATCH, RECLAIM_WAKE_BYTES, ContextCore
from .._core.handles import HandleCore, make_handle
from ..errors import ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest, OutOfMemory
from ..memory.block import AllocTag, DeviceBlock, StreamId
from ..memory.report import enrich_out_of_memory
from ..runtime.device_runtime import XlogDeviceRuntime
from . import interop
from .caller_inbox import send_wake
from .device_state import DeviceState

if TYPE_CHECKING:
    import pykka

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "DeviceContext", "GpuRef", "Reclaim"]


class GpuRef(HandleCore):
    """An immutable, shareable handle to one device allocation.

    * ``access()`` validates, in this order: the device state still exists, the device accepts
      operations, the context is not poisoned, the generation is unchanged, the handle was not
      released; otherwise :class:`GpuRefStale` with the matching reason. The fast path is a few C
      field loads: the state's token cell, the released flag and the weak reference.
    * ``last_write_stream`` is the one mutable cell: library actors call ``record_write`` after
      enqueueing a write, and every holder (it is one object, passed by reference between actors
      and threads) sees it.
    * The memory lives while the handle is reachable. When the last reference goes, or on
      ``release()``, the free is handed to the owning ``DeviceActor`` (a pykka ``tell``): never
      a driver call from a garbage-collector thread, and never into a newer generation's context
      (the actor ignores frees of an older generation, whose memory went with its context).
    * Copying returns the same handle; pickling exports it to another process of the node
      (:mod:`.shared_ref`), where it arrives as a ``SharedGpuRef`` to the same memory.

    Thread rule: any thread; a handle may be shared between threads and actors.
    """

    # The fields (``_block``, ``_generation``, ``_state``, ``_token``, ``_context``,
    # ``_last_write``, ``_released``), ``access()``, ``record_write``, the release flag and the
    # drop that hands a dropped handle's free to its device are compiled
    # (:class:`~xlog_actors._core.handles.HandleCore`). No ``__dict__`` and no ``__del__``: a
    # class that adds nothing to the compiled layout is one whose handles the core makes from a
    # pool and drops in C (see handles.pyx).
    __slots__ = ()

    def __new__(cls, *_args: object, **_kwargs: object) -> GpuRef:  # noqa: PYI034 - it only raises
        # Refused in __new__, not __init__: an object that __init__ refused would still exist,
        # with empty slots, and its __del__ would fail on them.
        raise TypeError("GpuRef is made by a DeviceActor (Allocate) or a DeviceClient, not directly")

    @classmethod
    def _new(cls, block: DeviceBlock, context: DeviceContext) -> GpuRef:
        ref: GpuRef = make_handle(cls, block, context)
        return ref

    # -- immutability -------------------------------------------------------------------------
    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"GpuRef is immutable (cannot set {name!r}); use record_write() for the last-write stream")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("GpuRef is immutable")

    def __copy__(self) -> GpuRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> GpuRef:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        """Pickling exports the handle to another process of this node: it unpickles as a
        :class:`~xlog_actors.actors.shared_ref.SharedGpuRef` to the same memory, ordered after
        the last write (see :mod:`xlog_actors.actors.shared_ref`).

        Raises:
            GpuRefStale: the handle cannot be used.
            InvalidRequest: the device cannot export (a host driver made without
                ``shared=True``).
            DeviceUnavailable: an isolated device's child did not answer the export.
        """
        from .shared_ref import export_ref, import_ref  # here: shared_ref refers back to GpuRef

        return import_ref, (export_ref(self),)

    # -- validation ---------------------------------------------------------------------------
    def _stale(self, state: DeviceState | None) -> GpuRefStale | None:
        """Why the handle is stale; None when it is not (its token is then refreshed)."""
        where = f"device {self._block.device_ordinal}, block {self._block.ptr:#x}, generation {self._generation}"
        if state is None:
            return GpuRefStale("device state dropped", where)
        if not state.accepting_ops:
            return GpuRefStale("device shutting down", where)
        if state.poisoned:
            return GpuRefStale("context poisoned", where)
        if state.generation != self._generation:
            return GpuRefStale("context rebuilt", f"{where}; the device is at generation {state.generation}")
        if self._released:
            return GpuRefStale("released", where)
        # The token moved for a reason that did not invalidate this handle: refresh it.
        self._refresh_token(state.token)
        return None

    def raw_device_ptr(self) -> int:
        """The device address, after validating the handle.

        Raises:
            GpuRefStale: the handle cannot be used.
        Thread rule: any thread.
        """
        return self.access().ptr

    # -- facts --------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The generation the handle was made in. Thread rule: any thread."""
        return self._generation

    @property
    def nbytes(self) -> int:
        """The allocation's size in bytes. Thread rule: any thread."""
        return self._block.nbytes

    def __len__(self) -> int:
        return self._block.nbytes

    @property
    def tag(self) -> AllocTag:
        """What the allocation is for. Thread rule: any thread."""
        return self._block.tag

    @property
    def alloc_stream(self) -> StreamId:
        """The stream the allocation was ordered on. Thread rule: any thread."""
        return self._block.alloc_stream

    @property
    def device_id(self) -> int | None:
        """The device's ordinal; None once the device state is gone. Thread rule: any thread."""
        state = self._state()
        return None if state is None else state.device_id

    @property
    def block(self) -> DeviceBlock:
        """The underlying block, unvalidated (use ``access()`` before touching memory)."""
        return self._block

    @property
    def released(self) -> bool:
        """True once ``release()`` or ``Free`` freed the handle. Thread rule: any thread."""
        return self._released

    @property
    def context(self) -> DeviceContext:
        """The ``DeviceContext`` (generation) the handle was made in. Thread rule: any thread."""
        context: DeviceContext = self._context
        return context

    # -- the shared cell ------------------------------------------------------------------------
    @property
    def last_write_stream(self) -> StreamId | None:
        """The stream of the last recorded write (None: none yet); shared by every holder.

        Thread rule: any thread.
        """
        return self._last_write

    # -- lifetime -------------------------------------------------------------------------------
    def release(self) -> None:
        """Free the memory now rather than when the last reference goes. Idempotent; every
        holder's ``access()`` then raises ``GpuRefStale("released")``.

        Thread rule: any thread (the free itself is handed to the device actor).
        """
        if self._mark_released():
            self._context.reclaim(self._block, wake=True)

    # -- interop (CUDA driver only) -------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3: a 1-D ``uint8`` view of the allocation, with the stream of
        the last write (consumers order their work after it). Only on the CUDA driver."""
        return interop.cuda_array_interface(self)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack export (a 1-D ``uint8`` tensor); the consumer's ``stream`` waits for the last write.

        Raises:
            AttributeError: not on the CUDA driver.
            InvalidRequest: a bad ``stream``.
            GpuRefStale: the handle cannot be used.
        Thread rule: any thread.
        """
        return interop.export_dlpack(self, stream, kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``; ``AttributeError`` off the CUDA driver. Thread rule: any thread."""
        return interop.dlpack_device(self)

    def record_foreign_write(self, stream: Any) -> None:
        """Declare that another library (PyTorch, CuPy, ...) wrote this memory on its own CUDA
        ``stream``: a raw handle, or an object with ``__cuda_stream__``, ``.cuda_stream`` or
        ``.ptr``. Every later consumer (library actors, other libraries through the export
        protocols) then waits for that write, and ``last_write_stream`` names the device's
        default stream, which waits for it. Call it after enqueuing the write, from any thread.
        Only on the CUDA driver (``AttributeError`` elsewhere); a stale handle raises
        ``GpuRefStale``, a stream that is none ``InvalidRequest``.

        Args:
            stream: the writer's stream.
        Raises:
            AttributeError: not on the CUDA driver.
            InvalidRequest: ``stream`` is not a stream.
            GpuRefStale: the handle cannot be used.
        Thread rule: any thread.
        """
        interop.import_foreign_write(self, stream)

    def __repr__(self) -> str:
        b = self._block
        return (
            f"GpuRef(device={b.device_ordinal}, ptr={b.ptr:#x}, nbytes={b.nbytes}, tag={str(b.tag)!r}, "
            f"generation={self._generation}, last_write_stream={self._last_write!r}"
            f"{', released' if self._released else ''})"
        )


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Internal wake-up: a ``GpuRef`` of ``generation`` went away or was released, and its
    ``block`` waits in that context's reclaim queue.

    Fields: ``block``, ``generation``.
    Reply: None (it is told); a reclaim of an older generation is ignored.
    """

    block: DeviceBlock
    generation: int


class DeviceContext(ContextCore):
    """The runtime of one generation plus what handles need to validate and free themselves.

    ``allocate``, ``free`` and ``is_current`` are compiled
    (:class:`~xlog_actors._core.context_core.ContextCore`, which also holds ``runtime``,
    ``generation``, ``state_ref``, ``token``, the live blocks and ``open``); this class adds the
    rest.

    The live blocks (``live_blocks()``, ``live_count()``) are every block handed out as a
    ``GpuRef`` of this generation and not yet freed; a rebuild drops the whole context (the driver
    freed its memory), so nothing of it is freed twice or into the next context. ``reclaims``
    holds the blocks whose last handle went away, until the actor frees them (``drain_reclaims``).

    Thread rules: ``allocate``/``free`` may run on any thread (the runtime is thread-safe;
    the live blocks change by single table operations made with the GIL held);
    ``reclaim`` only appends to ``reclaims`` (atomic) and wakes the owning actor without waiting
    on its inbox's lock (``send_wake``), so a garbage collector may call it anywhere, inside that
    lock's sections included; ``drain_reclaims`` runs on the actor's thread only.
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
        for a large block or a full batch, a collector's finalizer included): ``send_wake``. Not
        sent, it clears ``wake_pending``: the next message or the next reclaim frees them."""
        if not send_wake(self.actor_ref, Reclaim(block, self.generation)):
            self.wake_pending = False

    def close(self, free_blocks: bool) -> list[BaseException]:
        """End this generation. With ``free_blocks`` (an orderly stop), give every live block
        back, trim a block cache in the stack and reap; otherwise (a rebuild) the driver already
        dropped the memory, and a block cache forgets what it keeps. Returns the
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
                for block in self.live_blocks():
                    try:
                        self.runtime.deallocate(block)
                    except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                        errors.append(exc)
                try:
                    self.runtime.trim_caches()  # what a block cache keeps goes back too
                except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                    errors.append(exc)
                try:
                    self.runtime.reap_pending()
                except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                    errors.append(exc)
            else:
                self.runtime.drop_caches()  # kept blocks went with the context too
            self.open = False
            self.forget_blocks()
            self.reclaims.clear()  # freed above, or gone with the context
            try:
                self.runtime.close()
            except Exception as exc:  # noqa: BLE001 - collected and reported by the caller
                errors.append(exc)
        return errors
