"""``RayDevice``: a device as a Ray actor, its generation held cluster-wide.

The Ray actor hosts a local ``DeviceActor`` (pykka) in its worker process and answers the SPEC's
messages through one method, ``ask(message)``: ``Allocate``/``AllocateMany`` reply with
:class:`~xlog_actors.ray.remote_ref.RemoteGpuRef` descriptors (a ``GpuRef`` is process-local and
stays in the worker), ``Free`` takes a descriptor, ``GetStats`` and ``Rebuild`` pass through.

Invariants:

* The cluster generation of (node, ordinal) lives in its
  :class:`~xlog_actors.ray.keeper.GenerationKeeper`. Each (re)start of the Ray actor bumps it in
  ``__init__``, before Ray lets any call in; so after a restart every older descriptor fails
  ``access()`` with ``GpuRefStale``.
* A rebuild of the hosted device's context (asked with ``Rebuild``, or ordered by its supervisor)
  also bumps it: a ``Rebuild`` before its reply; a supervisor's rebuild when the device tells its
  ``GenerationChanged`` (a window of one Ray call in which an old descriptor still validates).
* A descriptor carries the cluster generation of the local generation its handle was made in;
  a handle whose generation a rebuild already left behind gets ``STALE_GENERATION`` (0, which no
  keeper ever holds), so it never validates.
* The worker holds every ``GpuRef`` it handed out as a descriptor until a ``Free`` of that
  descriptor or a new generation; a descriptor dropped elsewhere does not free (no distributed
  reference counting in step 1).

Thread rule: Ray runs the actor's methods one at a time (``max_concurrency`` 1); the relay that
hears ``GenerationChanged`` runs on a pykka thread and shares only the generations and the handle
table, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pykka

from ..actors import Allocate, AllocateMany, DeviceActor, Free, GenerationChanged, GetStats, GpuRef, Rebuild, Subscribe
from ..actors.device_config import ResourceSpec
from ..driver.open import open_driver
from ..driver.protocol import Driver
from ..errors import DeviceUnavailable, InvalidRequest
from ._require import require_ray
from .keeper import keeper_handle
from .remote_ref import RemoteGpuRef

__all__ = ["RayDevice", "start_ray_device"]

#: The generation of a descriptor made stale at birth: keepers start at 1.
STALE_GENERATION = 0

#: What ``RayDevice.ask`` answers; the others need a process-local object (an ``ActorRef``, a
#: ``DeviceClient``) that cannot travel.
_RAY_MESSAGES = "Allocate, AllocateMany, Free (of a RemoteGpuRef), GetStats or Rebuild"


def _host_driver() -> Driver:
    return open_driver("host")


class _GenerationRelay(pykka.ThreadingActor):
    """Hears the hosted device's ``GenerationChanged`` and hands it to the ``RayDevice``."""

    def __init__(self, on_change: Callable[[GenerationChanged], None]) -> None:
        super().__init__()
        self._on_change = on_change

    def on_receive(self, message: Any) -> None:
        if isinstance(message, GenerationChanged):
            self._on_change(message)


class RayDevice:
    """The body of a device's Ray actor; start one with :func:`start_ray_device`.

    Thread rule: Ray serializes the calls; see the module docstring for the relay thread.
    """

    def __init__(
        self,
        ordinal: int = 0,
        driver_factory: Callable[[], Driver] | None = None,
        resource: ResourceSpec = None,
    ) -> None:
        """Bump the cluster generation of (this node, ``ordinal``), then start the device.

        Args:
            ordinal: the device ordinal on this node.
            driver_factory: makes the driver in the worker; None for the host driver.
            resource: the device's stack, as ``DeviceActor.start``.
        Raises:
            InvalidRequest, DeviceUnavailable: as ``DeviceActor.start``.
        Thread rule: the Ray actor's (re)start, before any call.
        """
        ray = require_ray()
        self._ray = ray
        self._ordinal = ordinal
        self._node_id: str = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()
        self._refs: dict[int, GpuRef] = {}
        self._stopped = False
        driver = (driver_factory or _host_driver)()
        self._device = DeviceActor.start(ordinal=ordinal, driver=driver, resource=resource)
        self._local_generation: int = self._device.ask(GetStats(), block=True).generation
        # Made only once the device started: a start that fails leaves no keeper behind.
        self._keeper = keeper_handle(self._node_id, ordinal)
        # Bumped after the device is up and before __init__ returns: Ray lets no call in before.
        self._generation: int = ray.get(self._keeper.bump.remote())
        self._relay = _GenerationRelay.start(self._on_generation_changed)
        self._device.ask(Subscribe(self._relay))

    # -- the generation ------------------------------------------------------------------------
    def _sync_generation(self, local_generation: int) -> None:
        """Bump the cluster generation once per new local generation; drop the old handles."""
        with self._lock:
            if local_generation == self._local_generation:
                return
            self._local_generation = local_generation
            self._generation = self._ray.get(self._keeper.bump.remote())
            # The old context took their memory; their frees would be ignored anyway.
            self._refs.clear()

    def _on_generation_changed(self, message: GenerationChanged) -> None:
        if message.status == "running":
            self._sync_generation(message.generation)

    def generation(self) -> int:
        """The cluster generation this device serves.

        Returns:
            The generation its keeper holds for it.
        Thread rule: a Ray call.
        """
        with self._lock:
            return self._generation

    def node_id(self) -> str:
        """The Ray node the device runs on.

        Returns:
            Its node id (hex).
        Thread rule: a Ray call.
        """
        return self._node_id

    # -- messages ------------------------------------------------------------------------------
    def _describe(self, ref: GpuRef) -> RemoteGpuRef:
        block = ref.block
        last = ref.last_write_stream
        with self._lock:
            if ref.generation == self._local_generation:
                self._refs[int(block.generation)] = ref
                generation = self._generation
            else:
                # A rebuild came between the allocation and here and its bump already landed: the
                # handle is already stale, so is its descriptor (no keeper is ever at 0).
                generation = STALE_GENERATION
        return RemoteGpuRef(
            node_id=self._node_id,
            ordinal=self._ordinal,
            generation=generation,
            ptr=block.ptr,
            nbytes=block.nbytes,
            tag=str(block.tag),
            last_write=None if last is None else int(last),
            serial=int(block.generation),
        )

    def _free(self, ref: RemoteGpuRef) -> None:
        if ref.node_id != self._node_id or ref.ordinal != self._ordinal:
            raise InvalidRequest(
                f"Free: {ref.where()} is not of this device (node {self._node_id[:12]}, device {self._ordinal})"
            )
        with self._lock:
            if ref.generation != self._generation:
                return  # an older generation's memory went with its context: a no-op, as Free says
            local = self._refs.get(ref.serial)
        if local is None:
            return  # already freed: Free is idempotent
        self._device.ask(Free(local))
        with self._lock:
            self._refs.pop(ref.serial, None)

    def ask(self, message: Any) -> Any:
        """Answer one of the SPEC's messages.

        Args:
            message: ``Allocate``, ``AllocateMany``, ``Free`` (its ``ref`` a
                :class:`RemoteGpuRef` of this device), ``GetStats`` or ``Rebuild``.
        Returns:
            ``Allocate``: a :class:`RemoteGpuRef`; ``AllocateMany``: a list of them; ``Free``:
            None; ``GetStats``: the hosted device's ``DeviceStats`` (its ``generation`` is the
            local one; :meth:`generation` is the cluster's); ``Rebuild``: as the device.
        Raises:
            InvalidRequest: another message, or a ``Free`` of a handle of another device;
                nothing changes.
            DeviceUnavailable: the device was shut down.
            XlogError: the device's typed errors, as ``DeviceActor`` raises them.
        Thread rule: a Ray call.
        """
        if self._stopped:
            raise DeviceUnavailable(f"device {self._ordinal} on node {self._node_id[:12]} was shut down")
        if isinstance(message, Allocate):
            return self._describe(self._device.ask(message, block=True))
        if isinstance(message, AllocateMany):
            refs: Sequence[GpuRef] = self._device.ask(message, block=True)
            return [self._describe(r) for r in refs]
        if isinstance(message, Free):
            if not isinstance(message.ref, RemoteGpuRef):
                raise InvalidRequest(f"Free through Ray takes a RemoteGpuRef, not {type(message.ref).__name__}")
            self._free(message.ref)
            return None
        if isinstance(message, GetStats):
            return self._device.ask(message)
        if isinstance(message, Rebuild):
            reply = self._device.ask(message)
            self._sync_generation(self._device.ask(GetStats(), block=True).generation)
            return reply
        raise InvalidRequest(f"a RayDevice answers {_RAY_MESSAGES}, not {type(message).__name__}")

    def shutdown(self) -> None:
        """Stop the hosted device for good and mark its generation retired (every descriptor then
        fails ``access()`` with ``GpuRefStale("device shutting down")``). Idempotent.

        Thread rule: a Ray call.
        """
        with self._lock:
            self._refs.clear()
        self._stopped = True
        if self._relay.is_alive():
            self._relay.stop()
        if self._device.is_alive():
            self._device.stop()
        self._ray.get(self._keeper.retire.remote())


def start_ray_device(
    ordinal: int = 0,
    *,
    node_id: str | None = None,
    driver_factory: Callable[[], Driver] | None = None,
    resource: ResourceSpec = None,
    max_restarts: int = 1,
    num_gpus: float = 0,
    name: str | None = None,
) -> Any:
    """Start a :class:`RayDevice` as a Ray actor pinned to a node.

    Args:
        ordinal: the device ordinal on that node.
        node_id: the Ray node to run on; None for the caller's node.
        driver_factory: makes the driver in the worker; None for the host driver.
        resource: the device's stack, as ``DeviceActor.start``.
        max_restarts: how often Ray restarts the actor after it dies (each restart bumps the
            generation).
        num_gpus: GPUs the actor reserves; 0 for the host driver.
        name: an optional Ray actor name (in the caller's namespace).
    Returns:
        The Ray actor handle; call ``handle.ask.remote(message)``.
    Raises:
        ImportError: ray is not installed.
        InvalidRequest: a negative ``max_restarts``.
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if max_restarts < 0:
        raise InvalidRequest(f"max_restarts must be >= 0, got {max_restarts}")
    node = node_id or ray.get_runtime_context().get_node_id()
    options: dict[str, Any] = {
        "max_restarts": max_restarts,
        "num_cpus": 0,
        "num_gpus": num_gpus,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    }
    if name is not None:
        options["name"] = name
    return ray.remote(RayDevice).options(**options).remote(ordinal, driver_factory, resource)
