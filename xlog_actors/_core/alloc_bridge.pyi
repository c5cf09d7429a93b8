from typing import Any, Protocol

__all__ = [
    "ALLOC_OR_NULL_SYMBOL",
    "ALLOC_SYMBOL",
    "FREE_SYMBOL",
    "last_error",
    "library_path",
    "register",
    "registered",
    "unregister",
]

class _Allocator(Protocol):
    def allocate(self, nbytes: int, stream_handle: int) -> int: ...
    def free(self, ptr: int, nbytes: int, stream_handle: int) -> None: ...

ALLOC_SYMBOL: str
ALLOC_OR_NULL_SYMBOL: str
FREE_SYMBOL: str

def register(device: int, allocator: _Allocator) -> None: ...
def unregister(device: int, allocator: Any = None) -> bool: ...
def registered(device: int) -> Any: ...
def last_error(device: int) -> BaseException | None: ...
def library_path() -> str: ...
