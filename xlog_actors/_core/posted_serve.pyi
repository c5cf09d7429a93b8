from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

__all__ = ["PostedServe"]

class PostedServe:
    def __init__(
        self,
        actor: Callable[[], Any],
        slow: Callable[[Any], Any],
        not_served: Any,
        ranges: ModuleType,
        kinds: Collection[type],
        pinned_type: type,
        done_type: type,
        to_device_type: type,
        to_host_type: type,
        launch_type: type,
    ) -> None: ...
    def __call__(self, message: Any) -> Any: ...
