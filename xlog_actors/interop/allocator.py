"""``DeviceAllocator``: device memory for a foreign library (PyTorch, CuPy), by raw pointer,
allocated through a device's :class:`~xlog_actors.DeviceClient` under one tag, so that the
device's budget, statistics, report and memory history see it.

Streams. The runtime allocates only on its own streams (a ``StreamId`` of the device's pool): it
cannot allocate on a foreign stream. So every block is allocated on the device's default stream,
and on the CUDA driver the foreign library's stream is ordered around it: after the allocation,
that stream waits for the device's stream (an event, ``order_foreign_stream``), so its first use
comes after the allocation; at the free, the device's stream waits for the foreign stream the
block was allocated for (``wait_foreign_stream``), so the stream-ordered free comes after every
use the library queued there. A use on yet another stream is the library's to order (torch's
``record_stream`` contract; the pluggable allocator does not forward it). The host driver has no
foreign streams: the stream handle is ignored there.

Frees never call the driver from inside a garbage collection or from inside this allocator's
own work in the same thread (a collection can run inside any allocation, with a driver lock
held): such a free is queued and done at the next allocation, :meth:`flush`, or
:meth:`close`; any other free is done at once. A queued block is still counted by the device
until then, as a caching allocator's cache is.

Rebuilds. A ``Rebuild`` frees every block of the device's old context, these included: the
runtime cannot keep one alive across it (the host driver unmaps its whole arena; the CUDA driver
frees every pool block it made). A tensor or array alive across a rebuild then points at freed
memory. The allocator notices at its next allocation: it logs a warning naming the blocks and bytes
lost, moves them to :attr:`lost_blocks`, and a later free of such a pointer is accepted and does
nothing. The library must never hold one address twice (PyTorch aborts on the second free of
it), so a new block the device hands out at a lost block's address is held back, counted under
the tag, until the library frees the lost one; then it is freed with the next queued frees.

The allocator bridge's cache (:mod:`xlog_actors._core.alloc_bridge`). When this allocator is
the one registered with the bridge for its ordinal, the blocks the bridge caches are live here
(counted under the tag; the device's memory report shows them as the tag's cached share, through
the device's ``CacheShares``) until the bridge gives them back: :meth:`flush` empties the cache first,
:meth:`close` empties and disables it, and a rebuild, a poisoning or a shutdown of the device
makes the bridge drop them without freeing (they belonged to the old context; the device's
state tells this allocator synchronously, before the old context is closed) and they are
forgotten here, not counted as lost.

Invariants: every pointer handed out and not yet freed is a key of the live table, with the
``GpuRef`` that owns its memory; a free of a pointer that is neither live nor lost raises
``InvalidRequest`` and changes nothing.

Thread rule: any thread but the device actor's own, any number at once (the tables are changed
by single dict and deque operations, atomic under the GIL).
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from typing import Any

import pykka

from .._core import alloc_bridge
from ..actors.device_client import ContextCell, DeviceClient
from ..actors.gpu_ref import GpuRef
from ..actors.messages import GetClient
from ..errors import InvalidRequest
from ..memory.block import AllocTag, StreamId

__all__ = ["DeviceAllocator", "as_client", "driver_kind"]

logger = logging.getLogger("xlog_actors.interop")

_collections_running = 0


def _on_gc(phase: str, _info: dict[str, Any]) -> None:
    global _collections_running
    _collections_running += 1 if phase == "start" else -1


def _watch_collections() -> None:
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def as_client(ref_or_client: Any) -> DeviceClient:
    """The ``DeviceClient`` of a device actor's ref, or the client itself.

    Args:
        ref_or_client: a ``DeviceActor``'s ``pykka.ActorRef``, or a ``DeviceClient``.
    Returns:
        the client.
    Raises:
        InvalidRequest: neither.
        DeviceUnavailable: the actor was stopped.
    Thread rule: any thread but the device actor's own.
    """
    if isinstance(ref_or_client, DeviceClient):
        return ref_or_client
    if isinstance(ref_or_client, pykka.ActorRef):
        client = ref_or_client.ask(GetClient())
        if isinstance(client, DeviceClient):
            return client
    raise InvalidRequest(f"expected a DeviceActor's ref or a DeviceClient, got {ref_or_client!r}")


def driver_kind(client: DeviceClient) -> str:
    """The kind of driver the client's device runs on (``"cuda"``, ``"host"``).

    Raises:
        DeviceUnavailable, ContextPoisoned: the device has no context to ask (stopped, poisoned).
    Thread rule: any thread but the device actor's own.
    """
    ctx = client._cell.lifecycle.context
    if ctx is None:
        # No context now (starting, broken, rebuilding): an allocation makes the actor build one.
        client.free(client.allocate(1))
        ctx = client._cell.lifecycle.context
    return str(ctx.driver.kind)


class DeviceAllocator:
    """Hands a device's memory out by pointer and takes it back by pointer (see the module
    docstring for streams, deferred frees and rebuilds).

    Thread rule: any thread but the device actor's own.
    """

    def __init__(self, client: DeviceClient, tag: AllocTag | str) -> None:
        """Args:
            client: the device's client.
            tag: the tag every block is counted under.
        Raises:
            InvalidRequest: ``tag`` is not a non-empty str.
        Thread rule: any thread.
        """
        if not isinstance(tag, str) or not tag:
            raise InvalidRequest(f"tag must be a non-empty str, got {tag!r}")
        self._client = client
        self._tag = AllocTag(tag)
        self._live: dict[int, GpuRef] = {}
        self._lost: dict[int, int] = {}  # ptr -> bytes, of blocks a rebuild freed under them
        # New blocks the device handed out at the address of a lost block, held back until the
        # library frees the lost one: the library must never see one address twice at once.
        self._quarantine: dict[int, GpuRef] = {}
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._busy = threading.local()
        self._closed = False
        _watch_collections()
        self._cell: ContextCell | None = getattr(client, "_cell", None)
        if self._cell is not None:  # a device in this process: its state says when a context ends
            self._cell.lifecycle.state.add_watcher(self._on_device_change)
            self._cell.cache_shares.add(self._cache_share)

    @property
    def tag(self) -> AllocTag:
        """The tag every block is counted under."""
        return self._tag

    @property
    def device_id(self) -> int:
        """The device's ordinal."""
        return self._client.device_id

    @property
    def live_blocks(self) -> int:
        """Blocks handed out and not yet freed (queued frees included)."""
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes of those blocks, as allocated."""
        return sum(ref.nbytes for ref in list(self._live.values()))

    @property
    def lost_blocks(self) -> dict[int, int]:
        """Pointer -> bytes of blocks a rebuild freed while the library still held them (a copy)."""
        return dict(self._lost)

    @property
    def pending_frees(self) -> int:
        """Frees queued until the next allocation or :meth:`flush`."""
        return len(self._pending)

    def ref(self, ptr: int) -> GpuRef:
        """The ``GpuRef`` that owns the block at ``ptr``.

        Raises:
            InvalidRequest: no live block starts at ``ptr``.
        Thread rule: any thread.
        """
        ref = self._live.get(ptr)
        if ref is None:
            raise InvalidRequest(f"device {self.device_id}: no live {self._tag} block at {ptr:#x}")
        return ref

    def allocate(self, nbytes: int, stream_handle: int) -> int:
        """Allocate ``nbytes`` on the device under the tag, usable on the foreign stream
        ``stream_handle`` (ordered after the allocation on the CUDA driver).

        Args:
            nbytes: a positive int.
            stream_handle: the foreign library's raw stream (0 the legacy default stream).
        Returns:
            the device pointer.
        Raises:
            InvalidRequest: a bad size, or the allocator is closed.
            OutOfMemory, BudgetExceeded: the device refused (the message carries its report).
            ContextPoisoned, DeviceUnavailable, DriverError: as ``DeviceClient.allocate``.
        Thread rule: any thread but the device actor's own.
        """
        if self._closed:
            raise InvalidRequest(f"device {self.device_id}: the {self._tag} allocator is closed")
        busy = self._busy
        busy.on = True
        try:
            self._drain()
            while True:  # at most len(self._lost) + 1 rounds: each lost address is held once
                ref = self._client.allocate(nbytes, StreamId.DEFAULT, self._tag)
                ctx = ref.context
                ptr: int = ref.block.ptr
                if self._live:
                    self._forget_rebuilt(ctx.generation)
                if ptr not in self._lost:
                    break
                self._quarantine[ptr] = ref
            if ctx.driver.kind == "cuda":
                ours = ctx.runtime.stream_pool.resolve(StreamId.DEFAULT)
                try:
                    ctx.driver.order_foreign_stream(stream_handle, ours)
                except BaseException:
                    self._client.free(ref)
                    raise
            self._live[ptr] = ref
            return ptr
        finally:
            busy.on = False

    def free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        """Give back the block at ``ptr``, after the work queued on ``stream_handle`` (the
        stream it was allocated for). Queued instead when called inside a garbage collection or
        inside this allocator's own work in this thread.

        Args:
            ptr: a pointer :meth:`allocate` returned.
            nbytes: its size, as the library remembers it (checked against the block's).
            stream_handle: the foreign stream it was allocated for.
        Raises:
            InvalidRequest: ``ptr`` is no live or lost block, or ``nbytes`` is not its size;
                nothing changed.
            ContextLost, ContextPoisoned, DriverError: met while freeing.
        Thread rule: any thread but the device actor's own.
        """
        if self._lost and self._lost.pop(ptr, None) is not None:
            # A rebuild freed it already. A block held back at its address is the library's to
            # have again: it is freed with the next queued frees.
            held = self._quarantine.pop(ptr, None)
            if held is not None:
                self._live[ptr] = held
                self._pending.append((ptr, 0))
            return
        ref = self._live.get(ptr)
        if ref is None:
            raise InvalidRequest(f"device {self.device_id}: free of {ptr:#x}, which is no live {self._tag} block")
        if nbytes != ref.nbytes:
            raise InvalidRequest(
                f"device {self.device_id}: free of {ptr:#x} with {nbytes} bytes, but its {self._tag} block has "
                f"{ref.nbytes}"
            )
        busy = self._busy
        if _collections_running or getattr(busy, "on", False):
            self._pending.append((ptr, stream_handle))
            return
        busy.on = True
        try:
            self._drain()
            self._free_now(ptr, stream_handle)
        finally:
            busy.on = False

    def synchronize(self) -> None:
        """Wait until the frees queued so far on the device's default stream are done (on the
        CUDA driver each waits for its foreign stream's work first), so the device's budget and
        pool see their bytes back at its next allocation. Nothing to wait for while the device
        has no context.

        Raises:
            ContextLost, DriverError: met while waiting.
        Thread rule: any thread but the device actor's own.
        """
        ctx = self._client._cell.lifecycle.context
        if ctx is None:
            return
        stream = ctx.runtime.stream_pool.resolve(StreamId.DEFAULT)
        if stream is not None:
            stream.synchronize()

    def flush(self) -> None:
        """Give the bridge's cached blocks back (when this allocator is the one registered) and
        do the queued frees now.

        Raises:
            ContextLost, ContextPoisoned, DriverError: met while freeing (the rest stay queued).
        Thread rule: any thread but the device actor's own; not from a finalizer.
        """
        if alloc_bridge.registered(self.device_id) is self:
            alloc_bridge.empty_cache(self.device_id)
        busy = self._busy
        busy.on = True
        try:
            self._drain()
        finally:
            busy.on = False

    def close(self) -> None:
        """Refuse later allocations, stop the bridge's caching for this allocator (its cached
        blocks given back) and do the queued frees; blocks still live stay valid and are freed
        by their later :meth:`free`. Idempotent.

        Thread rule: any thread but the device actor's own.
        """
        self._closed = True
        if alloc_bridge.registered(self.device_id) is self:
            alloc_bridge.disable_cache(self.device_id)
        self.flush()
        if self._cell is not None:
            self._cell.cache_shares.discard(self._cache_share)

    def _cache_share(self) -> dict[AllocTag, tuple[int, int]]:
        """The bridge's idle blocks, when this allocator is the one registered: ``{tag: (count,
        nbytes)}`` for the device's memory report. Called in the reporting thread: no ask."""
        if alloc_bridge.registered(self.device_id) is not self:
            return {}
        stats = alloc_bridge.cache_stats(self.device_id)
        return {self._tag: (int(stats["cached_blocks"] or 0), int(stats["cached_bytes"] or 0))}

    def _on_device_change(self) -> None:
        """The device's state changed (rebuild, poisoning, shutdown): the bridge's cached blocks
        are of a context that is gone or going; forget them without freeing. Called in the
        device actor's thread: no driver call, no ask."""
        if alloc_bridge.registered(self.device_id) is not self:
            return
        for ptr, _nbytes, _stream in alloc_bridge.invalidate(self.device_id):
            self._live.pop(ptr, None)

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            try:
                ptr, stream_handle = pending.popleft()
            except IndexError:
                return  # another thread took the last one
            self._free_now(ptr, stream_handle)

    def _free_now(self, ptr: int, stream_handle: int) -> None:
        ref = self._live.pop(ptr, None)
        if ref is None:
            return  # queued twice: the first took it
        ctx = ref.context
        if not ctx.is_current():
            return  # a rebuild freed it with its context; the client's free would be a no-op
        if ctx.driver.kind == "cuda":
            ours = ctx.runtime.stream_pool.resolve(StreamId.DEFAULT)
            try:
                # A CudaDriver method; the Driver protocol does not have it.
                ctx.driver.wait_foreign_stream(ours, stream_handle)  # type: ignore[attr-defined]
            except BaseException:
                self._live[ptr] = ref
                raise
        try:
            self._client.free(ref)
        except BaseException:
            if not ref.released:
                self._live[ptr] = ref
            raise

    def _forget_rebuilt(self, generation: int) -> None:
        """Move the blocks of older generations (a rebuild freed them) to the lost table, once."""
        stale = [(ptr, ref) for ptr, ref in list(self._live.items()) if ref.generation != generation]
        if not stale:
            return
        for ptr, ref in stale:
            if self._live.pop(ptr, None) is ref:
                self._lost[ptr] = ref.nbytes
        logger.warning(
            "device %d: a rebuild freed %d %s block(s), %d bytes, that the library still held; using them "
            "now is a use of freed memory, and their frees are ignored",
            self.device_id,
            len(stale),
            self._tag,
            sum(ref.nbytes for _, ref in stale),
        )

    def __repr__(self) -> str:
        return f"DeviceAllocator(device={self.device_id}, tag={str(self._tag)!r}, live_blocks={self.live_blocks})"
