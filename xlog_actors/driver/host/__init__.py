"""The host driver: the CUDA stream model emulated on host threads and host memory.

One concept per module: :mod:`.driver` (:class:`HostDriver`, the facade, and fault injection),
:mod:`.device` (one emulated device: context state, the gates, the allocator), :mod:`.stream`
(:class:`HostStream`, :class:`HostEvent` and their worker threads), :mod:`.memory` (the emulated
device memory), :mod:`.pinned` (pinned and registered host memory), :mod:`.staging` (the reused
snapshots of pageable copies) and :mod:`.launch` (the checked memory view a host kernel gets).

Thread rule: see each class; every public method of the driver may be called from any thread.
"""

from __future__ import annotations

from .device import FaultKind
from .driver import MAX_EMULATED_DEVICES, HostDriver
from .memory import ALIGNMENT, POISON_BYTE, AddressSpace, DeviceArena, align_up
from .stream import HostEvent, HostStream

__all__ = [
    "ALIGNMENT",
    "MAX_EMULATED_DEVICES",
    "POISON_BYTE",
    "AddressSpace",
    "DeviceArena",
    "FaultKind",
    "HostDriver",
    "HostEvent",
    "HostStream",
    "align_up",
]
