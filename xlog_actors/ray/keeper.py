"""``GenerationKeeper``: the one place a device's generation lives on a Ray cluster.

One named, detached Ray actor per (node, ordinal), named by :func:`keeper_name`, in the
``xlog_actors`` namespace, pinned to the device's node. Every node reads the generation from it;
a :class:`~xlog_actors.ray.device.RayDevice` bumps it on every (re)start before it serves, and
after every context rebuild of the device it hosts.

The keeper also holds the Ray actor handle of the device that serves its generation, so a process
holding only a descriptor finds the device that owns its bytes (:func:`~xlog_actors.ray.fetch.fetch`),
and the Ray actors subscribed to the device (:meth:`GenerationKeeper.subscribe`), whatever node
they run on: it tells each of them ``GenerationChanged`` on every bump (``"running"``), retirement
(``"stopped"``) and poisoning (``"poisoned"``). The list lives here, not in the device, so it
outlives the device's restarts, and the restart's own bump is told like any other.

Invariants: the generation only grows (``bump`` is the only writer of it); the stale reason is
None only between a ``bump`` and the next ``retire`` or ``poison``; a ``poison`` of an older
generation changes nothing (a late report of a device that already restarted).
The keeper lives on the device's node, so a dead node takes its keeper with it and handles of that
device fail with a typed error (``GpuRefStale("device state dropped")``) rather than hang.

Thread rule: a Ray actor runs its methods one at a time; :func:`keeper_handle` and
:func:`find_keeper` may be called from any thread of a process connected to Ray.
"""

from __future__ import annotations

import logging
from typing import Any

from ..actors.messages import GenerationChanged
from ._require import NAMESPACE, require_ray

logger = logging.getLogger(__name__)

__all__ = ["POISONED", "SHUTTING_DOWN", "GenerationKeeper", "find_keeper", "keeper_handle", "keeper_name"]

#: The ``GpuRefStale`` reason of a retired generation (the device was shut down).
SHUTTING_DOWN = "device shutting down"
#: The ``GpuRefStale`` reason of a poisoned generation (a sticky error; a new process must serve).
POISONED = "context poisoned"


class GenerationKeeper:
    """The generation of one (node, ordinal), as a Ray actor's body (see :func:`keeper_handle`).

    Thread rule: Ray serializes its method calls.
    """

    def __init__(self) -> None:
        self._generation = 0
        self._stale: str | None = SHUTTING_DOWN
        self._device: Any = None
        self._subscribers: list[tuple[Any, int]] = []  # (Ray actor handle, the device's ordinal)

    def bump(self, device: Any = None) -> int:
        """Start a new generation (a device (re)started or rebuilt its context) and accept again.

        Args:
            device: the Ray actor handle of the device that serves it; None keeps the one held.
        Returns:
            The new generation.
        Thread rule: the keeper's Ray actor.
        """
        self._generation += 1
        self._stale = None
        if device is not None:
            self._device = device
        self._tell("running")
        return self._generation

    def retire(self) -> None:
        """The device was stopped on purpose: handles of every generation then fail with
        ``GpuRefStale("device shutting down")`` until a new device bumps the generation.

        Thread rule: the keeper's Ray actor.
        """
        self._stale = SHUTTING_DOWN
        self._tell("stopped")

    def poison(self, generation: int) -> None:
        """The device of ``generation`` met a sticky error: its handles then fail with
        ``GpuRefStale("context poisoned")`` until a new device (a restarted process) bumps.

        Args:
            generation: the cluster generation the device served; an older one changes nothing.
        Thread rule: the keeper's Ray actor.
        """
        if generation == self._generation and self._stale != POISONED:
            self._stale = POISONED
            self._tell("poisoned")

    def subscribe(self, subscriber: Any, ordinal: int) -> None:
        """Tell ``subscriber`` ``GenerationChanged`` from now on (a no-op when it is already).

        Args:
            subscriber: a Ray actor handle with a method ``on_generation_changed(message)``,
                called fire-and-forget; one that died is dropped at its next message.
            ordinal: the device's ordinal, the messages' ``device_id``.
        Thread rule: the keeper's Ray actor.
        """
        if all(_actor_id(s) != _actor_id(subscriber) for s, _ in self._subscribers):
            self._subscribers.append((subscriber, ordinal))

    def unsubscribe(self, subscriber: Any) -> None:
        """Stop telling ``subscriber`` (a no-op when it is not subscribed).

        Thread rule: the keeper's Ray actor.
        """
        self._subscribers = [(s, o) for s, o in self._subscribers if _actor_id(s) != _actor_id(subscriber)]

    def _tell(self, status: str) -> None:
        kept = []
        for subscriber, ordinal in self._subscribers:
            try:
                subscriber.on_generation_changed.remote(GenerationChanged(ordinal, self._generation, status))
            except Exception as exc:  # noqa: BLE001 - a dead or wrong subscriber must not stop the device
                logger.info("generation keeper: dropped subscriber %r: %r", subscriber, exc)
                continue
            kept.append((subscriber, ordinal))
        self._subscribers = kept

    def state(self) -> tuple[int, str | None]:
        """``(generation, stale)``.

        Returns:
            The current generation, and None while a device serves it, else the ``GpuRefStale``
            reason every handle gets (``"device shutting down"``, ``"context poisoned"``).
        Thread rule: the keeper's Ray actor.
        """
        return self._generation, self._stale

    def locate(self) -> tuple[int, str | None, Any]:
        """``state()`` and the serving device's Ray actor handle (None: no device ever bumped).

        Returns:
            ``(generation, stale, device)``.
        Thread rule: the keeper's Ray actor.
        """
        return self._generation, self._stale, self._device


def _actor_id(handle: Any) -> Any:
    # Two handles of one Ray actor compare by the actor's id.
    return getattr(handle, "_actor_id", handle)


def keeper_name(node_id: str, ordinal: int) -> str:
    """The Ray actor name of the keeper of ``(node_id, ordinal)``.

    Args:
        node_id: a Ray node id (hex).
        ordinal: the device ordinal on that node.
    Returns:
        The name, unique per (node, ordinal) in the ``xlog_actors`` namespace.
    Thread rule: any thread.
    """
    return f"generation:{node_id}:{ordinal}"


def keeper_handle(node_id: str, ordinal: int) -> Any:
    """The keeper of ``(node_id, ordinal)``, made (detached, pinned to that node, no CPU
    reserved) if it does not exist yet.

    Args:
        node_id: the Ray node id of the device.
        ordinal: the device ordinal.
    Returns:
        The keeper's Ray actor handle.
    Raises:
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_keeper = ray.remote(GenerationKeeper)
    return remote_keeper.options(
        name=keeper_name(node_id, ordinal),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote()


def find_keeper(node_id: str, ordinal: int) -> Any | None:
    """The keeper of ``(node_id, ordinal)`` if it exists; never makes one.

    Args:
        node_id: the Ray node id of the device.
        ordinal: the device ordinal.
    Returns:
        Its Ray actor handle, or None when there is none (never started, or its node died).
    Raises:
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    try:
        return ray.get_actor(keeper_name(node_id, ordinal), namespace=NAMESPACE)
    except ValueError:
        return None
