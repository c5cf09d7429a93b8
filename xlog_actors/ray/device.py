"""``RayDevice``: a device as a Ray actor, its generation held cluster-wide.

The Ray actor hosts a local ``DeviceActor`` (pykka), a ``CopyActor`` and a ``KernelActor`` in its
worker process and answers the device messages (docs/api.md, "Messages and replies") through one
method, ``ask(message)``:
``Allocate``/``AllocateMany`` reply with :class:`~xlog_actors.ray.remote_ref.RemoteGpuRef`
descriptors (a ``GpuRef`` is process-local and stays in the worker), ``Free`` takes a descriptor,
``GetStats`` and ``Rebuild`` pass through, and the library messages (``CopyToDevice``,
``CopyToHost``, ``Fill``, ``Launch``) take descriptors where they take handles. ``read`` and
``write`` move a descriptor's bytes as numpy arrays, which is what a cross-node fetch
(:mod:`xlog_actors.ray.fetch`) sends through Ray's object store.

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
  reference counting).
* A descriptor is served only if it names this device, the generation it serves and a block it
  still holds; otherwise ``GpuRefStale`` (another generation, a freed block) or
  ``InvalidRequest`` (another device), and nothing runs.
* ``read`` is ordered after the block's last recorded write by the hosted ``CopyActor``'s
  tracking (a kernel still running on A is waited for, on the device, before the bytes leave).
  On the host driver a copy of one byte so ordered is waited for, and the method returns a
  read-only view of device memory, which Ray's serializer copies once into its object store
  before the actor runs its next call; on another driver the block is copied into one pinned
  staging buffer the size of the largest read so far, held until shutdown.
* ``write`` on the host driver registers a read-only argument (Ray's view of its object store,
  whose bytes never change while referenced) with the driver, so the copy into the block reads it
  when it runs: one copy, no snapshot; anything else goes through ``CopyToDevice`` as it is.
* A sticky error (``ContextPoisoned``) marks the generation poisoned in the keeper before the
  asker gets the error; the relay does the same when the device reports it on its own. With
  ``restart_on_poison`` the worker process then ends, and Ray's restart serves generation + 1.

Longer than ~400 lines: the message translation, the generation and the poisoning share the
handle table and its lock, and splitting them would spread one invariant over two modules.

Thread rule: Ray runs the actor's methods one at a time (``max_concurrency`` 1); the relay that
hears ``GenerationChanged`` runs on a pykka thread and shares only the generations and the handle
table, under a lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pykka

from ..actors import (
    Allocate,
    AllocateMany,
    AllocatePinned,
    CopyActor,
    CopyDone,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    Fill,
    Free,
    GenerationChanged,
    GetStats,
    GpuRef,
    KernelActor,
    Launch,
    Rebuild,
    Subscribe,
    Supervisor,
    Unsubscribe,
    exit_process,
)
from ..actors.device_config import ResourceSpec
from ..actors.isolated import ChildFault
from ..actors.library_messages import BufferArg
from ..driver.host import HostDriver
from ..driver.open import DRIVER_KINDS, open_driver
from ..driver.protocol import Driver
from ..errors import ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest
from ..memory import AllocTag, PinnedBuffer
from ._require import require_ray
from .keeper import keeper_handle
from .landing import land
from .remote_ref import RemoteGpuRef

__all__ = ["RayDevice", "start_ray_device"]

#: The generation of a descriptor made stale at birth: keepers start at 1.
STALE_GENERATION = 0

#: How long the device waits for its keeper (a bump, a retirement, a poisoning), in seconds.
_KEEPER_TIMEOUT_S = 10.0

#: The tag of the pinned buffer that reads land in (``RayDevice.read``).
_STAGING_TAG = AllocTag("ray-fetch-staging")

#: What ``RayDevice.ask`` answers; the others need a process-local object (an ``ActorRef``, a
#: ``DeviceClient``) that cannot travel.
_RAY_MESSAGES = (
    "Allocate, AllocateMany, Free (of a RemoteGpuRef), GetStats, Rebuild, "
    "CopyToDevice, CopyToHost, Fill or Launch (of RemoteGpuRefs), "
    "Subscribe or Unsubscribe (of a Ray actor handle), ChildFault (isolated devices only)"
)


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
        restart_on_poison: bool = False,
        isolate: str | None = None,
    ) -> None:
        """Bump the cluster generation of (this node, ``ordinal``), then start the device.

        Args:
            ordinal: the device ordinal on this node.
            driver_factory: makes the driver in the worker; None for the host driver.
            resource: the device's stack, as ``DeviceActor.start``.
            restart_on_poison: on a sticky error, mark the generation poisoned, then end the
                worker process (``EXIT_POISONED``) so that Ray restarts the actor on a new
                generation (within its ``max_restarts``); False: stay poisoned.
            isolate: None: the device runs in this worker. A driver kind (``"host"``,
                ``"cuda"``, ``"auto"``): the device runs in the process mode
                (``DeviceActor.start(..., isolate=True, ipc_pool=True)``), in a child process of
                the worker that the worker's proxy replaces after a sticky error or a crash,
                each replacement a new cluster generation, while this Ray actor lives on
                (``driver_factory`` and ``restart_on_poison`` must then be left out).
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
        self._stage: PinnedBuffer | None = None
        self._isolated = isolate is not None
        if self._isolated:
            # The child process opens its own driver; a poisoned child is replaced by the proxy.
            self._device = DeviceActor.start(ordinal, isolate, resource, isolate=True, ipc_pool=True)
        else:
            driver = (driver_factory or _host_driver)()
            supervisor = Supervisor(on_poisoned=self._exit_poisoned) if restart_on_poison else None
            self._device = DeviceActor.start(ordinal=ordinal, driver=driver, resource=resource, supervisor=supervisor)
        self._local_generation: int = self._device.ask(GetStats(), block=True).generation
        self._copy = CopyActor.start(self._device)
        self._kernels = KernelActor.start(self._device)
        # Made only once the device started: a start that fails leaves no keeper behind.
        self._keeper = keeper_handle(self._node_id, ordinal)
        # Bumped after the device is up and before __init__ returns: Ray lets no call in before.
        # The keeper keeps this actor's handle, so a descriptor's holder can find its bytes.
        me = ray.get_runtime_context().current_actor
        self._generation: int = ray.get(self._keeper.bump.remote(me), timeout=_KEEPER_TIMEOUT_S)
        self._relay = _GenerationRelay.start(self._on_generation_changed)
        self._device.ask(Subscribe(self._relay))

    # -- the generation ------------------------------------------------------------------------
    def _sync_generation(self, local_generation: int) -> None:
        """Bump the cluster generation once per new local generation; drop the old handles."""
        with self._lock:
            if local_generation == self._local_generation:
                return
            self._local_generation = local_generation
            self._generation = self._ray.get(self._keeper.bump.remote(), timeout=_KEEPER_TIMEOUT_S)
            # The old context took their memory; their frees would be ignored anyway.
            self._refs.clear()

    def _on_generation_changed(self, message: GenerationChanged) -> None:
        if message.status == "running":
            self._sync_generation(message.generation)
        elif message.status == "poisoned":
            self._poison()

    def _poison(self) -> None:
        """Mark the generation poisoned in the keeper (idempotent): its descriptors stop validating."""
        with self._lock:
            generation = self._generation
            self._refs.clear()  # the poisoned context's memory is gone with the process
        self._ray.get(self._keeper.poison.remote(generation), timeout=_KEEPER_TIMEOUT_S)

    def _exit_poisoned(self, device_id: int, error: BaseException) -> None:
        """The supervisor's escalation hook under ``restart_on_poison``: the keeper first (so no
        descriptor validates while Ray restarts the actor), then the process ends."""
        if hasattr(self, "_keeper"):  # a poisoning during the start has no keeper to mark yet
            try:
                self._poison()
            except Exception:  # noqa: BLE001 - the process ends either way; the restart bumps
                pass
        exit_process(device_id, error)

    def _served(self, call: Callable[[], Any]) -> Any:
        """``call()``; a sticky error poisons the keeper before the asker sees it."""
        try:
            return call()
        except ContextPoisoned:
            self._poison()
            raise

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

    def _check_device(self, what: str, ref: Any) -> RemoteGpuRef:
        if not isinstance(ref, RemoteGpuRef):
            raise InvalidRequest(f"{what} through Ray takes a RemoteGpuRef, not {type(ref).__name__}")
        if ref.node_id != self._node_id or ref.ordinal != self._ordinal:
            raise InvalidRequest(
                f"{what}: {ref.where()} is not of this device (node {self._node_id[:12]}, device {self._ordinal})"
            )
        return ref

    def _local(self, what: str, ref: Any, *, whole: bool = True) -> GpuRef:
        """The handle a descriptor names, checked: this device, this generation, still held;
        ``whole``: the descriptor is the whole block (not a carve of a slab)."""
        ref = self._check_device(what, ref)
        with self._lock:
            generation = self._generation
            local = self._refs.get(ref.serial) if ref.generation == generation else None
        if ref.generation != generation:
            raise GpuRefStale("context rebuilt", f"{ref.where()}; the device serves generation {generation}")
        if local is None:
            raise GpuRefStale("released", ref.where())
        block = local.block
        inside = block.ptr <= ref.ptr and ref.ptr + ref.nbytes <= block.ptr + block.nbytes
        if not inside or (whole and (ref.carve or (ref.ptr, ref.nbytes) != (block.ptr, block.nbytes))):
            raise InvalidRequest(
                f"{what}: {ref.where()}, {ref.nbytes} bytes, is not "
                + ("the whole block" if inside else "inside the block")
                + f" of serial {ref.serial} ({block.ptr:#x}, {block.nbytes} bytes)"
            )
        return local

    def _free(self, ref: Any) -> None:
        ref = self._check_device("Free", ref)
        with self._lock:
            if ref.generation != self._generation:
                return  # an older generation's memory went with its context: a no-op, as Free says
            local = self._refs.get(ref.serial)
        if local is None:
            return  # already freed: Free is idempotent
        if ref.carve or (ref.ptr, ref.nbytes) != (local.block.ptr, local.block.nbytes):
            raise InvalidRequest(f"Free: {ref.where()} is a carve of a slab, not a block: free it where it was carved")
        self._device.ask(Free(local))
        with self._lock:
            self._refs.pop(ref.serial, None)

    def _library(self, message: Any) -> Any:
        """A library message with descriptors, served with the handles they name."""
        if isinstance(message, Launch):
            if not isinstance(message.args, (list, tuple)):
                raise InvalidRequest(f"Launch.args must be a list or tuple, not {type(message.args).__name__}")
            args = [
                BufferArg(self._local(f"Launch.args[{i}]", a.ref), a.access) if isinstance(a, BufferArg) else a
                for i, a in enumerate(message.args)
            ]
            return self._kernels.ask(dataclasses.replace(message, args=args))
        name = type(message).__name__
        return self._copy.ask(dataclasses.replace(message, ref=self._local(name, message.ref)))

    def ask(self, message: Any) -> Any:
        """Answer one of the device messages (docs/api.md, "Messages and replies").

        Args:
            message: ``Allocate``, ``AllocateMany``, ``Free`` (its ``ref`` a
                :class:`RemoteGpuRef` of this device), ``GetStats``, ``Rebuild``, or
                ``CopyToDevice``, ``CopyToHost``, ``Fill``, ``Launch`` with descriptors of this
                device (whole blocks) where they take handles; ``Subscribe``/``Unsubscribe``
                of a Ray actor handle whose ``on_generation_changed(message)`` is then told
                ``GenerationChanged`` on every restart, rebuild, poisoning and shutdown, by
                the generation's keeper (so across restarts of this actor, on any node).
        Returns:
            ``Allocate``: a :class:`RemoteGpuRef`; ``AllocateMany``: a list of them; ``Free``:
            None; ``GetStats``: the hosted device's ``DeviceStats`` (its ``generation`` is the
            local one; :meth:`generation` is the cluster's); ``Rebuild``: as the device; the
            library messages: as the hosted ``CopyActor``/``KernelActor`` reply; ``Subscribe``,
            ``Unsubscribe``: None (idempotent).
        Raises:
            InvalidRequest: another message, a descriptor of another device, or a carve where a
                block is needed; nothing changes.
            GpuRefStale: a descriptor of another generation or of a freed block; nothing runs.
            DeviceUnavailable: the device was shut down.
            XlogError: the device's typed errors, as ``DeviceActor`` raises them;
                ``ContextPoisoned`` after marking the generation poisoned in the keeper.
        Thread rule: a Ray call.
        """
        self._check_running()
        return self._served(lambda: self._answer(message))

    def _check_running(self) -> None:
        if self._stopped:
            raise DeviceUnavailable(f"device {self._ordinal} on node {self._node_id[:12]} was shut down")

    def _answer(self, message: Any) -> Any:
        if isinstance(message, Allocate):
            return self._describe(self._device.ask(message, block=True))
        if isinstance(message, AllocateMany):
            refs: Sequence[GpuRef] = self._device.ask(message, block=True)
            return [self._describe(r) for r in refs]
        if isinstance(message, Free):
            self._free(message.ref)
            return None
        if isinstance(message, GetStats):
            return self._device.ask(message)
        if isinstance(message, Rebuild):
            reply = self._device.ask(message)
            self._sync_generation(self._device.ask(GetStats(), block=True).generation)
            return reply
        if isinstance(message, (CopyToDevice, CopyToHost, Fill, Launch)):
            return self._library(message)
        if isinstance(message, (Subscribe, Unsubscribe)):
            return self._subscription(message)
        if isinstance(message, ChildFault) and self._isolated:
            return self._device.ask(message)  # the process mode's test hook
        raise InvalidRequest(f"a RayDevice answers {_RAY_MESSAGES}, not {type(message).__name__}")

    def export(self, ref: RemoteGpuRef) -> GpuRef:
        """The handle a descriptor names, for a process on this node to open in place: Ray
        pickles it here, which exports the block (CUDA IPC, or shared memory on the host
        driver), and the caller's ``ray.get`` gets a ``SharedGpuRef`` of the same memory (see
        :func:`xlog_actors.ray.open_on_node`).

        Args:
            ref: a whole-block descriptor of this device and generation, still held.
        Returns:
            The worker's ``GpuRef`` (it arrives as a ``SharedGpuRef``).
        Raises:
            GpuRefStale, InvalidRequest, DeviceUnavailable: as :meth:`read`; ``InvalidRequest``
                also when the device's memory cannot be exported (an in-process device on the
                plain host driver or on CUDA's default pool: start it with ``isolate``).
        Thread rule: a Ray call.
        """
        self._check_running()
        local = self._local("export", ref)
        if not self._isolated:
            driver = local.context.driver
            if isinstance(driver, HostDriver) and not driver.shared:
                raise InvalidRequest(
                    f"export: {ref.where()} lives in this worker's private memory; a RayDevice started "
                    "with isolate= keeps it in memory other processes of the node can open"
                )
        return local

    def _subscription(self, message: Subscribe | Unsubscribe) -> None:
        # The keeper holds the subscribers: they are told of this device's restarts too.
        subscriber = message.actor_ref
        if not callable(getattr(getattr(subscriber, "on_generation_changed", None), "remote", None)):
            raise InvalidRequest(
                f"a RayDevice's {type(message).__name__} takes the handle of a Ray actor with an "
                f"on_generation_changed method, got {type(subscriber).__name__}"
            )
        if isinstance(message, Subscribe):
            call = self._keeper.subscribe.remote(subscriber, self._ordinal)
        else:
            call = self._keeper.unsubscribe.remote(subscriber)
        self._ray.get(call, timeout=_KEEPER_TIMEOUT_S)

    def read(self, ref: RemoteGpuRef) -> np.ndarray:
        """The bytes of a descriptor (a block, or a carve of one), once every write recorded on
        the block before this call has run on the device.

        Args:
            ref: a descriptor of this device and generation, still held.
        Returns:
            A read-only ``uint8`` array of ``ref.nbytes`` bytes (what Ray's object store sends).
        Raises:
            GpuRefStale: another generation (``"context rebuilt"``), or a freed block
                (``"released"``); nothing is copied.
            InvalidRequest: not a descriptor of this device, or not inside its block.
            DeviceUnavailable: the device was shut down.
            XlogError: the copy's typed errors (``ContextPoisoned`` poisons the keeper first).
        Thread rule: a Ray call.
        """
        self._check_running()

        def copy_out() -> np.ndarray:
            local = self._local("read", ref, whole=False)
            start = ref.ptr - local.block.ptr
            driver = local.context.driver
            if isinstance(driver, HostDriver):
                # A copy of one byte, ordered after the block's last write, says the writes ran;
                # the bytes then leave through a view of device memory, copied once, by Ray's
                # serializer (no later work reaches this block before that: Ray runs this
                # actor's next call only once the return value is in its object store).
                self._after_last_write(local, 1)
                view = driver.device_view(local.context.ordinal, ref.ptr, ref.nbytes)
                return np.frombuffer(view, dtype=np.uint8)
            # CopyToHost copies from the start of the block; a carve's bytes are a suffix of that.
            if self._isolated:
                # The memory is the child's: its copy actor copies it out, after the last write.
                data = cast(bytes, self._copy.ask(CopyToHost(local, start + ref.nbytes)))
                return np.frombuffer(data, dtype=np.uint8)[start:]
            stage = self._after_last_write(local, start + ref.nbytes)
            array: np.ndarray = stage.array()[start : start + ref.nbytes]
            return array

        array: np.ndarray = self._served(copy_out)
        return array

    def _after_last_write(self, local: GpuRef, nbytes: int) -> PinnedBuffer:
        """Copy the first ``nbytes`` of ``local``'s block to the staging buffer, ordered after
        the block's last recorded write, and wait until the copy ran; returns the buffer."""
        stage = self._staging(nbytes)
        done = cast(CopyDone, self._copy.ask(CopyToHost(local, nbytes, out=stage)))
        done.wait()
        return stage

    def _staging(self, nbytes: int) -> PinnedBuffer:
        """The pinned buffer reads land in, grown to ``nbytes``. One is reused: Ray copies a
        method's return value into its object store before it runs the next call of this actor
        (one at a time), and a pinned destination saves the copy a pageable one costs."""
        stage = self._stage
        if stage is None or stage.nbytes < nbytes:
            if stage is not None:
                stage.release()
            stage = self._stage = cast(PinnedBuffer, self._device.ask(AllocatePinned(nbytes, tag=_STAGING_TAG)))
        return stage

    def write(self, ref: RemoteGpuRef, data: Any) -> None:
        """Copy host bytes to the start of a descriptor's block (``CopyToDevice``); later reads,
        copies and kernels of this device are ordered after it.

        Args:
            ref: a whole-block descriptor of this device and generation, still held.
            data: a buffer of 1 to ``ref.nbytes`` bytes (a numpy array from the object store); a
                read-only one must not change until the copy ran (Ray's never does).
        Raises:
            GpuRefStale, InvalidRequest, DeviceUnavailable, XlogError: as :meth:`read`, and
                ``CopyToDevice``'s (a buffer that does not fit); nothing is written then.
        Thread rule: a Ray call.
        """
        self._check_running()

        def copy_in() -> None:
            land(self._copy, self._local("write", ref), data)

        self._served(copy_in)

    def free_many(self, refs: Sequence[RemoteGpuRef]) -> None:
        """``Free`` each descriptor, in one Ray call (a slab client gives its slabs back so).

        Args:
            refs: whole-block descriptors of this device.
        Raises:
            InvalidRequest: one is not of this device or is a carve; those before it are freed.
            DeviceUnavailable: the device was shut down.
        Thread rule: a Ray call.
        """
        self._check_running()
        for ref in refs:
            self._free(ref)

    def shutdown(self) -> None:
        """Stop the hosted device for good and mark its generation retired (every descriptor then
        fails ``access()`` with ``GpuRefStale("device shutting down")``). Idempotent.

        Thread rule: a Ray call.
        """
        with self._lock:
            self._refs.clear()
        self._stopped = True
        if self._stage is not None:
            self._stage.release()
            self._stage = None
        for actor in (self._relay, self._copy, self._kernels, self._device):
            if actor.is_alive():
                actor.stop()
        self._ray.get(self._keeper.retire.remote(), timeout=_KEEPER_TIMEOUT_S)


def start_ray_device(
    ordinal: int = 0,
    *,
    node_id: str | None = None,
    driver_factory: Callable[[], Driver] | None = None,
    resource: ResourceSpec = None,
    max_restarts: int = 1,
    num_gpus: float = 0,
    name: str | None = None,
    restart_on_poison: bool = False,
    isolate: str | None = None,
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
        restart_on_poison: a sticky error ends the worker process (after marking the generation
            poisoned), so Ray restarts the device on a new generation; False: it stays poisoned.
        isolate: None, or a driver kind (``"host"``, ``"cuda"``, ``"auto"``): the device runs in
            the process mode, in a child process of the Ray worker (see :class:`RayDevice`); a
            sticky error then restarts only that child, and the Ray actor lives on.
    Returns:
        The Ray actor handle; call ``handle.ask.remote(message)``.
    Raises:
        ImportError: ray is not installed.
        InvalidRequest: a negative ``max_restarts``; ``isolate`` not a driver kind, or given with
            ``driver_factory`` or ``restart_on_poison``. Nothing is started.
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if max_restarts < 0:
        raise InvalidRequest(f"max_restarts must be >= 0, got {max_restarts}")
    if isolate is not None:
        if isolate not in DRIVER_KINDS:
            raise InvalidRequest(f"isolate must be None or a driver kind, one of {DRIVER_KINDS}, got {isolate!r}")
        if driver_factory is not None or restart_on_poison:
            raise InvalidRequest(
                "isolate= runs the device in a child process that opens its own driver and is replaced after a "
                "sticky error: leave out driver_factory and restart_on_poison"
            )
    node = node_id or ray.get_runtime_context().get_node_id()
    options: dict[str, Any] = {
        "max_restarts": max_restarts,
        "num_cpus": 0,
        "num_gpus": num_gpus,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    }
    if name is not None:
        options["name"] = name
    device = ray.remote(RayDevice).options(**options)
    return device.remote(ordinal, driver_factory, resource, restart_on_poison, isolate)
