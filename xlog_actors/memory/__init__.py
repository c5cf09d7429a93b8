"""Layer 2: memory. Value types, the resource interface, its two backends, the stream pool and
the adaptors. Written once against the driver protocol."""

from __future__ import annotations

from .async_resource import AsyncCudaResource, LiveBlockInfo
from .block import Access, AllocTag, BlockId, BlockState, DeviceBlock, Generation, StreamId
from .direct import DirectCudaResource
from .event_pool import EventPool
from .resource import DeviceMemoryResource
from .stream_pool import StreamPool

__all__ = [
    "Access",
    "AllocTag",
    "AsyncCudaResource",
    "BlockId",
    "BlockState",
    "DeviceBlock",
    "DeviceMemoryResource",
    "DirectCudaResource",
    "EventPool",
    "Generation",
    "LiveBlockInfo",
    "StreamId",
    "StreamPool",
]
