import weakref
from collections import deque
from typing import Any

from .blocks import AllocTag, DeviceBlock, StreamId
from .ptr_table import PtrTable

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "ContextCore"]

RECLAIM_WAKE_BYTES: int
RECLAIM_BATCH: int

class ContextCore:
    runtime: Any
    generation: int
    state_ref: weakref.ref[Any]
    token: object
    blocks: PtrTable
    open: bool
    reclaims: deque[DeviceBlock]
    wake_pending: bool
    def __init__(self, runtime: Any, generation: int, state_ref: weakref.ref[Any], token: object,
                 handle_type: type) -> None: ...
    @property
    def runtime_in_c(self) -> bool: ...
    def is_current(self) -> bool: ...
    def rebind_runtime(self) -> None: ...
    def allocate(self, nbytes: int, stream: StreamId, tag: AllocTag) -> Any: ...
    def allocate_many(self, sizes: list[int] | tuple[int, ...], stream: StreamId, tag: AllocTag) -> list[Any]: ...
    def free(self, block: DeviceBlock) -> bool: ...
    def reclaim(self, block: DeviceBlock, wake: bool = False) -> None: ...
    def drain_reclaims(self) -> None: ...
