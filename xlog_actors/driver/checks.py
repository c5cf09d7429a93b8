"""Argument checks every driver and every resource share, and the typed errors they build.

Each check raises before any state is touched, so a refused call changes nothing. The block checks
take anything shaped like a block (``ptr``, ``generation``, ``device_ordinal``): the driver layer
sits below the memory layer and cannot name its ``DeviceBlock``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidRequest, StreamMisuse, UseAfterFree

if TYPE_CHECKING:
    from .kernel import Kernel

__all__ = [
    "BlockLike",
    "check_device",
    "check_kernel_args",
    "check_microseconds",
    "check_nbytes",
    "check_ordinal",
    "unknown_block",
    "unknown_stream",
    "writable_bytes",
]


class BlockLike(Protocol):
    """What the block checks read of a block or a block id."""

    @property
    def ptr(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def device_ordinal(self) -> int: ...


def _is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def check_nbytes(nbytes: object, what: str = "allocation size") -> int:
    """``nbytes`` as an int, or ``InvalidRequest`` for anything but a positive int (0, negative,
    float, bool, None, str...)."""
    if not _is_int(nbytes):
        raise InvalidRequest(f"{what} must be a positive int, got {nbytes!r} ({type(nbytes).__name__})")
    if nbytes <= 0:  # type: ignore[operator]
        raise InvalidRequest(f"{what} must be a positive int, got {nbytes}")
    return int(nbytes)  # type: ignore[call-overload]


def check_ordinal(ordinal: object, count: int, who: str) -> int:
    """``ordinal`` as an int in ``0..count-1``, else ``InvalidRequest`` naming ``who`` (which
    driver, or which table) and how many devices it has."""
    if not _is_int(ordinal):
        raise InvalidRequest(f"device ordinal must be an int, got {ordinal!r}")
    if not 0 <= ordinal < count:  # type: ignore[operator]
        raise InvalidRequest(f"device ordinal {ordinal} out of range: {who} has {count} device(s)")
    return int(ordinal)  # type: ignore[call-overload]


def check_microseconds(microseconds: object) -> float:
    """A non-negative number of microseconds for ``sleep``."""
    if isinstance(microseconds, bool) or not isinstance(microseconds, (int, float)) or microseconds < 0:
        raise InvalidRequest(f"sleep needs a non-negative number of microseconds, got {microseconds!r}")
    return float(microseconds)


def check_kernel_args(kernel: Kernel, args: Sequence[object]) -> None:
    """One argument per declared parameter of ``kernel``."""
    if len(args) != len(kernel.params):
        raise InvalidRequest(
            f"kernel {kernel.name} takes {len(kernel.params)} arguments {kernel.params}, got {len(args)}"
        )


def writable_bytes(out: Any) -> memoryview:
    """``out`` as a writable byte view: the destination of a device-to-host copy."""
    target = memoryview(out).cast("B")
    if target.readonly:
        raise InvalidRequest("copy_to_host_into needs a writable buffer")
    return target


def check_device(owner: str, ordinal: int, block: BlockLike) -> None:
    """Raise ``InvalidRequest`` unless ``block`` belongs to device ``ordinal``; ``owner`` names
    the resource that asks."""
    if block.device_ordinal != ordinal:
        raise InvalidRequest(
            f"{owner}: block {block.ptr:#x} (generation {int(block.generation)}) belongs to device "
            f"{block.device_ordinal}, not to this resource's device {ordinal}"
        )


def unknown_block(owner: str, ordinal: int, block: BlockLike, live_generation: int | None) -> UseAfterFree:
    """The ``UseAfterFree`` for a block that ``owner`` does not hold live: ``live_generation`` is
    that of the block now live at the same address (the address was reused), or None."""
    if live_generation is None:
        why = "no live block at that address (already freed, or never allocated here)"
    else:
        why = f"the live block there is generation {live_generation}: the address was reused"
    return UseAfterFree(
        f"{owner} on device {ordinal}: block {block.ptr:#x} generation {int(block.generation)}: {why}",
        generation=int(block.generation),
    )


def unknown_stream(owner: str, ordinal: int, stream: object) -> StreamMisuse:
    """The ``StreamMisuse`` for a stream id that device ``ordinal``'s pool does not know."""
    return StreamMisuse(
        f"{owner} on device {ordinal}: unknown stream {stream!r}; streams come from "
        "StreamPool.acquire() of this device's current context"
    )
