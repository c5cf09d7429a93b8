"""Value types of the allocator layer: stream and block identities, tags, generations, the block
a resource hands out and the live-block entry a resource lists.

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
    "LiveBlock",
    "StreamId",
    "generation_counter",
    "make_block",
]


class StreamId(int):
    """Names a stream of a :class:`~xlog_actors.memory.StreamPool`.

    ``StreamId.DEFAULT == StreamId(0)`` always resolves while the pool is open; other ids come
    from ``StreamPool.acquire()``. An ``int`` subclass, so it hashes and compares as its number.
    Immutable; any thread.
    """

    __slots__ = ()
    DEFAULT: ClassVar[StreamId]

    def __repr__(self) -> str:
        return f"StreamId({int(self)})"


StreamId.DEFAULT = StreamId(0)


class AllocTag(str):
    """Names what an allocation is for; statistics and reports group by it.

    ``AllocTag.UNTAGGED`` (``"untagged"``) is the tag of an allocation that gave none. A ``str``
    subclass, so it hashes and compares as its text. Immutable; any thread.
    """

    __slots__ = ()
    UNTAGGED: ClassVar[AllocTag]

    def __repr__(self) -> str:
        return f"AllocTag({str.__repr__(self)})"


AllocTag.UNTAGGED = AllocTag("untagged")


class Access(enum.Enum):
    """How a kernel or copy uses a block; decides which waits ``prepare_block_use`` queues and what
    ``finish_block_use`` records. Immutable; any thread."""

    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"

    @property
    def reads(self) -> bool:
        """True for ``READ`` and ``READ_WRITE``. Thread rule: any thread."""
        return self is not Access.WRITE

    @property
    def writes(self) -> bool:
        """True for ``WRITE`` and ``READ_WRITE``. Thread rule: any thread."""
        return self is not Access.READ


#: The process-wide source of :class:`Generation` numbers, starting at 1. Hot paths call
#: ``next(generation_counter)`` directly; everything else uses ``Generation.next()``.
#: ``itertools.count.__next__`` is a single C call and so atomic under the GIL; on a free-threaded
#: build it is also internally locked. That makes it safe from any thread without a lock on the
#: allocation hot path.
generation_counter = itertools.count(1)


class Generation(int):
    """Generation token of an allocation.

    ``Generation.next()`` is process-wide, thread-safe and strictly increasing, so an address that
    is freed and handed out again never carries the generation of its earlier life (the ABA
    guard). Immutable; any thread.
    """

    __slots__ = ()

    @staticmethod
    def next() -> Generation:
        """The next generation of the process, greater than every one handed out before.

        Returns:
            A new :class:`Generation`.
        Thread rule: any thread.
        """
        return Generation(next(generation_counter))

    def __repr__(self) -> str:
        return f"Generation({int(self)})"


class BlockState(enum.Enum):
    """Where a block is in its life: ``LIVE`` (handed out), ``RETIRED`` (its free is queued on a
    stream, not yet synchronized), ``FREED``. Immutable; any thread."""

    LIVE = "live"
    RETIRED = "retired"
    FREED = "freed"


@dataclass(frozen=True, slots=True)
class DeviceBlock:
    """One allocation as a resource hands it out.

    Fields: ``ptr`` (device address), ``device_ordinal``, ``alloc_stream`` (the stream the
    allocation, and its free, are ordered on), ``nbytes`` (the size asked for), ``align`` (the
    alignment ``ptr`` is guaranteed), ``tag``, ``generation`` and ``state``.

    Immutable: deallocating does not change it; the resource's own map decides whether
    ``(ptr, generation)`` is still live. Any thread.
    """

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
    """The identity of a block, enough to validate it against a resource's live map.
    Immutable; any thread."""

    ptr: int
    generation: Generation
    device_ordinal: int

    @staticmethod
    def from_block(block: DeviceBlock) -> BlockId:
        """The identity of ``block``.

        Args:
            block: any block.
        Returns:
            ``BlockId(block.ptr, block.generation, block.device_ordinal)``.
        Thread rule: any thread.
        """
        return BlockId(block.ptr, block.generation, block.device_ordinal)


@dataclass(frozen=True, slots=True)
class LiveBlock:
    """One live block as a resource lists it (``live_blocks()``) and a memory report shows it.

    The fields a report needs of a :class:`DeviceBlock` (``stream`` is its ``alloc_stream``),
    plus ``age_s``: seconds since the allocation, or None where the resource does not record
    allocation times. Immutable; any thread.
    """

    ptr: int
    nbytes: int
    tag: AllocTag
    stream: StreamId
    age_s: float | None

    @staticmethod
    def of(block: DeviceBlock, age_s: float | None = None) -> LiveBlock:
        """The entry of ``block``.

        Args:
            block: a live block.
            age_s: seconds since it was allocated, None where unknown.
        Returns:
            ``LiveBlock(block.ptr, block.nbytes, block.tag, block.alloc_stream, age_s)``.
        Thread rule: any thread.
        """
        return LiveBlock(block.ptr, block.nbytes, block.tag, block.alloc_stream, age_s)


_block_setters = tuple(
    DeviceBlock.__dict__[f].__set__
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
    result is indistinguishable from ``DeviceBlock(...)``; nothing is checked.

    Args:
        ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state: the fields of
            :class:`DeviceBlock`, in its order.
    Returns:
        The new block.
    Thread rule: any thread.
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
