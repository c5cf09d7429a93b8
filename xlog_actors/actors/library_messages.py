"""Messages of the library actors (``CopyActor``, ``KernelActor``) and kernel argument wrappers.

Every message is a frozen dataclass. A field of the wrong type or value is answered with
``InvalidRequest`` naming the field (``CopyToDevice.data``, ``Launch.args[2]``), before anything
is enqueued. Every message may also be answered with ``GpuRefStale`` (a handle that cannot be
used), ``ContextLost``/``ContextPoisoned`` (reported to the device's supervisor as well) or
``DeviceUnavailable`` (the device is stopped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..driver.kernel import Kernel
from ..memory.block import Access
from .gpu_ref import GpuRef

__all__ = [
    "BufferArg",
    "CopyDeviceToDevice",
    "CopyToDevice",
    "CopyToHost",
    "Fill",
    "In",
    "InOut",
    "Launch",
    "Out",
]


@dataclass(frozen=True, slots=True)
class CopyToDevice:
    """Copy host bytes to the start of a device allocation.

    Fields: ``ref``, the ``GpuRef`` written; ``data``, a C-contiguous buffer of plain data
    (bytes, bytearray, a numpy array of any non-object dtype), 1 to ``ref.nbytes`` bytes long.
    Reply: None once the copy is enqueued; ``ref.last_write_stream`` names the actor's stream.
    Errors: ``InvalidRequest`` naming ``ref`` or ``data`` (not a buffer, an object array, not
    contiguous, empty, longer than the allocation).
    """

    ref: GpuRef
    data: Any


@dataclass(frozen=True, slots=True)
class CopyToHost:
    """Copy the start of a device allocation to the host.

    Fields: ``ref``, the ``GpuRef`` read; ``nbytes``, an int in 1..``ref.nbytes`` (None: all).
    Reply: ``bytes``, once they are on the host (every earlier write to ``ref`` is waited for).
    Errors: ``InvalidRequest`` naming ``ref`` or ``nbytes``.
    """

    ref: GpuRef
    nbytes: int | None = None


@dataclass(frozen=True, slots=True)
class CopyDeviceToDevice:
    """Copy all of one allocation to the start of another.

    The two handles may be of two devices of one driver when one of them is of the copy actor's
    device: a peer copy (``cuMemcpyPeerAsync``) on the actor's stream, ordered after the source's
    last write and the destination's reads and writes on their own devices; the source's free
    then waits for the copy and the destination's last write is the copy.

    Fields: ``src``, the ``GpuRef`` read; ``dst``, another ``GpuRef``, at least as large.
    Reply: None once the copy is enqueued.
    Errors: ``InvalidRequest`` naming ``src`` or ``dst`` (not a handle, too small, the same
    handle, two devices neither of which is the actor's); ``GpuRefStale`` for a released or
    stale handle.
    """

    src: GpuRef
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
