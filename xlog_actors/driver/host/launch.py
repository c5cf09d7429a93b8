"""Host kernel launches: the checked view of device memory a host kernel gets, and the work item.

A host kernel runs on its stream's thread and reaches device memory only through
:class:`KernelMemory`, which checks every access as compute-sanitizer's memcheck does: the range
must lie wholly inside one allocation live on the device when the kernel runs. An access that
does not raises ``DriverError`` with ``CUDA_ERROR_ILLEGAL_ADDRESS``; raised inside device work,
that poisons the context, so the runtime meets the same sticky error a GPU would report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import DriverError
from ..checks import Dim3
from ..kernel import Kernel
from .memory import DeviceArena

__all__ = ["KernelMemory", "kernel_work"]


class KernelMemory:
    """The :class:`~xlog_actors.driver.kernel.DeviceMemoryView` a host kernel gets.

    Thread rule: used by one kernel, on its stream's thread.
    """

    __slots__ = ("_arena", "_ordinal")

    def __init__(self, arena: DeviceArena, ordinal: int) -> None:
        """A view of ``arena``, the memory of device ``ordinal``'s current context."""
        self._arena = arena
        self._ordinal = ordinal

    def array(self, ptr: int, count: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """See :meth:`~xlog_actors.driver.kernel.DeviceMemoryView.array`: a numpy view of device
        memory, or ``DriverError`` (``CUDA_ERROR_ILLEGAL_ADDRESS``) for a range outside every
        live allocation; called on the kernel's stream thread."""
        dt = np.dtype(dtype)
        ptr, count = int(ptr), int(count)
        nbytes = count * dt.itemsize
        if count == 0:
            return np.empty(0, dtype=dt)
        if count < 0 or not self._arena.allocations.covers(ptr, nbytes):
            raise DriverError(
                f"device {self._ordinal}: host kernel touched {nbytes} bytes ({count} x {dt}) at {ptr:#x}, "
                "not inside one live allocation (an illegal address, as compute-sanitizer reports it)",
                code="CUDA_ERROR_ILLEGAL_ADDRESS",
            )
        return np.frombuffer(self._arena.mm, dtype=dt, count=count, offset=ptr - self._arena.base)


def kernel_work(
    kernel: Kernel, memory: KernelMemory, grid: Dim3, block: Dim3, args: Sequence[object]
) -> Callable[[], None]:
    """The stream work that runs ``kernel``'s host implementation.

    Args:
        kernel: the kernel, its launch already checked.
        memory: the view of device memory it gets.
        grid: blocks per grid, ``(x, y, z)``.
        block: threads per block, ``(x, y, z)``.
        args: its arguments; copied here, so the caller may reuse the sequence.
    Returns:
        A callable for ``HostStream.enqueue``.
    Thread rule: any thread; the callable runs on the stream's thread.
    """
    values = tuple(args)

    def run() -> None:
        kernel.host(memory, grid, block, *values)

    return run
