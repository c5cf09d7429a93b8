"""The raw driver call: ``cuda.bindings.driver``, its constants, and every ``CUresult`` mapped to
a typed error.

The mapping is one small table and one helper:

* ``CUDA_ERROR_OUT_OF_MEMORY`` -> :class:`~xlog_actors.errors.OutOfMemory` (with ``.requested``);
* the sticky set (:data:`STICKY_CODES`: illegal address, illegal instruction, misaligned address,
  invalid address space, invalid PC, launch failure, hardware stack error, assert, launch timeout,
  uncorrectable ECC, and the few codes whose CUDA documentation also says "the process must be
  terminated") -> :class:`~xlog_actors.errors.ContextPoisoned`. After one of them every later call
  in the process fails, even on a reset or new context;
* a destroyed or invalid context (:data:`CONTEXT_LOST_CODES`) ->
  :class:`~xlog_actors.errors.ContextLost`, a :class:`DriverError` the supervisor answers with a
  rebuild;
* everything else -> :class:`~xlog_actors.errors.DriverError`.

``.code`` is always the ``CUresult`` name (``"CUDA_ERROR_INVALID_VALUE"``).

:func:`check` is on the allocation hot path: it compares to ``CUDA_SUCCESS`` first and does
nothing else on success. Everything else here runs only on failures. This module needs neither a
GPU nor libcuda: the table works on names, so it is unit-tested everywhere. Without cuda-python
``cu`` is None and :data:`IMPORT_ERROR` says why; the driver then refuses to start.

Thread rule: everything here may be used from any thread (constants and pure functions).
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

from ...errors import ContextLost, ContextPoisoned, DriverError, OutOfMemory, XlogError

__all__ = [
    "CONTEXT_LOST_CODES",
    "CORE_ENTRY_POINTS",
    "EVENT_FLAGS",
    "IMPORT_ERROR",
    "NOT_READY",
    "OOM_CODES",
    "STICKY_CODES",
    "STREAM_FLAGS",
    "SUCCESS",
    "check",
    "cu",
    "resolve_entry_points",
    "error_class_for",
    "error_for",
    "first_line",
    "result_name",
]

try:  # cuda-python is a dependency, but the table must stay importable without it
    from cuda.bindings import driver as cu

    #: Why ``cu`` is None (the import's error), or None when cuda-python imported.
    IMPORT_ERROR: str | None = None
except ImportError as _exc:  # pragma: no cover - cuda-python is a dependency
    cu = None
    IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

# cuda.bindings' enum members are typed loosely: compare results to them as ``Any``.
if cu is not None:
    #: ``CUDA_SUCCESS``: what every call's result is compared to first.
    SUCCESS: Any = cu.CUresult.CUDA_SUCCESS
    #: ``CUDA_ERROR_NOT_READY``: a query's "not yet", not an error.
    NOT_READY: Any = cu.CUresult.CUDA_ERROR_NOT_READY
    #: The flags of every stream the driver creates (``CU_STREAM_NON_BLOCKING``).
    STREAM_FLAGS: int = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
    #: The flags of every event the driver creates (``CU_EVENT_DISABLE_TIMING``).
    EVENT_FLAGS: int = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    _CUresult: type | None = cu.CUresult
else:  # pragma: no cover
    SUCCESS = 0
    NOT_READY = 600
    STREAM_FLAGS = 1
    EVENT_FLAGS = 2
    _CUresult = None

#: Sticky errors: the context is unusable for the rest of the process. The first ten are the
#: classic faults of a kernel or the hardware; the last four are documented by CUDA with the same "the process must be
#: terminated" consequence (names missing from an older cuda-bindings simply never match).
STICKY_CODES: Final[frozenset[str]] = frozenset(
    {
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTAINED",
        "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        "CUDA_ERROR_EXTERNAL_DEVICE",
        "CUDA_ERROR_TENSOR_MEMORY_LEAK",
    }
)

#: The context is gone (destroyed, reset from outside, never made): rebuild it.
CONTEXT_LOST_CODES: Final[frozenset[str]] = frozenset(
    {
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_INVALID_CONTEXT",
    }
)

#: Out of device memory: ``OutOfMemory``, which carries the byte count asked for.
OOM_CODES: Final[frozenset[str]] = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})


def result_name(result: object) -> str:
    """The ``CUresult`` name of ``result`` (a ``CUresult`` member or a plain int code).

    Unknown ints become ``"CUresult(<n>)"`` rather than raising: an error path must never fail
    while describing an error.

    Args:
        result: a ``CUresult`` member, or its int value.
    Returns:
        The name (``"CUDA_ERROR_INVALID_VALUE"``), or ``"CUresult(<value>)"`` when unknown.
    Thread rule: any thread.
    """
    name = getattr(result, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(result, int) and _CUresult is not None:
        try:
            return str(_CUresult(result).name)
        except ValueError:
            pass
    return f"CUresult({result!r})"


def error_class_for(code: str) -> type[XlogError]:
    """The error class the table gives ``code``.

    Args:
        code: a ``CUresult`` name.
    Returns:
        ``OutOfMemory``, ``ContextPoisoned``, ``ContextLost`` or ``DriverError``.
    Thread rule: any thread.
    """
    if code in OOM_CODES:
        return OutOfMemory
    if code in STICKY_CODES:
        return ContextPoisoned
    if code in CONTEXT_LOST_CODES:
        return ContextLost
    return DriverError


def _describe(result: object) -> str:
    """CUDA's own one-line description of ``result``, or ``""`` when it cannot be had (no
    libcuda, an unknown code). Only ever called on the failure path."""
    if cu is None:
        return ""
    try:
        err, text = cu.cuGetErrorString(result)
    except Exception:  # noqa: BLE001 - no libcuda, or a code the bindings cannot convert
        return ""
    if err != SUCCESS or not text:
        return ""
    return text.decode() if isinstance(text, bytes) else str(text)


def error_for(result: object, what: str, *, requested: int = 0) -> XlogError:
    """The typed error for a failed call (``result`` is not ``CUDA_SUCCESS``).

    ``what`` names the call and its subject (``"device 0: cuMemAlloc(4096 bytes)"``); it starts
    the message. ``requested`` is the byte count of an allocation, carried by ``OutOfMemory``.

    Args:
        result: the failed call's ``CUresult`` (member or int).
        what: the call and its subject, which starts the message.
        requested: bytes an allocation asked for (``OutOfMemory.requested``).
    Returns:
        The typed error (not raised): the class :func:`error_class_for` names, ``.code`` the
        result's name.
    Thread rule: any thread.
    """
    code = result_name(result)
    description = _describe(result)
    message = f"{what} failed: {code}" + (f" ({description})" if description else "")
    cls = error_class_for(code)
    if cls is OutOfMemory:
        return OutOfMemory(message, requested=requested)
    if cls is ContextPoisoned:
        return ContextPoisoned(
            message + "; the context is poisoned for the rest of this process", code=code
        )
    if cls is ContextLost:
        return ContextLost(message + "; the context must be rebuilt", code=code)
    return DriverError(message, code=code)


def check(result: object, what: str, *, requested: int = 0) -> None:
    """Return if ``result`` is ``CUDA_SUCCESS``; else raise :func:`error_for`'s error.

    Hot path: one comparison on success. ``raise ... from None`` keeps the traceback free of
    cuda-python internals.

    Args:
        result: a call's ``CUresult`` (member or int).
        what: the call and its subject, for the message.
        requested: bytes an allocation asked for.
    Raises:
        OutOfMemory, ContextPoisoned, ContextLost, DriverError: per :func:`error_class_for`.
    Thread rule: any thread.
    """
    if result == SUCCESS:
        return
    _raise(result, what, requested)


def _raise(result: object, what: str, requested: int) -> NoReturn:
    raise error_for(result, what, requested=requested) from None


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when it has none).

    What error messages quote of a foreign exception (cuda.pathfinder's, NVRTC's loader's), so
    that no foreign traceback leaks into ours.

    Args:
        exc: the exception to quote.
    Returns:
        One line of text.
    Thread rule: any thread.
    """
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


#: The driver entry points the compiled core (``xlog_actors._core.ops``) calls directly.
CORE_ENTRY_POINTS: Final = (
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuMemAlloc",
    "cuMemFree",
)
# The API version the core's declarations follow: cuMemAlloc/cuMemFree resolve to their _v2
# forms, the rest to their only ones. The core declares these signatures itself, so it is built
# with no cuda.h and matches any driver that serves this version.
_ENTRY_POINT_VERSION: Final = 12000


def resolve_entry_points(names: tuple[str, ...] = CORE_ENTRY_POINTS) -> dict[str, int]:
    """The addresses of driver entry points, from ``cuGetProcAddress`` (``cuInit`` must have run).

    Args:
        names: the entry points, unversioned (``"cuMemAlloc"``).
    Returns:
        name -> function address.
    Raises:
        DriverError: cuda-python is missing, or the driver does not serve one of ``names`` at
            CUDA 12.0's ABI (the message names it).
    Thread rule: any thread.
    """
    if cu is None:
        raise DriverError(f"cuda-python is not importable ({IMPORT_ERROR})")
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    found: dict[str, int] = {}
    for name in names:
        err, pfn, _status = cu.cuGetProcAddress(name.encode(), _ENTRY_POINT_VERSION, flags)
        if err != SUCCESS or not pfn:
            raise DriverError(
                f"the CUDA driver does not serve {name} (CUDA 12.0 ABI): {result_name(err)}",
                code=result_name(err),
            )
        found[name] = int(pfn)
    return found
