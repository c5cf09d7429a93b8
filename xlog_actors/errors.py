"""The error hierarchy: every error the runtime raises is an :class:`XlogError`.

Errors carry the context a user needs to act on them (device, block, stream, what was expected)
in their message and, where the public contract names one, in a typed attribute
(``.requested``, ``.generation``, ``.code``, ``.reason``, ``.block``).

Invariant, enforced by the code that raises them: a call that raises leaves every map and counter
exactly as it was before the call.
"""

from __future__ import annotations

from typing import Any, Final, Literal

__all__ = [
    "STALE_REASONS",
    "BudgetExceeded",
    "ContextLost",
    "ContextPoisoned",
    "CorruptionDetected",
    "DeviceUnavailable",
    "DriverError",
    "GpuRefStale",
    "IllegalTransition",
    "InvalidRequest",
    "OutOfMemory",
    "ResourceError",
    "StreamMisuse",
    "UseAfterFree",
    "XlogError",
]


class XlogError(Exception):
    """Base of every error raised by xlog_actors.

    Every error is an immutable report: raised on one thread, it may be handed to another (an
    actor's asker) as it is. It pickles as it is too (a process or a Ray worker hands it on),
    whatever its ``__init__`` takes. Thread rule: any thread.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without calling __init__, whose signature differs per subclass: the message
        # (args) and the context attributes come back as they were.
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _rebuild_error(cls: type[XlogError], args: tuple[Any, ...], state: dict[str, Any]) -> XlogError:
    # BaseException's: MemoryError's own __new__ refuses subclasses (OutOfMemory is one).
    error = BaseException.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ResourceError(XlogError):
    """Base of the allocator errors."""


class InvalidRequest(ResourceError, ValueError):
    """A request the runtime refuses before touching any state: a size that is not a positive
    ``int``, an ordinal out of range, a block of another device, an unknown fault kind, a
    malformed message (the message names the field) or a bad configuration of an actor's
    ``start`` (raised in the caller; nothing is started)."""


class OutOfMemory(ResourceError, MemoryError):
    """The driver (or the host emulator) cannot satisfy a request of ``requested`` bytes.

    The resource that raised it stays usable.
    """

    def __init__(self, message: str, *, requested: int, free: int | None = None) -> None:
        super().__init__(message)
        self.requested: int = requested
        self.free: int | None = free


class BudgetExceeded(OutOfMemory):
    """A budget adaptor refused the request before the driver was called."""

    def __init__(
        self, message: str, *, requested: int, limit: int, outstanding: int
    ) -> None:
        super().__init__(message, requested=requested)
        self.limit: int = limit
        self.outstanding: int = outstanding


class UseAfterFree(ResourceError):
    """A block or ``BlockId`` is unknown to the resource, or its generation does not match the
    live entry at that address (the address was freed and handed out again)."""

    def __init__(self, message: str, *, generation: int) -> None:
        super().__init__(message)
        self.generation: int = generation


class StreamMisuse(ResourceError):
    """An unknown ``StreamId``, or a block-use tracking hook called on a resource that does not
    track (the message then contains ``unsupported``)."""


class DriverError(ResourceError):
    """Any other driver failure. ``code`` is the driver's error name (for example
    ``CUDA_ERROR_INVALID_VALUE``) or ``None`` where there is none."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code: str | None = code


class ContextLost(DriverError):
    """The device's context is gone (destroyed or reset from outside); the device must be rebuilt.

    A :class:`DriverError` subclass, so that code that catches driver errors still catches it,
    and so the supervisor can tell "rebuild" from "resume" by class.
    """


class ContextPoisoned(XlogError):
    """A sticky error (illegal address, launch failure, ...) poisoned the context for the rest of
    the process. ``code`` is the driver's error name."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code: str | None = code


StaleReason = Literal[
    "device state dropped",
    "device shutting down",
    "context rebuilt",
    "context poisoned",
    "released",
]

STALE_REASONS: Final[tuple[str, ...]] = (
    "device state dropped",
    "device shutting down",
    "context rebuilt",
    "context poisoned",
    "released",
)


class GpuRefStale(XlogError):
    """A ``GpuRef`` can no longer be used; ``reason`` is exactly one of :data:`STALE_REASONS`."""

    def __init__(self, reason: StaleReason, detail: str = "") -> None:
        if reason not in STALE_REASONS:
            raise ValueError(f"unknown GpuRefStale reason {reason!r}")
        super().__init__(f"GpuRef stale: {reason}" + (f" ({detail})" if detail else ""))
        self.reason: StaleReason = reason


class DeviceUnavailable(XlogError):
    """No driver library, no such device, or the device was stopped for good."""


class CorruptionDetected(ResourceError):
    """A guard found its canary bytes overwritten. Raised after the block was freed, so nothing
    leaks; ``block`` is the corrupted block."""

    def __init__(self, message: str, *, block: Any) -> None:
        super().__init__(message)
        self.block: Any = block


class IllegalTransition(XlogError):
    """A ``DeviceLifecycle`` was asked for a transition its current status does not allow (for
    example a rebuild of a poisoned device, or any change of a device stopped for good).

    It is raised before anything changes: the lifecycle keeps its status, context and device
    state. ``current`` is the status it was in, ``event`` the transition that was refused.
    """

    def __init__(self, message: str, *, current: str, event: str) -> None:
        super().__init__(message)
        self.current: str = current
        self.event: str = event
