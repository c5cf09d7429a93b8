from typing import Any

from .blocks import AllocTag, StreamId

__all__ = ["ClientCore"]

class ClientCore:
    @property
    def _cell(self) -> Any: ...
    def __init__(self, cell: Any, handle_type: type) -> None: ...
    def allocate(self, nbytes: int, stream: StreamId = ..., tag: AllocTag = ...) -> Any: ...
    def free(self, ref: Any) -> None: ...

_FAST_ENTRIES: int  # allocate and free entries installed (2)
