"""The driver's gates: which device an ordinal names, which streams are this driver's, and the
one preamble of stream work.

Every driver method that takes an ordinal goes through :meth:`CudaGates._device`; every one that
takes a stream goes through :meth:`CudaGates._stream_work` (or, on the inlined hot paths, through
the same checks written out in one expression, then :meth:`CudaGates._stream` for the precise
error). The remaining step of the preamble, the context check, is ``CudaStream._enter`` under the
stream's gate: it must sit in the same ``with s._gate:`` block as the CUDA call it guards, so it
stays at the call site.

Thread rule: everything here may be called from any thread; it reads the device table, which is
fixed at construction.
"""

from __future__ import annotations

from ...errors import DriverError, InvalidRequest
from ..checks import check_ordinal
from .context import CudaDevice
from .streams import CudaStream

__all__ = ["CudaGates", "check_ptr"]


def check_ptr(ptr: object, what: str) -> int:
    """``ptr`` when it is a plain positive int: a device pointer as the driver protocol has it.

    Mirrors the host driver. Range checks are CUDA's.

    Args:
        ptr: the pointer to check.
        what: the device and operation, which start the message.
    Returns:
        ``ptr``.
    Raises:
        DriverError: ``CUDA_ERROR_INVALID_VALUE`` when ``ptr`` is no positive int.
    Thread rule: any thread.
    """
    if type(ptr) is not int or ptr <= 0:
        raise DriverError(f"{what}: {ptr!r} is not a device pointer", code="CUDA_ERROR_INVALID_VALUE")
    return ptr


class CudaGates:
    """The base of :class:`~xlog_actors.driver.cuda.CudaDriver`: its device table and the checks
    that every call naming a device or a stream passes first.

    Invariants: ``_devices[i].ordinal == i`` and every device's ``owner`` is this driver, both
    fixed at construction; ``_closed`` only ever turns True.

    Thread rule: any thread.
    """

    _devices: list[CudaDevice]
    _closed: bool

    def _device(self, ordinal: object) -> CudaDevice:
        ordinal = check_ordinal(ordinal, len(self._devices), "the CUDA driver")
        if self._closed:
            raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
        return self._devices[ordinal]

    def _stream(self, stream: object) -> CudaStream:
        if type(stream) is not CudaStream:
            raise InvalidRequest(f"expected a CudaStream of this driver, got {stream!r}")
        dev = stream._dev
        if dev.ordinal >= len(self._devices) or self._devices[dev.ordinal] is not dev:
            raise InvalidRequest(f"{stream!r} belongs to another driver")
        return stream

    def _stream_work(self, stream: object, *pointers: tuple[object, str]) -> CudaStream:
        """The preamble of work on a stream: ``stream`` resolved as one of this driver's, then
        each ``(pointer, what)`` checked in order (``what`` names the operand in the message).

        The caller then takes the stream's gate and checks the context inside it
        (``with s._gate: dev = s._enter()``) around its CUDA call.
        """
        s = self._stream(stream)
        for ptr, what in pointers:
            check_ptr(ptr, f"device {s.ordinal}: {what}")
        return s
