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

    Thread rule: every method of every implementation may be called from any thread at any time.
    """

    __slots__ = ()

    @abc.abstractmethod
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate ``nbytes`` on the resource's device.

        Args:
            nbytes: a positive ``int``.
            stream: the stream the allocation (and later its free) is ordered on, where the
                resource orders by stream.
            tag: what the allocation is for.
        Returns:
            A live block that aliases no other live block of the resource.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``.
            StreamMisuse: ``stream`` is unknown to the resource.
            OutOfMemory: the device (or a budget: ``BudgetExceeded``) cannot satisfy it.
            DriverError: the driver failed.
        Thread rule: any thread.
        """

    @abc.abstractmethod
    def deallocate(self, block: DeviceBlock) -> None:
        """Free ``block`` (or queue its free behind the work on its stream).

        Args:
            block: a live block of this resource.
        Raises:
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: no block with this ``(ptr, generation)`` is live.
            CorruptionDetected: (a guard) the block was freed, but its canaries were damaged.
            DriverError: the driver failed; the block stays live.
        Thread rule: any thread.
        """

    @property
    @abc.abstractmethod
    def device_ordinal(self) -> int:
        """The ordinal of the resource's device. Thread rule: any thread."""

    @abc.abstractmethod
    def bytes_outstanding(self) -> int:
        """Bytes of the live blocks plus bytes whose free is queued but not yet reaped.

        Returns:
            The count, in bytes.
        Thread rule: any thread.
        """

    def reap_pending(self) -> None:  # noqa: B027 - a concrete no-op by contract, not abstract
        """Wait for queued frees to complete and stop counting them. No-op by default.

        Raises:
            DriverError: (where there are queued frees) a synchronization failed; what was not
                synchronized stays counted.
        Thread rule: any thread.
        """

    def supports_block_use_tracking(self) -> bool:
        """Whether the tracking hooks really track. False by default.

        Returns:
            True where ``record_block_use``, ``prepare_block_use`` and ``finish_block_use``
            track; False where they raise ``StreamMisuse``.
        Thread rule: any thread.
        """
        return False

    def _unsupported(self, hook: str) -> StreamMisuse:
        return StreamMisuse(
            f"{type(self).__name__}.{hook}: cross-stream block-use tracking is unsupported by this "
            f"resource (device {self.device_ordinal}); use AsyncCudaResource, or synchronize the "
            "using stream yourself before freeing"
        )

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """Record that work on ``use_stream`` read ``block``, so its free waits for that work.

        Args:
            block: a live block of this resource.
            use_stream: the stream the work went on.
        Raises:
            StreamMisuse: always, by default (tracking unsupported).
        Thread rule: any thread.
        """
        raise self._unsupported("record_block_use")

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """Queue on ``use_stream`` the waits that work with ``access`` on block ``block_id``
        needs; call it before enqueueing that work. By default it raises ``StreamMisuse``
        (tracking unsupported). Thread rule: any thread."""
        raise self._unsupported("prepare_block_use")

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """Record what later users of block ``block_id`` and its free must wait for; call it after
        enqueueing work with ``access`` on it on ``use_stream``. By default it raises
        ``StreamMisuse`` (tracking unsupported). Thread rule: any thread."""
        raise self._unsupported("finish_block_use")

    def describe(self) -> str:
        """The stack as a description, innermost first (``"async+stats+budget:8GiB"``): the
        grammar ``build_resource`` reads. Thread rule: any thread."""
        return type(self).__name__
