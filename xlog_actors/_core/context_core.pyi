import weakref
from typing import Any

from .blocks import AllocTag, DeviceBlock, StreamId

__all__ = ["ContextCore"]

class ContextCore:
    runtime: Any
    generation: int
    state_ref: weakref.ref[Any]
    token: object
    blocks: dict[int, DeviceBlock]
    open: bool
    def __init__(self, runtime: Any, generation: int, state_ref: weakref.ref[Any], token: object,
                 handle_type: type) -> None: ...
    def is_current(self) -> bool: ...
    def allocate(self, nbytes: int, stream: StreamId, tag: AllocTag) -> Any: ...
    def free(self, block: DeviceBlock) -> bool: ...
