"""Layer 1: the drivers. The one place that talks to a device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .host import FaultKind, HostDriver, HostEvent, HostStream
from .kernel import DeviceMemoryView, Kernel
from .open import DRIVER_ENV, default_driver, driver_of_kind, open_driver
from .protocol import Driver, DriverKind, Event, Stream

if TYPE_CHECKING:
    from .cuda import CudaDriver

__all__ = [
    "DRIVER_ENV",
    "CudaDriver",
    "DeviceMemoryView",
    "Driver",
    "DriverKind",
    "Event",
    "FaultKind",
    "HostDriver",
    "HostEvent",
    "HostStream",
    "Kernel",
    "Stream",
    "default_driver",
    "driver_of_kind",
    "open_driver",
]


def __getattr__(name: str) -> Any:
    # cuda-python is imported only when the CUDA driver is asked for, so `import xlog_actors`
    # stays fast and never touches libcuda.
    if name == "CudaDriver":
        from .cuda import CudaDriver

        return CudaDriver
    raise AttributeError(name)
