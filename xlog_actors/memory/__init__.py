"""Layer 2: memory. Value types, the resource interface, its two backends, the stream pool and
the adaptors. Written once against the driver protocol."""

from __future__ import annotations

from .._core.async_core import EventPool
from .async_resource import AsyncCudaResource
from .block import Access, AllocTag, BlockId, BlockState, DeviceBlock, Generation, LiveBlock, StreamId
from .device_bound import DeviceBound
from .direct import DirectCudaResource
from .figures import AllocationFigures, AllocationStatistics, BlockCacheFigures
from .history import MemoryHistory
from .pinned import PinnedAllocator, PinnedBuffer, PinnedUsage
from .resource import DeviceMemoryResource
from .sizes import format_size, human_bytes, parse_size
from .stream_pool import StreamPool

__all__ = [
    "Access",
    "AllocTag",
    "AllocationFigures",
    "AllocationStatistics",
    "AsyncCudaResource",
    "BlockCacheFigures",
    "BlockId",
    "BlockState",
    "DeviceBlock",
    "DeviceBound",
    "DeviceMemoryResource",
    "DirectCudaResource",
    "EventPool",
    "Generation",
    "LiveBlock",
    "MemoryHistory",
    "PinnedAllocator",
    "PinnedBuffer",
    "PinnedUsage",
    "StreamId",
    "StreamPool",
    "format_size",
    "human_bytes",
    "parse_size",
]
