"""``DeviceMemoryResource``: the allocator interface every backend and adaptor implements."""

from __future__ import annotations

import abc

from ..errors import StreamMisuse
from .block import Access, AllocTag, BlockId, DeviceBlock, StreamId

__all__ = ["DeviceMemoryResource"]


class DeviceMemoryResource(abc.ABC):
    """A source of device memory for one device.

    Invariants every implementation keeps:

    * ``allocate`` returns a block that aliases no other live block of the resource;
    * a call that raises leaves every map and counter as it was;
    * ``bytes_outstanding()`` counts live blocks plus retired ones whose free is queued but not
      yet known to be complete;
    * the block-use tracking hooks either really track or raise :class:`StreamMisuse` naming
      themselves unsupported: never a silent success.

    Thread rules: every method may be called from any thread at any time.
    """

    __slots__ = ()

    @abc.abstractmethod
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock: ...

    @abc.abstractmethod
    def deallocate(self, block: DeviceBlock) -> None: ...

    @property
    @abc.abstractmethod
    def device_ordinal(self) -> int: ...

    @abc.abstractmethod
    def bytes_outstanding(self) -> int: ...

    def reap_pending(self) -> None:  # noqa: B027 - a concrete no-op by contract, not abstract
        """Wait for queued frees to complete and stop counting them. No-op by default."""

    def supports_block_use_tracking(self) -> bool:
        return False

    def _unsupported(self, hook: str) -> StreamMisuse:
        return StreamMisuse(
            f"{type(self).__name__}.{hook}: cross-stream block-use tracking is unsupported by this "
            f"resource (device {self.device_ordinal}); use AsyncCudaResource, or synchronize the "
            "using stream yourself before freeing"
        )

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        raise self._unsupported("record_block_use")

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        raise self._unsupported("prepare_block_use")

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        raise self._unsupported("finish_block_use")

    def describe(self) -> str:
        """The stack as a description, innermost first (``"async+stats+budget:8GiB"``): the
        grammar ``build_resource`` reads."""
        return type(self).__name__
