"""Copies between devices in different processes: a ``CopyDeviceToDevice`` whose source is a
``SharedGpuRef`` (a handle of a device in another process of the node) and whose destination is a
handle of the copy actor's own device.

The copy *pulls*: it runs in the destination's process, on the copy actor's stream, because an
imported handle is a reader's (a write through it would be recorded as no handle's last write).

* **Order.** Before anything is enqueued, the source's exported last write is waited for
  (``SharedGpuRef.wait_write``: the interprocess event recorded at its export, a CUDA
  ``CU_EVENT_INTERPROCESS`` event or the host driver's emulated one; on CUDA the event is opened
  once per export slot in this process, so a write that landed long ago costs one query). The
  destination's use is tracked as any copy's (the copy waits for its readers and writers on this
  device and becomes its last write). The copy's reply comes once it has *landed*, so the source
  may be written, released or freed by its owner as soon as the asker has the reply: the owner's
  tracking cannot see a read made in another process, so the copy does not leave one behind.
* **The path on CUDA: CUDA IPC plus ``cuMemcpyPeerAsync``.** The source's memory is opened in this
  process (``cuIpcOpenMemHandle``, or a pool import for an IPC-capable pool) in the *source*
  device's primary context, and copied with ``cuMemcpyPeerAsync`` from there to the destination:
  directly over NVLink or PCIe where the two devices can reach each other, staged through host
  memory by the driver where they cannot (``cuMemcpyPeerAsync`` needs no peer access to be
  enabled; enabling it would change every kernel's view of the other device, which is no copy's
  business). It costs this process a retain of the source device's primary context on first use.
  A source on the destination's own device (two processes of one GPU) is a plain device copy.
* **Mappings are kept.** The handle a copy reads through comes from :mod:`.import_cache`: a
  second copy of the same exported allocation (same export slot and serial, same owner
  generation) reads through the mapping the first one opened, held open with its count by a
  bounded LRU of this process (the lifetime rule is that module's). The copy's own handle is
  still the one validated and waited for: its export's event marks the source's last write (a
  fresh export, or one an isolated device's copy actor kept because the source's device got no
  library work since: :mod:`.isolated._library`; this process then holds that handle between
  copies and the copy arrives as its token, :mod:`.isolated._sources`).
* **The path on the host driver**: the source's bytes are the owner's shared-memory segment,
  mapped here, and copied into the destination on the copy actor's stream.
* **Enqueued by the asker, landed by the actor.** An isolated device's frame reader, the one
  asker of its copy actors, would otherwise hand each copy to the actor's thread and wait for
  nothing: the actor wakes (a thread hop of 60 to 160 µs on the GPU hosts), enqueues the copy and
  waits for it to land. While the actor is idle the reader serves :class:`EnqueueShared` itself
  (``ServedRef.serve_here``): the checks, the wait for the source's write and the enqueue, on the
  actor's stream, holding the actor's ``exclusive`` lock as any asker-served message does; then,
  still holding it, it queues :class:`LandShared` to the actor, which waits for the copy to land
  and replies. The actor's wake-up then runs while the copy does. Nothing can come between the
  two on the actor's stream: the landing is queued before the lock is let go, so the actor, and
  any other asker, serves it first.

Thread rule: the copy actor's thread, or an asker holding its ``exclusive`` lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..driver.protocol import Driver, Stream
from ..errors import InvalidRequest
from ..memory.block import DeviceBlock
from .import_cache import reader_of
from .library_messages import CopyDeviceToDevice
from .shared_ref import SharedGpuRef

__all__ = ["EnqueueShared", "LandShared", "check_shared_source", "enqueue_from_shared", "path_of"]


@dataclass(frozen=True, slots=True)
class EnqueueShared:
    """A ``CopyDeviceToDevice`` from another process's handle, served in its asker's thread up to
    the enqueue; its landing and reply go to the copy actor (see the module docstring). Not a
    message of the public API: an isolated device's frame reader makes it.

    Fields: ``copy`` (the message, its source the ``SharedGpuRef``), ``reply`` (what the actor
    answers once the copy landed: a ``pykka_internals.Reply``).

    Thread rule: immutable.
    """

    copy: CopyDeviceToDevice
    reply: Any


@dataclass(frozen=True, slots=True)
class LandShared:
    """The second half of :class:`EnqueueShared`, queued to the copy actor by the asker that
    enqueued the copy: wait for the copy to land on ``stream`` (enqueued in ``context``), then
    check that the source's owner did not restart meanwhile.

    Thread rule: immutable.
    """

    src: SharedGpuRef
    stream: Stream
    context: Any


def check_shared_source(src: SharedGpuRef, dst_nbytes: int, driver_kind: str) -> None:
    """Refuse a source that cannot be copied into a destination of ``dst_nbytes`` bytes of a
    ``driver_kind`` device.

    Raises:
        InvalidRequest: too large, or of another driver kind.
        GpuRefStale: the source cannot be used.
    Thread rule: the copy actor's thread.
    """
    src.access()
    if src.nbytes > dst_nbytes:
        raise InvalidRequest(f"CopyDeviceToDevice.src: {src!r} does not fit in dst ({dst_nbytes} bytes)")
    if src.export.driver != driver_kind:
        raise InvalidRequest(
            f"CopyDeviceToDevice.src: {src!r} is memory of a {src.export.driver} driver, the destination's is "
            f"{driver_kind}"
        )


def path_of(src: SharedGpuRef, ordinal: int, driver_kind: str) -> str:
    """The path a copy of ``src`` to device ``ordinal`` takes, as the docs name it.

    Returns:
        ``"host shared memory"``, ``"device copy (same device)"`` or ``"CUDA IPC + cuMemcpyPeerAsync"``.
    Thread rule: any thread.
    """
    if driver_kind != "cuda":
        return "host shared memory"
    return "device copy (same device)" if src.device_id == ordinal else "CUDA IPC + cuMemcpyPeerAsync"


def enqueue_from_shared(driver: Driver, stream: Stream, src: SharedGpuRef, dst: DeviceBlock) -> None:
    """Enqueue the copy of all of ``src`` to the start of ``dst`` on ``stream`` (the caller has
    waited for the source's last write and synchronizes ``stream`` before it lets ``src`` go).

    Raises:
        GpuRefStale: the source went stale.
        DriverError: the source could not be opened here, or the copy was refused.
    Thread rule: the copy actor's thread.
    """
    nbytes = src.nbytes
    reader = reader_of(src)  # the same export's handle whose mapping is open already, or src
    if driver.kind != "cuda":
        driver.copy_to_device(dst.ptr, reader.view(ordered=False)[:nbytes], stream)
        return
    ptr = reader.raw_device_ptr()
    if src.device_id == dst.device_ordinal:
        driver.copy_device_to_device(dst.ptr, ptr, nbytes, stream)
    else:
        driver.copy_peer(dst.device_ordinal, dst.ptr, src.device_id, ptr, nbytes, stream)
