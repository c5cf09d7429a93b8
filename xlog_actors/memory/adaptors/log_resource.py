"""``LoggingResource``: one CSV row per allocate, allocate failure and free (RMM's
``logging_resource_adaptor``), to a file or a text stream."""

from __future__ import annotations

import csv
import io
import os
import sys
import threading
import time
from typing import TextIO

from ...errors import CorruptionDetected
from ..block import AllocTag, DeviceBlock, StreamId
from ..resource import DeviceMemoryResource
from .upstream import ResourceAdaptor

__all__ = ["LOG_ENV", "LOG_HEADER", "LoggingResource"]

#: Names the log file of the ``log`` adaptor when its description gives no path.
LOG_ENV = "XLOG_ACTORS_LOG"

#: The CSV header row; every row has these columns, in this order.
LOG_HEADER = ("thread", "time", "action", "pointer", "size", "stream", "tag")


class LoggingResource(ResourceAdaptor):
    """Writes a CSV log of what goes through it.

    Columns (:data:`LOG_HEADER`): ``thread`` (``threading.get_ident()`` of the caller), ``time``
    (Unix time in seconds, microsecond resolution), ``action``, ``pointer`` (hex; empty on an
    allocate failure), ``size`` (bytes), ``stream`` (the allocation stream's id), ``tag``.
    Actions: ``allocate`` and ``allocate failure`` (written after the upstream answered);
    ``free`` (written before the upstream frees, so that no free happens unlogged), followed by
    ``free failure`` when the upstream refused it and the block stays live (not after a
    :class:`~xlog_actors.errors.CorruptionDetected`, which a guard raises once it freed the
    block).

    ``path_or_stream``: a text stream (written as given, flushed after each row, never closed
    here), ``"-"`` for ``sys.stderr``, or a path. A path is opened for appending and the header
    is written only when the file is empty, so several resources (one per device) may log to one
    file; each row is one ``write`` of a whole line, so rows never interleave.

    Invariant: a call that raises leaves the upstream as it was, a failing log write included
    (an allocation whose row cannot be written is given back before the error propagates).
    ``close()`` ends the log (and closes a file the adaptor opened): the resource stays usable
    and later calls are forwarded unlogged, so a stack can still be drained at shutdown.

    Thread rule: every method may be called from any thread at any time. One lock serializes the
    rows; the upstream is called outside it, so rows of concurrent calls appear in the order they
    were written, not necessarily in call order.
    """

    __slots__ = ("_closed", "_lock", "_owned", "_sink", "_target")

    def __init__(
        self, upstream: DeviceMemoryResource, path_or_stream: str | os.PathLike[str] | TextIO
    ) -> None:
        """Log what goes through ``upstream`` to ``path_or_stream``.

        Args:
            upstream: the resource to wrap.
            path_or_stream: a text stream, ``"-"`` for stderr, or a path (see the class
                docstring).
        Raises:
            InvalidRequest: ``upstream`` is not a ``DeviceMemoryResource``.
            OSError: the file cannot be opened, or the header cannot be written.
        Thread rule: any thread.
        """
        super().__init__(upstream)
        self._lock = threading.Lock()
        self._closed = False
        self._owned = False
        self._target: str | None = None
        if isinstance(path_or_stream, str) and path_or_stream == "-":
            self._sink: TextIO = sys.stderr
            self._target = "-"
        elif isinstance(path_or_stream, (str, os.PathLike)):
            self._target = os.fspath(path_or_stream)
            self._sink = open(self._target, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed by close()
            self._owned = True
        else:
            self._sink = path_or_stream
        if not self._owned or self._sink.tell() == 0:
            self._write(LOG_HEADER)

    def label(self) -> str:
        """``"log"`` for a stream, ``"log:PATH"`` (``"log:-"`` for stderr) for a path. Thread
        rule: any thread."""
        return "log" if self._target is None else f"log:{self._target}"

    def close(self) -> None:
        """End the log; close the file if the adaptor opened it. Idempotent.

        Raises:
            OSError: closing the file failed (the log is ended all the same).
        Thread rule: any thread; a row being written finishes first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owned:
                self._sink.close()

    def __del__(self) -> None:
        # A file the adaptor opened must not stay open (and unflushed) after it is gone.
        if getattr(self, "_owned", False) and not self._sink.closed:
            self._sink.close()

    def _write(self, row: tuple[object, ...]) -> None:
        line = io.StringIO()
        csv.writer(line).writerow(row)
        with self._lock:
            if self._closed:
                return
            self._sink.write(line.getvalue())
            self._sink.flush()

    def _row(
        self, action: str, pointer: str, size: object, stream: object, tag: object
    ) -> tuple[object, ...]:
        # int(): StreamId's str() is its repr; anything else (an invalid argument being logged
        # as an allocate failure) is written as given.
        if isinstance(stream, int):
            stream = int(stream)
        return (threading.get_ident(), f"{time.time():.6f}", action, pointer, size, stream, tag)

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate upstream, then log ``allocate`` (or ``allocate failure``).

        Args, Returns: as the upstream's ``allocate``.
        Raises:
            As the upstream's ``allocate`` (after the failure row), or OSError: the row could
            not be written (the block was given back).
        Thread rule: any thread.
        """
        try:
            block = self._upstream.allocate(nbytes, stream, tag)
        except BaseException:
            self._write(self._row("allocate failure", "", nbytes, stream, tag))
            raise
        try:
            self._write(
                self._row(
                    "allocate", f"{block.ptr:#x}", block.nbytes, block.alloc_stream, block.tag
                )
            )
        except BaseException:
            self._upstream.deallocate(block)
            raise
        return block

    def deallocate(self, block: DeviceBlock) -> None:
        """Log ``free``, then free upstream; log ``free failure`` if the upstream refused.

        Args: as the upstream's ``deallocate``.
        Raises:
            As the upstream's ``deallocate``, or OSError: the ``free`` row could not be written
            (the block was not freed).
        Thread rule: any thread.
        """
        self._write(
            self._row("free", f"{block.ptr:#x}", block.nbytes, block.alloc_stream, block.tag)
        )
        try:
            self._upstream.deallocate(block)
        except CorruptionDetected:
            raise  # a guard below freed the block before reporting: the "free" row stands
        except BaseException:
            self._write(
                self._row(
                    "free failure", f"{block.ptr:#x}", block.nbytes, block.alloc_stream, block.tag
                )
            )
            raise
