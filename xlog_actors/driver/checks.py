"""Argument checks every driver and every resource share, and the typed errors they build.

Each check raises before any state is touched, so a refused call changes nothing. The block checks
take anything shaped like a block (``ptr``, ``generation``, ``device_ordinal``): the driver layer
sits below the memory layer and cannot name its ``DeviceBlock``.

:func:`check_launch` is the one judge of a kernel launch for both drivers, so that the host driver
refuses exactly what ``cuLaunchKernel`` refuses, with the same error and code.

Thread rule: every function here is pure (it reads its arguments only); any thread may call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeGuard

import numpy as np

from ..errors import DriverError, InvalidRequest, StreamMisuse, UseAfterFree
from .kernel import PARAM_DTYPES, Kernel
from .limits import MAX_BLOCK_DIMS, MAX_GRID_DIMS, MAX_THREADS_PER_BLOCK

__all__ = [
    "BlockLike",
    "Dim3",
    "Dims",
    "check_device",
    "check_kernel_args",
    "check_launch",
    "check_microseconds",
    "check_nbytes",
    "check_ordinal",
    "unknown_block",
    "unknown_stream",
    "writable_bytes",
]


#: A grid or block shape as ``cuLaunchKernel`` takes it: ``(x, y, z)``.
Dim3 = tuple[int, int, int]

#: A grid or block shape as a launch takes it: an int (``x``) or 1 to 3 ints.
Dims = Sequence[int] | int

_AXES = ("x", "y", "z")
_FLOAT_KINDS = frozenset({"f32", "f64"})
# The values each integer kind's slot holds (a pointer is an unsigned 64-bit slot).
_INT_RANGES = {
    kind: (int(np.iinfo(np.dtype(dtype).name).min), int(np.iinfo(np.dtype(dtype).name).max))
    for kind, dtype in PARAM_DTYPES.items()
    if kind not in _FLOAT_KINDS
}


class BlockLike(Protocol):
    """What the block checks read of a block or a block id.

    Thread rule: read-only; whatever thread owns the block may pass it.
    """

    @property
    def ptr(self) -> int:
        """The block's device address."""
        ...

    @property
    def generation(self) -> int:
        """The generation the block was allocated under."""
        ...

    @property
    def device_ordinal(self) -> int:
        """The ordinal of the device that holds the block."""
        ...


def _is_int(value: object) -> TypeGuard[int]:
    """A Python int that is not a bool (numpy integers are not accepted where this is used)."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def _is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    """A Python or numpy integer that is not a bool: what an integer launch slot accepts."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_nbytes(nbytes: object, what: str = "allocation size") -> int:
    """Check a byte count.

    Args:
        nbytes: the value to check.
        what: names the value in the error message.
    Returns:
        ``nbytes`` as an int.
    Raises:
        InvalidRequest: for anything but a positive int (0, negative, float, bool, None, str...).
    Thread rule: any thread.
    """
    if not _is_int(nbytes):
        raise InvalidRequest(f"{what} must be a positive int, got {nbytes!r} ({type(nbytes).__name__})")
    if nbytes <= 0:
        raise InvalidRequest(f"{what} must be a positive int, got {nbytes}")
    return int(nbytes)


def check_ordinal(ordinal: object, count: int, who: str) -> int:
    """Check a device ordinal.

    Args:
        ordinal: the value to check.
        count: how many devices there are.
        who: which driver or table asks, for the message.
    Returns:
        ``ordinal`` as an int in ``0..count-1``.
    Raises:
        InvalidRequest: when it is not an int or out of range (the message names ``who`` and
            how many devices it has).
    Thread rule: any thread.
    """
    if not _is_int(ordinal):
        raise InvalidRequest(f"device ordinal must be an int, got {ordinal!r}")
    if not 0 <= ordinal < count:
        raise InvalidRequest(f"device ordinal {ordinal} out of range: {who} has {count} device(s)")
    return int(ordinal)


def check_microseconds(microseconds: object) -> float:
    """Check the length of a ``sleep``.

    Args:
        microseconds: the value to check.
    Returns:
        It as a float.
    Raises:
        InvalidRequest: unless it is a non-negative int or float (not a bool).
    Thread rule: any thread.
    """
    if isinstance(microseconds, bool) or not isinstance(microseconds, (int, float)) or microseconds < 0:
        raise InvalidRequest(f"sleep needs a non-negative number of microseconds, got {microseconds!r}")
    return float(microseconds)


def check_kernel_args(kernel: Kernel, args: Sequence[object]) -> None:
    """Check that ``args`` holds one argument per declared parameter of ``kernel``.

    Args:
        kernel: the kernel to launch.
        args: its arguments.
    Raises:
        InvalidRequest: on a count mismatch, naming the kernel and its parameter kinds.
    Thread rule: any thread.
    """
    if len(args) != len(kernel.params):
        raise InvalidRequest(
            f"kernel {kernel.name} takes {len(kernel.params)} arguments {kernel.params}, got {len(args)}"
        )


def _dim_values(value: object, what: str) -> tuple[Any, ...]:
    """The 1 to 3 integers of a grid or block, not yet range-checked; ``InvalidRequest`` for a
    shape that ``cuLaunchKernel`` could not even be called with (not integers, wrong length)."""
    if type(value) is int or _is_integer(value):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        dims = tuple(value)
        if 1 <= len(dims) <= 3 and all(_is_integer(d) for d in dims):
            return dims
    raise InvalidRequest(f"{what} must be an int or 1 to 3 ints, got {value!r}")


def _check_dims(dims: tuple[Any, ...], limits: Dim3, what: str) -> Dim3:
    """``dims`` padded to three, or the ``DriverError`` ``cuLaunchKernel`` returns for a
    dimension below 1 or above the device's limit on that axis."""
    n = len(dims)
    full = (int(dims[0]), int(dims[1]) if n > 1 else 1, int(dims[2]) if n > 2 else 1)
    if 1 <= full[0] <= limits[0] and 1 <= full[1] <= limits[1] and 1 <= full[2] <= limits[2]:
        return full
    axis = next(i for i in range(3) if not 1 <= full[i] <= limits[i])
    raise DriverError(
        f"{what} {full}: dimension {_AXES[axis]} is {full[axis]}, outside 1..{limits[axis]} (the device's limit)",
        code="CUDA_ERROR_INVALID_VALUE",
    )


def _short(value: object) -> str:
    """``repr(value)`` cut to a readable length (an argument may be a 400-digit int)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _arg_problem(kind: str, value: object) -> str | None:
    """Why ``value`` cannot fill a ``kind`` slot, or None when it can: what the CUDA driver's
    argument packing refuses (a wrong type, a bool, an integer out of the slot's range, an int too
    large for a float). A float out of ``f32`` range is not refused: it packs as infinity. On the
    launch path: the common cases (a Python int or float) take one branch each."""
    bounds = _INT_RANGES.get(kind)
    if bounds is not None:
        if not (type(value) is int or _is_integer(value)):
            return f"must be an int, got {_short(value)} ({type(value).__name__})"
        if not bounds[0] <= int(value) <= bounds[1]:
            return f"{_short(value)} does not fit, expected {bounds[0]}..{bounds[1]}"
        return None
    if kind not in _FLOAT_KINDS:
        return f"unknown parameter kind; expected one of {tuple(PARAM_DTYPES)}"
    if type(value) is float:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return f"must be a real number, got {_short(value)} ({type(value).__name__})"
    try:
        float(value)
    except OverflowError:
        return f"{_short(value)} is too large for a float"
    return None


def check_launch(kernel: Kernel, grid: Dims, block: Dims, args: Sequence[object]) -> tuple[Dim3, Dim3]:
    """Judge a kernel launch as CUDA does, before anything is enqueued.

    Both drivers call it first, so a launch the GPU refuses is refused on the host too, with the
    same error: what ``cuLaunchKernel`` could not even be called with (a wrong argument count, a
    grid or block that is not 1 to 3 integers, an argument its parameter slot cannot hold) is an
    ``InvalidRequest``; a dimension ``cuLaunchKernel`` itself refuses (below 1, above the device's
    limit on its axis, or a block of more than :data:`~xlog_actors.driver.limits.MAX_THREADS_PER_BLOCK`
    threads) is the ``DriverError`` with code ``CUDA_ERROR_INVALID_VALUE`` it returns. What CUDA
    only finds while running (a pointer outside any allocation) is not judged here.

    Args:
        kernel: the kernel; its ``params`` give each argument's kind.
        grid: blocks per grid, an int or 1 to 3 ints.
        block: threads per block, an int or 1 to 3 ints.
        args: one value per parameter (pointers as ints).
    Returns:
        ``(grid, block)``, each as an ``(x, y, z)`` tuple of ints.
    Raises:
        InvalidRequest: a wrong argument count, a malformed grid or block, or an argument that
            does not fit its parameter (the message names its index, kind and value).
        DriverError: ``code="CUDA_ERROR_INVALID_VALUE"`` for a dimension out of the device's limits.
    Thread rule: any thread.
    """
    check_kernel_args(kernel, args)
    key = (grid, block) if type(grid) is int and type(block) is int else None
    dims = _GOOD_DIMS.get(key) if key is not None else None
    if dims is None:
        grid_dims = _dim_values(grid, "grid")
        block_dims = _dim_values(block, "block")
    for index, (kind, value) in enumerate(zip(kernel.params, args, strict=True)):
        problem = _arg_problem(kind, value)
        if problem is not None:
            raise InvalidRequest(f"kernel {kernel.name}: argument {index} ({kind}): {problem}")
    if dims is not None:
        return dims
    grid3 = _check_dims(grid_dims, MAX_GRID_DIMS, "grid")
    block3 = _check_dims(block_dims, MAX_BLOCK_DIMS, "block")
    threads = block3[0] * block3[1] * block3[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise DriverError(
            f"block {block3} has {threads} threads, above the device's limit of {MAX_THREADS_PER_BLOCK} per block",
            code="CUDA_ERROR_INVALID_VALUE",
        )
    if key is not None and len(_GOOD_DIMS) < 1024:  # a launch per batch repeats its dimensions
        _GOOD_DIMS[key] = (grid3, block3)
    return grid3, block3


#: (grid, block) given as plain ints -> the padded dimensions they passed the checks as (bounded).
_GOOD_DIMS: dict[tuple[int, int] | None, tuple[Dim3, Dim3]] = {}


def checked_dims(grid: object, block: object) -> tuple[Dim3, Dim3] | None:
    """The padded dimensions a launch with this ``grid`` and ``block`` (plain ints) passed
    :func:`check_launch` with, or None when no launch with them passed it yet (or they are not
    plain ints). Thread rule: any thread."""
    if type(grid) is not int or type(block) is not int:
        return None
    return _GOOD_DIMS.get((grid, block))


def writable_bytes(out: Any) -> memoryview:
    """View the destination of a device-to-host copy as writable bytes.

    Args:
        out: any object exporting the buffer protocol.
    Returns:
        A writable byte view of ``out``.
    Raises:
        InvalidRequest: when ``out`` is read-only.
    Thread rule: any thread.
    """
    target = memoryview(out).cast("B")
    if target.readonly:
        raise InvalidRequest("copy_to_host_into needs a writable buffer")
    return target


def check_device(owner: str, ordinal: int, block: BlockLike) -> None:
    """Check that a block belongs to the asking resource's device.

    Args:
        owner: names the resource that asks.
        ordinal: that resource's device.
        block: the block.
    Raises:
        InvalidRequest: unless ``block`` belongs to device ``ordinal``.
    Thread rule: any thread.
    """
    if block.device_ordinal != ordinal:
        raise InvalidRequest(
            f"{owner}: block {block.ptr:#x} (generation {int(block.generation)}) belongs to device "
            f"{block.device_ordinal}, not to this resource's device {ordinal}"
        )


def unknown_block(owner: str, ordinal: int, block: BlockLike, live_generation: int | None) -> UseAfterFree:
    """Build the error for a block that ``owner`` does not hold live.

    Args:
        owner: names the resource.
        ordinal: its device.
        block: the block it does not know.
        live_generation: the generation of the block now live at the same address (the address
            was reused), or None.
    Returns:
        The ``UseAfterFree`` to raise.
    Thread rule: any thread.
    """
    if live_generation is None:
        why = "no live block at that address (already freed, or never allocated here)"
    else:
        why = f"the live block there is generation {live_generation}: the address was reused"
    return UseAfterFree(
        f"{owner} on device {ordinal}: block {block.ptr:#x} generation {int(block.generation)}: {why}",
        generation=int(block.generation),
    )


def unknown_stream(owner: str, ordinal: int, stream: object) -> StreamMisuse:
    """Build the error for a stream id that device ``ordinal``'s pool does not know.

    Args:
        owner: names the resource.
        ordinal: its device.
        stream: the unknown stream id.
    Returns:
        The ``StreamMisuse`` to raise.
    Thread rule: any thread.
    """
    return StreamMisuse(
        f"{owner} on device {ordinal}: unknown stream {stream!r}; streams come from "
        "StreamPool.acquire() of this device's current context"
    )
