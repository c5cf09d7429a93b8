"""``SlabClient``: the local path to a Ray-hosted device; allocations with no Ray round trip each.

A Ray call costs a few hundred microseconds to milliseconds; an allocation through a local
``DeviceClient`` a few microseconds. A :class:`SlabClient` lives in a worker (typically a Ray
actor or task on the device's node): one Ray call reserves a slab (an ``Allocate`` of
``slab_bytes`` from the :class:`~xlog_actors.ray.device.RayDevice`), and the client carves
allocations out of it and recycles them locally, in the calling process. Its slabs go back in one
call (:meth:`SlabClient.close`).

What it trades (docs/ray.md says more): a slab counts whole against the device's budget and its
stats from its reservation, whatever is carved of it; carved memory is not freed to the device
until the client closes; a device restart is seen by the client only at its next Ray call
(a reservation, :meth:`SlabClient.refresh`), and until then it keeps carving descriptors of the
old generation, which fail ``access()`` and every fetch (``GpuRefStale``), never valid-looking
descriptors of memory the new generation owns.

Invariants:

* Each carve is a :class:`~xlog_actors.ray.remote_ref.RemoteGpuRef` of its slab's node, ordinal,
  generation and block serial, its own address and size, and a ``carve`` serial unique in this
  client, so a stale descriptor of a freed carve never frees the carve that reused its address.
* Carves are rounded up to :data:`CARVE_ALIGN` bytes and never overlap; a carve freed here is
  reused only for the same rounded size.
* A reservation on a newer generation drops every slab and carve of the older one (their memory
  went with the old context).

Thread rule: any thread; one lock guards the tables, and only :meth:`allocate` (when it has to
reserve), :meth:`refresh` and :meth:`close` make Ray calls, outside the carving itself.
"""

from __future__ import annotations

import threading
from typing import Any

from ..actors import Allocate
from ..errors import InvalidRequest, OutOfMemory
from ..memory import AllocTag
from .fetch import FETCH_TIMEOUT_S, ray_get
from .remote_ref import RemoteGpuRef

__all__ = ["CARVE_ALIGN", "DEFAULT_SLAB_BYTES", "SlabClient"]

#: Carves start on, and are rounded up to, this many bytes (what the device's allocators align to).
CARVE_ALIGN = 256
#: The default slab size: one reservation serves many small allocations.
DEFAULT_SLAB_BYTES = 64 << 20


class _Slab:
    """One reserved block and how far it is carved."""

    __slots__ = ("end", "next", "ref")

    def __init__(self, ref: RemoteGpuRef) -> None:
        self.ref = ref
        self.next = ref.ptr
        self.end = ref.ptr + ref.nbytes


class SlabClient:
    """Allocations from a Ray-hosted device, carved locally from slabs it reserves in one Ray call.

    Thread rule: any thread (see the module docstring).
    """

    def __init__(
        self,
        device: Any,
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        tag: str = "slab",
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        """Make a client of ``device``; nothing is reserved before the first allocation.

        Args:
            device: the Ray actor handle of a ``RayDevice`` (``start_ray_device``).
            slab_bytes: the size of each reservation, a positive multiple of :data:`CARVE_ALIGN`
                (an allocation larger than it gets a slab of its own size).
            tag: the tag of the slabs (their carves carry the tag they are allocated with).
            timeout_s: the bound on each Ray call, in seconds.
        Raises:
            InvalidRequest: a bad ``slab_bytes``, ``tag`` or ``timeout_s``.
        Thread rule: any thread.
        """
        if type(slab_bytes) is not int or slab_bytes <= 0 or slab_bytes % CARVE_ALIGN:
            raise InvalidRequest(f"slab_bytes must be a positive multiple of {CARVE_ALIGN}, got {slab_bytes!r}")
        if not isinstance(tag, str):
            raise InvalidRequest(f"tag must be a str, got {type(tag).__name__}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise InvalidRequest(f"timeout_s must be a positive number, got {timeout_s!r}")
        self._device = device
        self._slab_bytes = slab_bytes
        self._tag = tag
        self._timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._free: dict[int, list[tuple[int, _Slab]]] = {}  # rounded size -> reusable (ptr, slab)
        self._live: dict[int, tuple[int, int, _Slab]] = {}  # ptr -> (carve serial, rounded size, slab)
        self._carves = 0
        self._generation = 0

    # -- carving -------------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str | None = None) -> RemoteGpuRef:
        """A carve of ``nbytes`` bytes; a Ray call only when no slab has room (a reservation).

        Args:
            nbytes: a positive int.
            tag: the descriptor's tag (None: the client's).
        Returns:
            The carve's descriptor, of the generation of the slab it was carved from.
        Raises:
            InvalidRequest: ``nbytes`` not a positive int; nothing changes.
            OutOfMemory: the device refused a reservation (``BudgetExceeded`` under a budget), even
                one of just this allocation's size; nothing changes.
            GpuRefStale, DeviceUnavailable: the reservation's Ray call failed (as ``fetch``).
        Thread rule: any thread.
        """
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidRequest(f"SlabClient.allocate: nbytes must be a positive int, got {nbytes!r}")
        size = -(-nbytes // CARVE_ALIGN) * CARVE_ALIGN
        with self._lock:
            reusable = self._free.get(size)
            if reusable:
                ptr, slab = reusable.pop()
            else:
                ptr, slab = self._carve(size)
            self._carves += 1
            carve = self._carves
            self._live[ptr] = (carve, size, slab)
        s = slab.ref
        return RemoteGpuRef(s.node_id, s.ordinal, s.generation, ptr, nbytes, tag or self._tag, None, s.serial, carve)

    def _carve(self, size: int) -> tuple[int, _Slab]:
        for slab in reversed(self._slabs):
            if slab.end - slab.next >= size:
                ptr = slab.next
                slab.next += size
                return ptr, slab
        slab = self._reserve(size)
        slab.next += size
        return slab.ref.ptr, slab

    def _reserve(self, size: int) -> _Slab:
        """One Ray call: a new slab of ``slab_bytes`` (or ``size`` when larger, or when the device
        cannot give ``slab_bytes``). Called with the lock held: carving waits for it."""
        nbytes = max(self._slab_bytes, size)
        try:
            ref = self._ask(Allocate(nbytes, tag=AllocTag(self._tag)))
        except OutOfMemory:
            if nbytes == size:
                raise
            ref = self._ask(Allocate(size, tag=AllocTag(self._tag)))
        if ref.generation != self._generation:
            self._adopt(ref.generation)
        slab = _Slab(ref)
        self._slabs.append(slab)
        return slab

    def _adopt(self, generation: int) -> None:
        """Forget what belongs to another generation (its memory went with its context)."""
        self._generation = generation
        self._slabs.clear()
        self._free.clear()
        self._live.clear()

    def _ask(self, message: Any) -> Any:
        return ray_get(self._device.ask.remote(message), "SlabClient", self._timeout_s)

    def free(self, ref: RemoteGpuRef) -> None:
        """Give a carve back to this client for reuse (no Ray call). Idempotent: a carve already
        freed, or of a generation the client left, is a no-op.

        Args:
            ref: a carve made by this client.
        Raises:
            InvalidRequest: not a ``RemoteGpuRef``, a whole block (free those through the
                device), or a live address of this client with another carve serial or size
                (not this client's carve); nothing changes.
        Thread rule: any thread.
        """
        if not isinstance(ref, RemoteGpuRef):
            raise InvalidRequest(f"SlabClient.free takes a RemoteGpuRef, not {type(ref).__name__}")
        if not ref.carve:
            raise InvalidRequest(f"SlabClient.free: {ref.where()} is a whole block; free it through its device")
        with self._lock:
            entry = self._live.get(ref.ptr)
            if entry is None or ref.generation != self._generation:
                return
            carve, size, slab = entry
            if carve != ref.carve:
                if ref.carve < carve and ref.serial == slab.ref.serial:
                    return  # an earlier carve at this address, already freed: the ABA case
                raise InvalidRequest(
                    f"SlabClient.free: {ref.where()} (carve {ref.carve}) is not a carve of this client"
                )
            del self._live[ref.ptr]
            self._free.setdefault(size, []).append((ref.ptr, slab))

    # -- the client's state --------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The generation of the slabs the client carves from (0 before the first reservation).

        Thread rule: any thread.
        """
        return self._generation

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs held (what the device's budget counts for this client).

        Thread rule: any thread.
        """
        with self._lock:
            return sum(s.ref.nbytes for s in self._slabs)

    @property
    def live_carves(self) -> int:
        """Carves handed out and not yet freed.

        Thread rule: any thread.
        """
        with self._lock:
            return len(self._live)

    def refresh(self) -> int:
        """Ask the device its generation (one Ray call); a newer one than the slabs' drops them
        (their carves are stale already), so the next allocation reserves on the new generation.

        Returns:
            The device's generation.
        Raises:
            DeviceUnavailable: the device did not answer in time, or died.
        Thread rule: any thread.
        """
        generation: int = ray_get(self._device.generation.remote(), "SlabClient.refresh", self._timeout_s)
        with self._lock:
            if generation != self._generation:
                self._adopt(generation)
        return generation

    def close(self) -> None:
        """Give every slab back to the device in one Ray call; every carve is then freed memory
        (its descriptor fails with ``GpuRefStale("released")`` where it is read). Idempotent; the
        client may allocate again afterwards.

        Raises:
            DeviceUnavailable: the device did not answer in time, or died (the slabs are
                forgotten here either way: a restarted device does not hold them).
        Thread rule: any thread.
        """
        with self._lock:
            slabs = [s.ref for s in self._slabs]
            self._adopt(self._generation)
        if slabs:
            ray_get(self._device.free_many.remote(slabs), "SlabClient.close", self._timeout_s)
