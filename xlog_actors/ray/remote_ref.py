"""``RemoteGpuRef``: what a ``GpuRef`` becomes when it travels through Ray.

A ``GpuRef`` is process-local (it refuses pickling); a :class:`RemoteGpuRef` is a frozen,
picklable descriptor of the same allocation: the node and ordinal of its device, the cluster
generation it was made in, its address, size, tag and last-write stream, and the block's own
serial (its ABA guard, so that a freed and reused address never matches an old descriptor).

Invariants: a descriptor never owns memory. The allocation lives in the
:class:`~xlog_actors.ray.device.RayDevice` that made it until a ``Free`` of the descriptor, or
until that device restarts or rebuilds (then every descriptor of the old generation is stale).
``access()`` compares the descriptor's generation with the device's
:class:`~xlog_actors.ray.keeper.GenerationKeeper`: one Ray round trip, bounded by a timeout, so a
dead node or keeper is a typed error, never a hang.

Thread rule: any thread; a descriptor is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DeviceUnavailable, GpuRefStale
from ._require import require_ray
from .keeper import find_keeper

__all__ = ["RemoteGpuRef"]

#: How long ``access()`` waits for the generation keeper by default, in seconds.
ACCESS_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RemoteGpuRef:
    """A picklable descriptor of one allocation of a Ray-hosted device.

    Fields: ``node_id`` (the Ray node of the device), ``ordinal``, ``generation`` (the cluster
    generation it was made in), ``ptr``, ``nbytes``, ``tag``, ``last_write`` (the ``StreamId``
    value of the last recorded write when the descriptor was made; None: none yet), ``serial``
    (the block's process-wide allocation serial), ``carve`` (0: the whole block; else a
    :class:`~xlog_actors.ray.slab.SlabClient`'s serial of a carve of that block, its ABA guard).

    Thread rule: any thread.
    """

    node_id: str
    ordinal: int
    generation: int
    ptr: int
    nbytes: int
    tag: str
    last_write: int | None
    serial: int
    carve: int = 0

    def where(self) -> str:
        """Context for an error message: node, ordinal, block, generation.

        Returns:
            A short description of the descriptor.
        Thread rule: any thread.
        """
        return f"node {self.node_id[:12]}, device {self.ordinal}, block {self.ptr:#x}, generation {self.generation}"

    def access(self, timeout_s: float = ACCESS_TIMEOUT_S) -> RemoteGpuRef:
        """Validate the descriptor against its device's generation keeper.

        Args:
            timeout_s: how long to wait for the keeper, in seconds.
        Returns:
            ``self``, still valid at the time of the answer.
        Raises:
            GpuRefStale: ``"context rebuilt"`` (the device restarted or rebuilt since),
                ``"device shutting down"`` (the device was stopped), ``"context poisoned"`` (a
                sticky error; a restarted device serves a new generation), ``"device state dropped"``
                (no keeper: its node died, or the device never ran on this cluster).
            DeviceUnavailable: the keeper did not answer within ``timeout_s``.
            ImportError: ray is not installed.
        Thread rule: any thread of a process connected to Ray.
        """
        self._keeper_says("state", timeout_s)
        return self

    def owner(self, timeout_s: float = ACCESS_TIMEOUT_S) -> Any:
        """Validate the descriptor as :meth:`access` does, in the same one Ray call, and find the
        device that serves it.

        Args:
            timeout_s: how long to wait for the keeper, in seconds.
        Returns:
            The Ray actor handle of the :class:`~xlog_actors.ray.device.RayDevice` holding the
            bytes (what :func:`~xlog_actors.ray.fetch.fetch` reads them from).
        Raises:
            GpuRefStale, DeviceUnavailable, ImportError: as :meth:`access`.
        Thread rule: any thread of a process connected to Ray.
        """
        return self._keeper_says("locate", timeout_s)[2]

    def _keeper_says(self, method: str, timeout_s: float) -> tuple[Any, ...]:
        """The keeper's answer to ``method`` (``state`` or ``locate``), checked against this descriptor."""
        ray = require_ray()
        keeper = find_keeper(self.node_id, self.ordinal)
        if keeper is None:
            raise GpuRefStale("device state dropped", f"{self.where()}; no generation keeper")
        try:
            answer: tuple[Any, ...] = ray.get(getattr(keeper, method).remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DeviceUnavailable(f"{self.where()}: the generation keeper did not answer in {timeout_s} s") from None
        except ray.exceptions.RayActorError:
            raise GpuRefStale("device state dropped", f"{self.where()}; the generation keeper died") from None
        generation, stale = answer[0], answer[1]
        if generation != self.generation:
            raise GpuRefStale("context rebuilt", f"{self.where()}; the device is at generation {generation}")
        if stale is not None:
            raise GpuRefStale(stale, self.where())
        return answer
