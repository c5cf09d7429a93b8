import enum
from typing import Any, ClassVar

__all__ = [
    "Access",
    "AllocTag",
    "BlockId",
    "BlockState",
    "DeviceBlock",
    "Generation",
    "LiveBlock",
    "StreamId",
    "make_block",
]

_GENERATION_BY_COPY: bool
_GENERATION_IN_PLACE: bool

class StreamId(int):
    DEFAULT: ClassVar[StreamId]

class AllocTag(str):
    UNTAGGED: ClassVar[AllocTag]

class Access(enum.Enum):
    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"
    @property
    def reads(self) -> bool: ...
    @property
    def writes(self) -> bool: ...

class Generation(int):
    @staticmethod
    def next() -> Generation: ...

class BlockState(enum.Enum):
    LIVE = "live"
    RETIRED = "retired"
    FREED = "freed"

class DeviceBlock:
    __slots__ = ()
    @property
    def ptr(self) -> int: ...
    @property
    def device_ordinal(self) -> int: ...
    @property
    def alloc_stream(self) -> StreamId: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def align(self) -> int: ...
    @property
    def tag(self) -> AllocTag: ...
    @property
    def generation(self) -> Generation: ...
    @property
    def state(self) -> BlockState: ...
    __dataclass_fields__: ClassVar[dict[str, Any]]
    def __init__(
        self,
        ptr: int,
        device_ordinal: int,
        alloc_stream: StreamId,
        nbytes: int,
        align: int,
        tag: AllocTag,
        generation: Generation,
        state: BlockState = ...,
    ) -> None: ...

class BlockId:
    __slots__ = ()
    @property
    def ptr(self) -> int: ...
    @property
    def generation(self) -> Generation: ...
    @property
    def device_ordinal(self) -> int: ...
    __dataclass_fields__: ClassVar[dict[str, Any]]
    def __init__(self, ptr: int, generation: Generation, device_ordinal: int) -> None: ...
    @staticmethod
    def from_block(block: DeviceBlock) -> BlockId: ...

class LiveBlock:
    __slots__ = ()
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def tag(self) -> AllocTag: ...
    @property
    def stream(self) -> StreamId: ...
    @property
    def age_s(self) -> float | None: ...
    __dataclass_fields__: ClassVar[dict[str, Any]]
    def __init__(self, ptr: int, nbytes: int, tag: AllocTag, stream: StreamId, age_s: float | None) -> None: ...
    @staticmethod
    def of(block: DeviceBlock, age_s: float | None = None) -> LiveBlock: ...

def make_block(
    ptr: int,
    device_ordinal: int,
    alloc_stream: StreamId,
    nbytes: int,
    align: int,
    tag: AllocTag,
    generation: Generation,
    state: BlockState = ...,
) -> DeviceBlock: ...
