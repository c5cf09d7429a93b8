"""Value types of the allocator layer: stream and block identities, tags, generations, the block
a resource hands out and the live-block entry a resource lists.

They are compiled (:mod:`xlog_actors._core.blocks`: the allocation hot path builds one block and
one generation per call); this module is their public home. ``DeviceBlock``, ``BlockId`` and
``LiveBlock`` behave as frozen, slotted dataclasses (``dataclasses.fields``/``replace``, equality,
hashing, ``FrozenInstanceError``); ``StreamId`` and ``Generation`` are ``int`` subclasses,
``AllocTag`` a ``str`` subclass, ``Access`` and ``BlockState`` enums.
``Generation.next()`` is process-wide, thread-safe and strictly increasing.

All of them are immutable and safe to share between threads.
"""

from __future__ import annotations

from .._core.blocks import (
    Access,
    AllocTag,
    BlockId,
    BlockState,
    DeviceBlock,
    Generation,
    LiveBlock,
    StreamId,
    make_block,
)

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
