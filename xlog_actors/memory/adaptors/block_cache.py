"""``BlockCacheResource``: freed blocks kept per (stream, size class) and handed out again with no
driver call (``cache[:LIMIT]`` in a stack description, right after ``async``).

The body is compiled (:mod:`xlog_actors._core.cache_core`, whose docstring holds the rules); this
module is its public face: the adaptor interface (``upstream``, ``describe``, the forwarded
tracking hooks and attributes) and the figures as a :class:`BlockCacheFigures`.
"""

from __future__ import annotations

from typing import Any

from ..._core.cache_core import MAX_CACHED, CacheCore, size_class
from ...errors import InvalidRequest
from ..block import Access, BlockId, DeviceBlock, StreamId
from ..figures import BlockCacheFigures
from ..resource import DeviceMemoryResource
from ..sizes import format_size
from .upstream import ResourceAdaptor

__all__ = ["MAX_CACHED", "BlockCacheResource", "size_class"]


class BlockCacheResource(CacheCore, DeviceMemoryResource):
    """Keeps the blocks freed through it and hands them out again: at once on the stream they
    were freed on, on another stream once an event recorded there after the free is seen
    complete (queried, never waited for). See :mod:`xlog_actors._core.cache_core` for every rule.

    What it keeps: blocks of the upstream (``AsyncCudaResource``), still allocated from the
    driver, at their size class (a request is rounded up to 512 bytes up to 4 KiB, then to one of
    four classes per power of two). When it gives them back (*trims*): on an allocation the
    upstream refuses (then the allocation is tried once more), on :meth:`trim` and
    :meth:`release`; :meth:`drop` forgets them after a context rebuild.

    What it counts: ``bytes_outstanding()`` is what the user holds, at the sizes asked, plus the
    upstream's queued frees (kept blocks are not counted, so a ``budget`` above the cache counts
    what its user holds); :meth:`figures` gives the kept bytes and blocks, the hit rate and the
    trims; ``live_blocks()`` lists the user's blocks only.

    A ``ResourceAdaptor`` (registered as one): ``upstream``, ``describe()``, and every public
    attribute it lacks forwarded to the upstream; the tracking hooks reach the upstream
    unchanged (a block handed out again is the upstream's entry under a new generation).

    Thread rule: every method may be called from any thread at any time.
    """

    __slots__ = ()

    def __init__(self, upstream: DeviceMemoryResource, limit: int | None = None) -> None:
        """Keep freed blocks of ``upstream`` for reuse.

        Args:
            upstream: an ``AsyncCudaResource`` (the cache sits right on it).
            limit: the most bytes kept idle (a free past it goes upstream), or None for none.
        Raises:
            InvalidRequest: ``upstream`` is not an ``AsyncCudaResource``, or ``limit`` is neither
                None nor a positive int.
        Thread rule: any thread.
        """
        if not isinstance(upstream, DeviceMemoryResource):
            raise InvalidRequest(
                f"BlockCacheResource: upstream must be a DeviceMemoryResource, got {type(upstream).__name__}"
            )
        super().__init__(upstream, limit)

    @property
    def upstream(self) -> DeviceMemoryResource:
        """The wrapped resource. Thread rule: any thread."""
        up: DeviceMemoryResource = self._upstream
        return up

    def label(self) -> str:
        """``"cache"``, or ``"cache:SIZE"`` with a limit. Thread rule: any thread."""
        limit = self.limit
        return "cache" if limit is None else f"cache:{format_size(limit)}"

    def describe(self) -> str:
        """``upstream.describe() + "+" + label()``. Thread rule: any thread."""
        return f"{self.upstream.describe()}+{self.label()}"

    def __repr__(self) -> str:
        return f"BlockCacheResource({self.describe()!r}, device={self.device_ordinal})"

    def __getattr__(self, name: str) -> Any:
        # As ResourceAdaptor's: only names the cache lacks, never private ones.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._upstream, name)

    def figures(self) -> BlockCacheFigures:
        """The cache's figures, of one instant.

        Returns:
            A :class:`BlockCacheFigures`.
        Thread rule: any thread.
        """
        return BlockCacheFigures(**self.cache_statistics())

    # -- forwarded: arguments, results, errors and thread rules are the upstream's ------------
    def reap_pending(self) -> None:
        """The upstream's ``reap_pending()`` (kept blocks are not pending: a trim frees them)."""
        self.upstream.reap_pending()

    def supports_block_use_tracking(self) -> bool:
        """The upstream's: True."""
        return self.upstream.supports_block_use_tracking()

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """The upstream's ``record_block_use``."""
        self.upstream.record_block_use(block, use_stream)

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``prepare_block_use``."""
        self.upstream.prepare_block_use(block_id, use_stream, access)

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``finish_block_use``."""
        self.upstream.finish_block_use(block_id, use_stream, access)


ResourceAdaptor.register(BlockCacheResource)
