"""What a device kernel is to the driver layer: CUDA C++ for NVRTC plus a host implementation.

The host implementation runs on the host driver's stream thread, in stream order, against the
emulated device memory, so a kernel that reads a buffer before its producer finished reads stale
bytes there exactly as it would on a GPU.

Thread rule: a :class:`Kernel` is immutable; any thread may read, hash or launch it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["PARAM_DTYPES", "DeviceMemoryView", "Kernel", "ParamKind"]

#: The kind of one kernel parameter: a device pointer, a 32- or 64-bit signed or unsigned integer,
#: or a 32- or 64-bit float.
ParamKind = Literal["ptr", "i32", "u32", "i64", "u64", "f32", "f64"]

#: The numpy type each parameter kind is packed as; an integer argument must fit its range.
PARAM_DTYPES: dict[str, type[np.generic]] = {
    "ptr": np.uint64,
    "i32": np.int32,
    "u32": np.uint32,
    "i64": np.int64,
    "u64": np.uint64,
    "f32": np.float32,
    "f64": np.float64,
}


class DeviceMemoryView(Protocol):
    """What a host kernel implementation sees of device memory.

    Thread rule: used only by the kernel it was handed to, on its stream's thread.
    """

    def array(self, ptr: int, count: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """View device memory as a numpy array, checked as compute-sanitizer checks an access.

        Args:
            ptr: the device address of the first element.
            count: how many elements; 0 touches nothing and is never refused.
            dtype: their numpy type.
        Returns:
            A writable numpy view of ``count`` elements of ``dtype`` at ``ptr``.
        Raises:
            DriverError: ``code="CUDA_ERROR_ILLEGAL_ADDRESS"`` unless the range lies wholly inside
                one allocation live on the device when the kernel runs (or ``count`` is negative).
                Raised inside device work, it poisons the context as the illegal address would
                on a GPU.
        Thread rule: the kernel's stream thread.
        """
        ...


@dataclass(frozen=True)
class Kernel:
    """A device kernel.

    ``name`` is the ``extern "C" __global__`` function in ``source``; ``params`` gives the kind of
    each argument in order (``"ptr"`` for a device pointer); ``host(mem, grid, block, *args)`` is
    the host driver's implementation, called on the stream's thread with a
    :class:`DeviceMemoryView`, the grid and block as ``(x, y, z)`` tuples and the same argument
    values; ``options`` are extra NVRTC options. Two kernels are equal when their name, source,
    params and options are (the host implementation is not compared).

    Thread rule: immutable; any thread.
    """

    name: str
    source: str
    params: tuple[ParamKind, ...]
    host: Callable[..., None] = field(compare=False)
    options: tuple[str, ...] = ()

    #: The hash of the compared fields, computed once: a launch's plan lookup hashes the kernel.
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.source, self.params, self.options)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Kernel], tuple[object, ...]]:
        # Rebuilt from its fields in the receiving process: a string's hash differs between
        # processes, so the hash computed here must not travel with it.
        return (type(self), (self.name, self.source, self.params, self.host, self.options))
