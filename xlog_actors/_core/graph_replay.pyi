from collections.abc import Callable, Sequence
from typing import Any

from .blocks import Access, StreamId

__all__ = ["ReplayCore"]

class ReplayCore:
    def __init__(
        self,
        driver: Any,
        ordinal: int,
        stream: Any,
        stream_id: StreamId,
        prepare: Callable[[Any, StreamId, Access], None] | None,
        finish: Callable[[Any, StreamId, Access], None] | None,
        synchronize: bool,
        ring: int,
    ) -> None: ...
    def set_uses(self, uses: Sequence[tuple[Any, Access]]) -> None: ...
    def replay(self, graph: Any) -> Any: ...
    def query(self, event: Any) -> bool: ...
    def retire(self, view: object) -> None: ...
    def take_kept(self) -> list[object]: ...
    def bind_host(self, graph: Any, node: Any, view: object, address: int) -> bool: ...
    def apply_hosts(
        self, graph: Any, entries: list[list[Any]], bound: dict[int, Any], named: dict[int, Any] | None
    ) -> bool: ...
