"""What a device kernel is to the driver layer: CUDA C++ for NVRTC plus a host implementation.

The host implementation runs on the host driver's stream thread, in stream order, against the
emulated device memory, so a kernel that reads a buffer before its producer finished reads stale
bytes there exactly as it would on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["PARAM_DTYPES", "DeviceMemoryView", "Kernel", "ParamKind"]

ParamKind = Literal["ptr", "i32", "u32", "i64", "u64", "f32", "f64"]

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
    """What a host kernel implementation sees of device memory."""

    def array(self, ptr: int, count: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """A writable numpy view of ``count`` elements of ``dtype`` at device address ``ptr``.
        An address outside device memory raises, which poisons the context as an illegal
        address would on a GPU."""
        ...


@dataclass(frozen=True)
class Kernel:
    """A device kernel.

    ``name`` is the ``extern "C" __global__`` function in ``source``; ``params`` gives the kind of
    each argument in order (``"ptr"`` for a device pointer); ``host(mem, grid, block, *args)`` is
    the host driver's implementation, called with the same argument values.
    """

    name: str
    source: str
    params: tuple[ParamKind, ...]
    host: Callable[..., None] = field(compare=False)
    options: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash((self.name, self.source, self.params, self.options))
