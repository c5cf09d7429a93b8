"""Layer 4: actors. Device state and lifecycle, handles, the device actor, supervision, library
actors, and the messages they answer."""

from __future__ import annotations

from .batch_graph import BatchGraph, GraphDone, HostBinding
from .copy_actor import CopyActor
from .device_actor import DeviceActor
from .device_client import DeviceClient
from .device_context import DeviceContext
from .device_pool import DevicePool, PoolDevice, PoolMember
from .device_state import DeviceState
from .gpu_ref import GpuRef
from .kernel_actor import KernelActor
from .library_messages import (
    CopyDeviceToDevice,
    CopyDone,
    CopyToDevice,
    CopyToHost,
    Fill,
    In,
    InOut,
    Launch,
    Launches,
    Out,
)
from .lifecycle import DeviceLifecycle, DeviceStatus
from .messages import (
    Allocate,
    AllocateMany,
    AllocatePinned,
    DeviceStats,
    Free,
    GenerationChanged,
    GetClient,
    GetMemorySnapshot,
    GetReport,
    GetStats,
    Rebuild,
    RecordMemoryHistory,
    Subscribe,
    Unsubscribe,
)
from .supervisor import EXIT_POISONED, Directive, Supervisor, exit_process, stop_device

__all__ = [
    "EXIT_POISONED",
    "Allocate",
    "AllocateMany",
    "AllocatePinned",
    "BatchGraph",
    "CopyActor",
    "CopyDeviceToDevice",
    "CopyDone",
    "CopyToDevice",
    "CopyToHost",
    "DeviceActor",
    "DeviceClient",
    "DeviceContext",
    "DeviceLifecycle",
    "DevicePool",
    "DeviceState",
    "DeviceStatus",
    "DeviceStats",
    "Directive",
    "Fill",
    "Free",
    "GenerationChanged",
    "GetClient",
    "GetMemorySnapshot",
    "GetReport",
    "GetStats",
    "GpuRef",
    "GraphDone",
    "HostBinding",
    "In",
    "InOut",
    "KernelActor",
    "Launch",
    "Launches",
    "Out",
    "PoolDevice",
    "PoolMember",
    "Rebuild",
    "RecordMemoryHistory",
    "Subscribe",
    "Supervisor",
    "Unsubscribe",
    "exit_process",
    "stop_device",
]
