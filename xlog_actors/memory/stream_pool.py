"""``StreamPool``: the streams of one device context, named by :class:`StreamId`."""

from __future__ import annotations

import itertools
import logging
import threading

from ..driver.protocol import Driver, Stream
from .block import StreamId

__all__ = ["StreamPool"]

logger = logging.getLogger("xlog_actors.memory")


class StreamPool:
    """Maps :class:`StreamId` to the driver's streams of one device.

    ``StreamId.DEFAULT`` resolves to a dedicated non-blocking stream the pool creates up front
    (not CUDA's legacy NULL stream, whose implicit synchronization the host driver does not
    model and non-blocking streams ignore anyway). ``acquire()`` creates a new stream.

    Thread rules: ``resolve`` is a lock-free dict read; ``acquire`` and ``close`` take a lock.
    """

    DEFAULT = StreamId.DEFAULT

    def __init__(self, driver: Driver, ordinal: int) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._streams: dict[int, Stream] = {0: driver.create_stream(ordinal)}

    @property
    def device_ordinal(self) -> int:
        return self._ordinal

    @property
    def driver(self) -> Driver:
        return self._driver

    def acquire(self) -> StreamId:
        """A new non-blocking stream of this device."""
        stream = self._driver.create_stream(self._ordinal)
        with self._lock:
            sid = StreamId(next(self._ids))
            self._streams[sid] = stream
        return sid

    def resolve(self, stream_id: StreamId) -> Stream | None:
        return self._streams.get(stream_id)

    @property
    def streams(self) -> dict[int, Stream]:
        """The id -> stream map itself (read-only by convention): hot paths look streams up in
        it directly. It is the same dict for the life of the pool."""
        return self._streams

    def ids(self) -> list[StreamId]:
        return [StreamId(i) for i in self._streams]

    def close(self) -> None:
        """Close every stream of the pool (after their queued work). Idempotent."""
        with self._lock:
            streams = list(self._streams.values())
            # In place: resources hold this very dict for their lock-free lookups.
            self._streams.clear()
        for stream in streams:
            try:
                stream.close()
            except Exception as exc:  # noqa: BLE001 - a stream of a dead context has nothing to close
                logger.debug("device %d: closing %r: %r", self._ordinal, stream, exc)
