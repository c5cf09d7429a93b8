"""Argument checks every driver (and the layers above) share. Each raises ``InvalidRequest`` and
runs before any state is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from .kernel import Kernel

__all__ = ["check_kernel_args", "check_microseconds", "check_nbytes", "check_ordinal", "writable_bytes"]


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
