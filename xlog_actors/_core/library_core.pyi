from collections.abc import Callable
from typing import Any

from .blocks import Access, StreamId

__all__ = ["KEEP_SLACK", "EnqueueCore"]

KEEP_SLACK: int

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
        buffer_arg_type: type,
    ) -> None: ...
    def fill(self, ref: Any, byte: int) -> bool: ...
    def to_device(self, ref: Any, buf: Any) -> bool: ...
    def to_host(self, ref: Any, buf: Any, nbytes: int) -> Any: ...
    def learn(
        self, kernel: Any, grid: Any, block: Any, dims: tuple[tuple[int, int, int], tuple[int, int, int]]
    ) -> bool: ...
    def launch(self, msg: Any) -> bool: ...
    def kept(self) -> int: ...
    def prune(self) -> None: ...
    def close(self) -> None: ...
