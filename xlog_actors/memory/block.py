"""Value types of the allocator layer (SPEC section 1).

All of them are immutable and safe to share between threads.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "Access",
    "AllocTag",
    "BlockId",
    "BlockState",
    "DeviceBlock",
    "Generation",
    "StreamId",
    "generation_counter",
    "make_block",
]


class StreamId(int):
    """Names a stream of a :class:`~xlog_actors.memory.StreamPool`.

    ``StreamId.DEFAULT == StreamId(0)`` always resolves; other ids come from
    ``StreamPool.acquire()``.
    """

    __slots__ = ()
    DEFAULT: ClassVar[StreamId]

    def __repr__(self) -> str:
        return f"StreamId({int(self)})"


StreamId.DEFAULT = StreamId(0)


class AllocTag(str):
    """Names what an allocation is for; statistics and reports group by it."""

    __slots__ = ()
    UNTAGGED: ClassVar[AllocTag]

    def __repr__(self) -> str:
        return f"AllocTag({str.__repr__(self)})"


AllocTag.UNTAGGED = AllocTag("untagged")


class Access(enum.Enum):
    """How a kernel or copy uses a block; drives which waits ``prepare_block_use`` queues."""

    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"

    @property
    def reads(self) -> bool:
        return self is not Access.WRITE

    @property
    def writes(self) -> bool:
        return self is not Access.READ


# itertools.count.__next__ is a single C call and so atomic under the GIL; on a free-threaded
# build it is also internally locked. That makes Generation.next() thread-safe without a lock on
# the allocation hot path.
generation_counter = itertools.count(1)


class Generation(int):
    """Generation token of an allocation. ``Generation.next()`` is process-wide, thread-safe and
    strictly increasing, so an address that is freed and handed out again never carries the
    generation of its earlier life (the ABA guard)."""

    __slots__ = ()

    @staticmethod
    def next() -> Generation:
        return Generation(next(generation_counter))

    def __repr__(self) -> str:
        return f"Generation({int(self)})"


class BlockState(enum.Enum):
    LIVE = "live"
    RETIRED = "retired"  # free queued on a stream, not yet synchronized
    FREED = "freed"


@dataclass(frozen=True, slots=True)
class DeviceBlock:
    """One allocation as a resource hands it out. Immutable: deallocating does not change it; the
    resource's own map decides whether ``(ptr, generation)`` is still live."""

    ptr: int
    device_ordinal: int
    alloc_stream: StreamId
    nbytes: int
    align: int
    tag: AllocTag
    generation: Generation
    state: BlockState = BlockState.LIVE


@dataclass(frozen=True, slots=True)
class BlockId:
    """The identity of a block, enough to validate it against a resource's live map."""

    ptr: int
    generation: Generation
    device_ordinal: int

    @staticmethod
    def from_block(block: DeviceBlock) -> BlockId:
        return BlockId(block.ptr, block.generation, block.device_ordinal)


_block_setters = tuple(
    DeviceBlock.__dict__[f].__set__  # type: ignore[attr-defined]
    for f in ("ptr", "device_ordinal", "alloc_stream", "nbytes", "align", "tag", "generation", "state")
)


def make_block(
    ptr: int,
    device_ordinal: int,
    alloc_stream: StreamId,
    nbytes: int,
    align: int,
    tag: AllocTag,
    generation: Generation,
    state: BlockState = BlockState.LIVE,
) -> DeviceBlock:
    """Build a :class:`DeviceBlock` without the frozen dataclass ``__init__``.

    The frozen ``__init__`` goes through ``object.__setattr__`` once per field; writing the slots
    directly costs about 40% less, and the allocation hot path builds one block per call. The
    result is indistinguishable from ``DeviceBlock(...)``.
    """
    block = object.__new__(DeviceBlock)
    s = _block_setters
    s[0](block, ptr)
    s[1](block, device_ordinal)
    s[2](block, alloc_stream)
    s[3](block, nbytes)
    s[4](block, align)
    s[5](block, tag)
    s[6](block, generation)
    s[7](block, state)
    return block
