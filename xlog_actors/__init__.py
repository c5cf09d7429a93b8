"""xlog_actors: a device runtime for Python programs that drive GPUs from many actors.

Layers, imported in one direction: ``driver`` -> ``memory`` -> ``runtime`` -> ``actors`` -> ``cli``.
Every public name of the API (``docs/api.md``) is importable from here.
"""

from __future__ import annotations

from typing import Any

from . import driver
from .actors import (
    EXIT_POISONED,
    Allocate,
    AllocateMany,
    AllocatePinned,
    CopyActor,
    CopyDeviceToDevice,
    CopyDone,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    DeviceClient,
    DeviceState,
    DeviceStats,
    Fill,
    Free,
    GenerationChanged,
    GetClient,
    GetMemorySnapshot,
    GetReport,
    GetStats,
    GpuRef,
    In,
    InOut,
    KernelActor,
    Launch,
    Out,
    Rebuild,
    RecordMemoryHistory,
    Subscribe,
    Supervisor,
    Unsubscribe,
    exit_process,
    stop_device,
)
from .driver import (
    Driver,
    Event,
    HostDriver,
    Kernel,
    Stream,
    default_driver,
    open_driver,
)
from .errors import (
    BudgetExceeded,
    ContextLost,
    ContextPoisoned,
    CorruptionDetected,
    DeviceUnavailable,
    DriverError,
    GpuRefStale,
    IllegalTransition,
    InvalidRequest,
    OutOfMemory,
    ResourceError,
    StreamMisuse,
    UseAfterFree,
    XlogError,
)
from .memory import (
    Access,
    AllocTag,
    AsyncCudaResource,
    BlockId,
    BlockState,
    DeviceBlock,
    DeviceMemoryResource,
    DirectCudaResource,
    Generation,
    MemoryHistory,
    StreamId,
    StreamPool,
)
from .memory.adaptors import (
    BudgetResource,
    GuardResource,
    LoggingResource,
    ResourceAdaptor,
    StatisticsResource,
)
from .memory.pinned import PinnedBuffer
from .memory.report import MemoryReport, enrich_out_of_memory, memory_report
from .memory.stack import build_resource
from .runtime import MAX_DEVICE_ORDINALS, XlogDeviceRuntime

__version__ = "0.1.0"

__all__ = [
    "EXIT_POISONED",
    "MAX_DEVICE_ORDINALS",
    "Access",
    "AllocTag",
    "Allocate",
    "AllocateMany",
    "AllocatePinned",
    "AsyncCudaResource",
    "BlockId",
    "BlockState",
    "BudgetExceeded",
    "BudgetResource",
    "ContextLost",
    "ContextPoisoned",
    "CopyActor",
    "CopyDeviceToDevice",
    "CopyDone",
    "CopyToDevice",
    "CopyToHost",
    "CorruptionDetected",
    "CudaDriver",
    "DeviceActor",
    "DeviceBlock",
    "DeviceClient",
    "DeviceMemoryResource",
    "DeviceState",
    "DeviceStats",
    "DeviceUnavailable",
    "DirectCudaResource",
    "Driver",
    "DriverError",
    "Event",
    "Fill",
    "Free",
    "Generation",
    "GenerationChanged",
    "GetClient",
    "GetMemorySnapshot",
    "GetReport",
    "GetStats",
    "GpuRef",
    "GpuRefStale",
    "GuardResource",
    "HostDriver",
    "In",
    "IllegalTransition",
    "InOut",
    "InvalidRequest",
    "Kernel",
    "KernelActor",
    "Launch",
    "LoggingResource",
    "MemoryHistory",
    "MemoryReport",
    "Out",
    "OutOfMemory",
    "PinnedBuffer",
    "Rebuild",
    "RecordMemoryHistory",
    "ResourceAdaptor",
    "ResourceError",
    "StatisticsResource",
    "Stream",
    "StreamId",
    "StreamMisuse",
    "StreamPool",
    "Subscribe",
    "Supervisor",
    "Unsubscribe",
    "UseAfterFree",
    "XlogDeviceRuntime",
    "XlogError",
    "__version__",
    "build_resource",
    "default_driver",
    "enrich_out_of_memory",
    "exit_process",
    "memory_report",
    "open_driver",
    "stop_device",
]


def __getattr__(name: str) -> Any:
    # CudaDriver stays lazy (see the driver package): importing xlog_actors never loads cuda-python.
    if name == "CudaDriver":
        return driver.CudaDriver
    raise AttributeError(f"module 'xlog_actors' has no attribute {name!r}")
