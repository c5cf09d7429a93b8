"""Cross-node fetch: a descriptor's bytes, moved when asked for, through Ray's object store.

A :class:`~xlog_actors.ray.remote_ref.RemoteGpuRef` names memory on one node. :func:`fetch` brings
its bytes to the caller, :func:`fetch_to` into a block of another ``RayDevice`` (the bytes go from
the producer's node to the consumer's, never through the caller), :func:`fetch_into` into a local
``GpuRef`` through the caller's ``CopyActor``. No socket code of ours: the producer's
``RayDevice.read`` returns a numpy array, which Ray's object store carries; the consumer lands
Ray's read-only view of it with one copy (:mod:`.landing`).

Invariants:

* Every fetch is validated first, in one Ray call to the generation keeper (as ``access()``),
  which also names the device that holds the bytes; the device checks the descriptor again when it
  reads (a restart between the two is caught there: ``GpuRefStale``, nothing copied).
* The bytes are those of the block after every write recorded on it before the read: the
  producer's ``CopyActor`` orders its copy after the block's last write (a kernel still running is
  waited for on the device, not by the caller).
* Every Ray wait is bounded by ``timeout_s``: a dead node, device or keeper is a typed error
  (``GpuRefStale``, ``DeviceUnavailable``), never a hang. A typed error raised by a device comes
  back as itself, not wrapped in Ray's ``RayTaskError``.

Thread rule: any thread of a process connected to Ray; :func:`fetch_into` also asks the given
``CopyActor`` (not from that actor's own thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pykka

from ..actors import GpuRef
from ..errors import DeviceUnavailable, InvalidRequest, XlogError
from ._require import require_ray
from .landing import land
from .remote_ref import RemoteGpuRef

__all__ = ["FETCH_TIMEOUT_S", "fetch", "fetch_into", "fetch_to", "open_on_node", "ray_get"]

#: How long a fetch waits for each Ray call, in seconds, by default.
FETCH_TIMEOUT_S = 30.0


def ray_get(pending: Any, what: str, timeout_s: float) -> Any:
    """``ray.get(pending)`` with Ray's failures as the runtime's typed errors.

    Args:
        pending: an ``ObjectRef`` (or a list of them).
        what: context for the error message (the descriptor's ``where()``, say).
        timeout_s: how long to wait, in seconds.
    Returns:
        The value.
    Raises:
        XlogError: the one the remote call raised, as itself.
        DeviceUnavailable: no answer within ``timeout_s``, or the remote actor, its node or the
            object (the call's or one of its arguments') died (Ray's reason in the message).
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    try:
        return ray.get(pending, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise DeviceUnavailable(f"{what}: no answer in {timeout_s} s") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, XlogError):
            raise exc.cause from None
        if isinstance(exc.cause, ray.exceptions.RayError):
            # An argument of the call failed on the way (its actor restarted, its node died).
            raise _unavailable(what, exc.cause) from None
        raise
    except ray.exceptions.RayError as exc:
        raise _unavailable(what, exc) from None


def _unavailable(what: str, exc: BaseException) -> DeviceUnavailable:
    return DeviceUnavailable(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0]}")


def fetch(ref: RemoteGpuRef, *, timeout_s: float = FETCH_TIMEOUT_S) -> np.ndarray:
    """The bytes of ``ref``, wherever its device runs.

    Args:
        ref: the descriptor (a block, or a carve of one).
        timeout_s: the bound on each Ray wait, in seconds.
    Returns:
        A read-only ``uint8`` array of ``ref.nbytes`` bytes.
    Raises:
        GpuRefStale: the descriptor is stale (a restart, a rebuild, a shutdown, a poisoned
            device, a freed block, a dead node).
        DeviceUnavailable: the keeper or the device did not answer in time, or died.
        InvalidRequest: ``ref`` is not a ``RemoteGpuRef``.
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray.
    """
    device = _producer(ref, timeout_s)
    data: np.ndarray = ray_get(device.read.remote(ref), ref.where(), timeout_s)
    return data


def fetch_to(ref: RemoteGpuRef, consumer: Any, dst: RemoteGpuRef, *, timeout_s: float = FETCH_TIMEOUT_S) -> None:
    """Copy the bytes of ``ref`` to the start of ``dst``, a block of the ``RayDevice`` ``consumer``
    (typically on another node). The bytes go from the producer's node to the consumer's through
    Ray's object store, never through the caller; the call returns once the consumer enqueued the
    copy, so its later reads and kernels see the bytes.

    Args:
        ref: the source descriptor.
        consumer: the Ray actor handle of the ``RayDevice`` that owns ``dst``.
        dst: a whole-block descriptor of ``consumer``, at least ``ref.nbytes`` long.
        timeout_s: the bound on each Ray wait, in seconds.
    Raises:
        GpuRefStale, DeviceUnavailable: as :func:`fetch`, for either side.
        InvalidRequest: ``dst`` is not of ``consumer``, or too small; nothing is written.
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray.
    """
    device = _producer(ref, timeout_s)
    # An ObjectRef as a top-level argument: Ray resolves it on the consumer's node.
    ray_get(consumer.write.remote(dst, device.read.remote(ref)), f"{ref.where()} to {dst.where()}", timeout_s)


def fetch_into(
    ref: RemoteGpuRef, copy: pykka.ActorRef[Any], dst: GpuRef, *, timeout_s: float = FETCH_TIMEOUT_S
) -> None:
    """Copy the bytes of ``ref`` to the start of ``dst``, a block of a device in this process,
    through its ``CopyActor`` ``copy``; returns once the copy is enqueued (later work of that device
    on ``dst`` is ordered after it by tracking).

    Args:
        ref: the source descriptor.
        copy: a ``CopyActor`` of ``dst``'s device.
        dst: the local handle, at least ``ref.nbytes`` long.
        timeout_s: the bound on each Ray wait and on the copy actor's answer, in seconds.
    Raises:
        GpuRefStale, DeviceUnavailable: as :func:`fetch`; ``GpuRefStale`` for a stale ``dst``;
            ``DeviceUnavailable`` also when ``copy`` does not answer within ``timeout_s``.
        InvalidRequest: ``dst`` too small or of another device than ``copy``'s.
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray, not ``copy``'s own.
    """
    data = fetch(ref, timeout_s=timeout_s)
    try:
        land(copy, dst, data, timeout_s)
    except pykka.Timeout:
        raise DeviceUnavailable(f"{ref.where()}: the CopyActor did not take the bytes in {timeout_s} s") from None


def open_on_node(ref: RemoteGpuRef, *, timeout_s: float = FETCH_TIMEOUT_S) -> Any:
    """Open ``ref`` in place from a process on its device's own node: no bytes move. The device
    exports the block (CUDA IPC; shared memory on the host driver) and this process gets a
    ``SharedGpuRef`` of the same memory: ``view()`` on the host driver, ``raw_device_ptr()``,
    ``__cuda_array_interface__`` and DLPack on CUDA; ``wait_write()`` or an ordered read waits for
    the block's last write; it validates against the device's generation on every ``access()``,
    so a restart of the device process makes it stale at once. ``release()`` it when done.

    Args:
        ref: a whole-block descriptor of a ``RayDevice`` started with ``isolate=`` (or of one
            whose memory can be exported).
        timeout_s: the bound on each Ray wait, in seconds.
    Returns:
        The ``SharedGpuRef``.
    Raises:
        InvalidRequest: ``ref`` is on another node (fetch it instead), not a ``RemoteGpuRef``,
            or of a device whose memory cannot be exported.
        GpuRefStale, DeviceUnavailable: as :func:`fetch`.
        ImportError: ray is not installed.
    Thread rule: any thread of a process connected to Ray.
    """
    ray = require_ray()
    if not isinstance(ref, RemoteGpuRef):
        raise InvalidRequest(f"open_on_node takes a RemoteGpuRef, not {type(ref).__name__}")
    here = ray.get_runtime_context().get_node_id()
    if here != ref.node_id:
        raise InvalidRequest(f"open_on_node: {ref.where()} is on another node than this one ({here[:12]}): fetch it")
    device = _producer(ref, timeout_s)
    return ray_get(device.export.remote(ref), ref.where(), timeout_s)


def _producer(ref: RemoteGpuRef, timeout_s: float) -> Any:
    """The device serving ``ref``, validated through its keeper."""
    if not isinstance(ref, RemoteGpuRef):
        raise InvalidRequest(f"a fetch takes a RemoteGpuRef, not {type(ref).__name__}")
    return ref.owner(timeout_s)
