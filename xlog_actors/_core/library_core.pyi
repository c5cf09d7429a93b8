from collections.abc import Callable
from typing import Any

from .blocks import Access, StreamId

__all__ = ["EnqueueCore"]

class EnqueueCore:
    @property
    def context(self) -> Any: ...
    def __init__(
        self,
        context: Any,
        stream: Any,
        stream_id: StreamId,
        prepare: Callable[[Any, StreamId, Access], None],
        finish: Callable[[Any, StreamId, Access], None],
        read: Access,
        write: Access,
        pinned_type: type,
    ) -> None: ...
    def fill(self, ref: Any, byte: int) -> bool: ...
    def to_device(self, ref: Any, buf: Any) -> bool: ...
    def to_host(self, ref: Any, buf: Any, nbytes: int) -> Any: ...
    def kept(self) -> int: ...
    def prune(self) -> None: ...
    def close(self) -> None: ...
