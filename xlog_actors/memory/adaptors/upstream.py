"""``ResourceAdaptor``: the base of every adaptor, a resource that wraps an ``upstream`` one.

It forwards the whole :class:`~xlog_actors.memory.resource.DeviceMemoryResource` interface to
its upstream, so each adaptor overrides only what it changes and every stack keeps the
guarantees of its base resource (the tracking hooks and ``reap_pending`` reach the async
resource through any number of adaptors).
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequest
from ..block import Access, AllocTag, BlockId, DeviceBlock, StreamId
from ..resource import DeviceMemoryResource

__all__ = ["ResourceAdaptor"]


class ResourceAdaptor(DeviceMemoryResource):
    """Wraps ``upstream`` and forwards every call to it.

    Forwarded: ``allocate``, ``deallocate``, ``device_ordinal``, ``bytes_outstanding``,
    ``reap_pending``, ``supports_block_use_tracking``, ``record_block_use``,
    ``prepare_block_use``, ``finish_block_use``. Any other public attribute the upstream has
    (``driver``, ``stream_pool``, ``live_blocks()``, ``live_bytes()``, ``reap_pending_with()``,
    ...) is reachable through the adaptor too, so diagnostics and memory reports work on any
    stack; an adaptor that changes block identity (the guard) overrides the ones that take or
    return pointers.

    ``describe()`` is the upstream's description followed by ``+`` and this adaptor's
    :meth:`label`: innermost first, the grammar ``build_resource`` parses
    (``"async+stats+budget:8GiB"``).

    Errors: every adaptor leaves its own state unchanged when the upstream raises, with one
    exception it must honour: :class:`~xlog_actors.errors.CorruptionDetected` from
    ``deallocate`` means the block *was* freed (a guard reports damage only after freeing), so
    an adaptor that counts frees counts that one.

    Thread rule: the adaptor adds no state of its own; every method may be called from any
    thread at any time, as the upstream's.
    """

    __slots__ = ("_upstream",)

    def __init__(self, upstream: DeviceMemoryResource) -> None:
        """Wrap ``upstream``.

        Args:
            upstream: the resource every call is forwarded to.
        Raises:
            InvalidRequest: ``upstream`` is not a ``DeviceMemoryResource``.
        Thread rule: any thread.
        """
        if not isinstance(upstream, DeviceMemoryResource):
            raise InvalidRequest(
                f"{type(self).__name__}: upstream must be a DeviceMemoryResource, got {type(upstream).__name__}"
            )
        self._upstream = upstream

    @property
    def upstream(self) -> DeviceMemoryResource:
        """The wrapped resource. Thread rule: any thread."""
        return self._upstream

    def label(self) -> str:
        """This adaptor's own part of the description (``"stats"``, ``"budget:8GiB"``); the
        class name by default. Thread rule: any thread."""
        return type(self).__name__

    def describe(self) -> str:
        """``upstream.describe() + "+" + label()``. Thread rule: any thread."""
        return f"{self._upstream.describe()}+{self.label()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r}, device={self.device_ordinal})"

    def __getattr__(self, name: str) -> Any:
        # Only called for names the adaptor itself lacks. Private names are never forwarded:
        # they belong to one class, and forwarding them would recurse while ``_upstream`` is
        # not yet set (copy, pickle, a failed __init__).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._upstream, name)

    # -- forwarded interface: arguments, results, errors and thread rules are the upstream's --
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """The upstream's ``allocate``."""
        return self._upstream.allocate(nbytes, stream, tag)

    def deallocate(self, block: DeviceBlock) -> None:
        """The upstream's ``deallocate``."""
        self._upstream.deallocate(block)

    @property
    def device_ordinal(self) -> int:
        """The upstream's ``device_ordinal``."""
        return self._upstream.device_ordinal

    def bytes_outstanding(self) -> int:
        """The upstream's ``bytes_outstanding()``."""
        return self._upstream.bytes_outstanding()

    def reap_pending(self) -> None:
        """The upstream's ``reap_pending()``."""
        self._upstream.reap_pending()

    def supports_block_use_tracking(self) -> bool:
        """The upstream's ``supports_block_use_tracking()``."""
        return self._upstream.supports_block_use_tracking()

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """The upstream's ``record_block_use``."""
        self._upstream.record_block_use(block, use_stream)

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``prepare_block_use``."""
        self._upstream.prepare_block_use(block_id, use_stream, access)

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``finish_block_use``."""
        self._upstream.finish_block_use(block_id, use_stream, access)
