"""Messages of the library actors (``CopyActor``, ``KernelActor``) and kernel argument wrappers.

Every message is a frozen dataclass. A field of the wrong type or value is answered with
``InvalidRequest`` naming the field (``CopyToDevice.data``, ``Launch.args[2]``), before anything
is enqueued. Every message may also be answered with ``GpuRefStale`` (a handle that cannot be
used), ``ContextLost``/``ContextPoisoned`` (reported to the device's supervisor as well) or
``DeviceUnavailable`` (the device is stopped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..driver.kernel import Kernel
from ..driver.protocol import Event
from ..errors import InvalidRequest
from ..memory.block import Access
from ..memory.pinned import PinnedBuffer
from .gpu_ref import GpuRef

__all__ = [
    "BufferArg",
    "CopyDeviceToDevice",
    "CopyDone",
    "CopyToDevice",
    "CopyToHost",
    "Fill",
    "In",
    "InOut",
    "Launch",
    "Launches",
    "Out",
]


@dataclass(frozen=True, slots=True)
class CopyToDevice:
    """Copy host bytes to the start of a device allocation.

    Fields: ``ref``, the ``GpuRef`` written; ``data``, a C-contiguous buffer of plain data
    (bytes, bytearray, a numpy array of any non-object dtype), 1 to ``ref.nbytes`` bytes long;
    or a ``PinnedBuffer`` of the same device, copied whole with no staging copy (leave its bytes
    alone until the copy ran).
    Reply: None once the copy is enqueued; ``ref.last_write_stream`` names the actor's stream.
    Errors: ``InvalidRequest`` naming ``ref`` or ``data`` (not a buffer, an object array, not
    contiguous, empty, longer than the allocation; a ``PinnedBuffer`` released or of another
    device or driver).
    """

    ref: GpuRef
    data: Any


@dataclass(frozen=True, slots=True)
class CopyToHost:
    """Copy the start of a device allocation to the host.

    Fields: ``ref``, the ``GpuRef`` read; ``nbytes``, an int in 1..``ref.nbytes`` (None: all);
    ``out``, None or a ``PinnedBuffer`` of the same device (from ``AllocatePinned``, not
    released) of at least ``nbytes`` bytes, whose first ``nbytes`` bytes receive the copy.
    Reply: without ``out``, ``bytes`` once they are on the host. With ``out``, a ``CopyDone``
    as soon as the copy is enqueued, with no synchronize: wait on it before reading ``out``.
    Either way the copy is ordered after every earlier write to ``ref``.
    Errors: ``InvalidRequest`` naming ``ref``, ``nbytes`` or ``out`` (pageable memory where
    pinned is required, a buffer too small, of another device or driver, or released); nothing
    is enqueued then.
    """

    ref: GpuRef
    nbytes: int | None = None
    out: PinnedBuffer | None = None


@dataclass(frozen=True, slots=True)
class CopyDone:
    """The completion of one ``CopyToHost`` into a pinned buffer: an event recorded on the copy
    actor's stream right after the copy.

    Waiting on it waits for that copy alone (and the work queued before it on the same stream),
    never for the device. The pinned buffer stays allocated until the copy ran, even if it is
    released meanwhile.

    Fields: ``out``, the destination buffer; ``nbytes``, how many bytes land at its start;
    ``event``, the driver event recorded after the copy (a stream of the same driver may wait on
    it with ``Stream.wait``, to order device work after the copy without blocking the host).

    Thread rule: any thread; several threads may wait on one.
    """

    out: PinnedBuffer
    nbytes: int
    event: Event = field(repr=False)

    def done(self) -> bool:
        """Whether the bytes have landed; never blocks.

        Returns:
            True once the copy ran.
        Raises:
            DriverError: the device's context was rebuilt or its driver closed before the copy
                was seen to complete (the bytes of ``out`` are then undefined).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        return self.event.query()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bytes have landed in ``out``.

        Args:
            timeout: seconds to wait at most (a non-negative number); None waits as long as the
                copy takes.
        Raises:
            TimeoutError: the copy had not run within ``timeout``.
            InvalidRequest: ``timeout`` is not a non-negative number.
            DriverError: the device's context was rebuilt or its driver closed before the copy
                was seen to complete (the bytes of ``out`` are then undefined).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        if timeout is None:
            self.event.synchronize()
            return
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidRequest(f"CopyDone.wait: timeout must be a non-negative number or None, got {timeout!r}")
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while not self.event.query():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self!r}: the copy had not run after {timeout} s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)


@dataclass(frozen=True, slots=True)
class CopyDeviceToDevice:
    """Copy all of one allocation to the start of another.

    The two handles may be of two devices of one driver when one of them is of the copy actor's
    device: a peer copy (``cuMemcpyPeerAsync``) on the actor's stream, ordered after the source's
    last write and the destination's reads and writes on their own devices; the source's free
    then waits for the copy and the destination's last write is the copy. ``src`` may also be a
    ``SharedGpuRef`` (a handle of a device in another process), or, asked of the copy actor of an
    isolated device, a handle of another isolated device: the copy runs on the destination's
    device after the source's exported last write and replies once it has landed
    (``actors/shared_copy.py``).

    Fields: ``src``, the ``GpuRef`` (or ``SharedGpuRef``) read; ``dst``, another ``GpuRef``, at
    least as large.
    Reply: None once the copy is enqueued (landed, for a source in another process).
    Errors: ``InvalidRequest`` naming ``src`` or ``dst`` (not a handle, too small, the same
    handle, two devices neither of which is the actor's); ``GpuRefStale`` for a released or
    stale handle.
    """

    src: GpuRef  # or a SharedGpuRef (see above)
    dst: GpuRef


@dataclass(frozen=True, slots=True)
class Fill:
    """Set every byte of an allocation.

    Fields: ``ref``, the ``GpuRef`` written; ``byte``, an int in 0..255.
    Reply: None once the fill is enqueued.
    Errors: ``InvalidRequest`` naming ``ref`` or ``byte``.
    """

    ref: GpuRef
    byte: int


@dataclass(frozen=True, slots=True)
class BufferArg:
    """A buffer argument of a kernel: made by :func:`In`, :func:`Out` or :func:`InOut`.

    Fields: ``ref``, the ``GpuRef``; ``access``, how the kernel uses it (the waits and the
    write record follow from it).
    """

    ref: GpuRef
    access: Access


def _buffer_arg(name: str, access: Access, uses: str) -> Callable[[GpuRef], BufferArg]:
    """The wrapper ``name`` of a kernel argument the kernel ``uses``."""

    def wrap(ref: GpuRef) -> BufferArg:
        return BufferArg(ref, access)

    wrap.__name__ = wrap.__qualname__ = name
    wrap.__doc__ = f"""A kernel argument the kernel {uses}: ``BufferArg(ref, {access})``.

    Args:
        ref: the ``GpuRef`` (checked when the ``Launch`` is served).
    Returns:
        the wrapped argument for ``Launch.args``.
    Thread rule: any thread.
    """
    return wrap


In = _buffer_arg("In", Access.READ, "only reads")
Out = _buffer_arg("Out", Access.WRITE, "only writes")
InOut = _buffer_arg("InOut", Access.READ_WRITE, "reads and writes")


@dataclass(frozen=True, slots=True)
class Launch:
    """Launch a kernel.

    Fields: ``kernel``, a ``Kernel``; ``grid`` and ``block``, an int or up to three ints (the
    driver checks them against the device's limits); ``args``, a list or tuple with one entry
    per kernel parameter, in order: ``In``/``Out``/``InOut`` for a ``ptr`` parameter, a scalar
    otherwise.
    Reply: None once the kernel is enqueued; every ``Out``/``InOut`` handle records the write.
    Errors: ``InvalidRequest`` naming ``kernel`` or ``args[i]`` (a bare ``GpuRef``, a buffer
    for a scalar, a scalar for a buffer, the wrong count); the driver's launch errors.
    """

    kernel: Kernel
    grid: int | Sequence[int]
    block: int | Sequence[int]
    args: Sequence[Any]


@dataclass(frozen=True, slots=True)
class Launches:
    """Launch several kernels, in order, on the kernel actor's stream: one message, one tracking
    pass.

    Fields: ``launches``, a non-empty list or tuple of ``Launch``.
    Reply: None once all are enqueued. Before the first launch the stream waits for what any of
    them needs (a handle used by several launches is waited for as the union of its uses);
    after the last, every write is recorded. Within the sequence, stream order alone puts each
    launch after the one before, so a later launch may read what an earlier one wrote.
    Errors: ``InvalidRequest`` naming ``launches`` or ``launches[i]`` and the field, checked for
    every launch, and every launch judged as ``cuLaunchKernel`` judges it, before any is
    enqueued (a refused sequence enqueues nothing); the driver's launch errors.
    """

    launches: Sequence[Launch]
