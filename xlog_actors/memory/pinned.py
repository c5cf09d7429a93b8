"""Pinned host memory as a resource: :class:`PinnedBuffer`, and the per-device
:class:`PinnedAllocator` that makes them and counts them by tag.

**The invariant: pinned memory is never freed or reused while a copy that uses it is in flight.**
It follows from who owns the allocation. Each allocation has one small owner object
(``_PinnedMemory``) whose finalizer (``weakref.finalize``) frees it through the driver. Every
view handed out (``PinnedBuffer.array()``, ``view()``) is a numpy array whose ``base`` chain ends
at that owner, and the drivers keep the host buffer of every asynchronous copy referenced until
an event recorded after the copy fired. So the owner lives as long as the buffer, any view of it,
or any copy in flight on it; ``PinnedBuffer.release()`` only drops the buffer's own reference, and
the memory is freed when the last of them lets go, never earlier.

The finalizer runs on whichever thread drops the last reference: the caller's, a stream's
(pruning its finished copies), or the garbage collector's. It calls ``Driver.free_pinned``, which
both drivers make safe from any thread, and updates the counters under a re-entrant lock (a
collection triggered under that lock may run another finalizer on the same thread).

Pinned memory belongs to the device actor, not to a context: a context rebuild does not free it.

Thread rule: any thread.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from ..driver.checks import check_nbytes
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from .block import AllocTag
from .device_bound import DeviceBound

__all__ = ["PinnedAllocator", "PinnedBuffer", "PinnedUsage"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PinnedUsage:
    """What pinned memory a device holds now: allocations not yet freed (a released buffer whose
    copy is still in flight counts until it is freed).

    Fields: ``count``, ``nbytes``, and ``by_tag``: tag -> ``(count, nbytes)``, tags holding
    nothing left out. Immutable; any thread.
    """

    count: int
    nbytes: int
    by_tag: Mapping[AllocTag, tuple[int, int]]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data.

        Returns:
            ``{"count", "nbytes", "by_tag": {tag: {"count", "nbytes"}}}``.
        Thread rule: any thread.
        """
        return {
            "count": self.count,
            "nbytes": self.nbytes,
            "by_tag": {str(t): {"count": c, "nbytes": n} for t, (c, n) in self.by_tag.items()},
        }


class _PinnedMemory:
    """The owner of one pinned allocation: freed (by its finalizer) when the last reference
    goes. Numpy views made from it (``np.asarray(owner)``) have it as their ``base``."""

    __slots__ = ("__weakref__", "_interface", "_ptr", "_view")

    def __init__(self, driver: Driver, ptr: int, nbytes: int) -> None:
        #: The memory's address, read by the compiled copies (``_core.library_core``).
        self._ptr = ptr
        # The driver's own view: on the host driver it holds the bytes themselves.
        self._view = driver.pinned_view(ptr, nbytes)
        self._interface = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
        }

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._interface


class PinnedAllocator(DeviceBound):
    """Makes the pinned buffers of one device and counts what is allocated and not yet freed.

    Invariant: ``usage()`` sums exactly the allocations made here whose owner has not been
    finalized; each owner's finalizer runs once and subtracts its own bytes.

    Thread rule: any thread.
    """

    def __init__(self, driver: Driver, ordinal: int) -> None:
        """Args:
            driver: the driver that allocates.
            ordinal: the device allocations go through.
        Thread rule: any thread.
        """
        super().__init__(driver, ordinal)
        self._lock = threading.RLock()
        self._by_tag: dict[AllocTag, list[int]] = {}  # tag -> [count, nbytes]

    def allocate(self, nbytes: int, tag: AllocTag = AllocTag.UNTAGGED) -> PinnedBuffer:
        """Allocate a pinned buffer of ``nbytes`` bytes, counted under ``tag``.

        Args:
            nbytes: a positive int.
            tag: what it is for (a str).
        Returns:
            The buffer; its memory is freed once it is released and no view or copy uses it.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int, or ``tag`` is not a str; nothing
                is allocated.
            OutOfMemory: the host cannot give it.
            DriverError, ContextPoisoned: the driver refuses.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "AllocatePinned.nbytes")
        if not isinstance(tag, str):
            raise InvalidRequest(f"AllocatePinned.tag must be an AllocTag (a str), got {tag!r}")
        tag = AllocTag(tag)
        ptr = self._driver.alloc_pinned(self._ordinal, nbytes)
        try:
            owner = _PinnedMemory(self._driver, ptr, nbytes)
        except BaseException:
            self._driver.free_pinned(self._ordinal, ptr)
            raise
        with self._lock:
            slot = self._by_tag.setdefault(tag, [0, 0])
            slot[0] += 1
            slot[1] += nbytes
        finalizer = weakref.finalize(owner, _free, self._driver, self._ordinal, ptr, weakref.ref(self), tag, nbytes)
        # Not at interpreter exit: the process's memory goes with it, and the driver (and
        # libcuda) may already be shutting down.
        finalizer.atexit = False
        return PinnedBuffer(owner, self._driver, self._ordinal, nbytes, tag)

    def usage(self) -> PinnedUsage:
        """What pinned memory this device holds now.

        Returns:
            A :class:`PinnedUsage` snapshot.
        Thread rule: any thread.
        """
        with self._lock:
            by_tag = {t: (c, n) for t, (c, n) in self._by_tag.items() if c}
        return PinnedUsage(
            count=sum(c for c, _ in by_tag.values()),
            nbytes=sum(n for _, n in by_tag.values()),
            by_tag=MappingProxyType(by_tag),
        )

    def _forget(self, tag: AllocTag, nbytes: int) -> None:
        with self._lock:
            slot = self._by_tag[tag]
            slot[0] -= 1
            slot[1] -= nbytes


def _free(
    driver: Driver, ordinal: int, ptr: int, allocator: weakref.ref[PinnedAllocator], tag: AllocTag, nbytes: int
) -> None:
    """The owner's finalizer: free the memory, then uncount it. A driver that refuses (closed:
    its close freed the memory already) is logged, not raised: a finalizer has nobody to raise
    to, and the memory is gone either way."""
    try:
        driver.free_pinned(ordinal, ptr)
    except Exception as exc:  # noqa: BLE001 - a finalizer has no caller to raise to
        logger.debug("device %d: freeing pinned %#x: %r", ordinal, ptr, exc)
    counter = allocator()
    if counter is not None:
        counter._forget(tag, nbytes)


class PinnedBuffer(DeviceBound):
    """A pinned (page-locked) host buffer of one device: a copy source and destination with no
    staging copy, visible as numpy arrays.

    Made by ``AllocatePinned`` (through the device's :class:`PinnedAllocator`). Its memory is
    never freed or reused while the buffer, a view made from it, or a copy using it is alive (see
    the module docstring); :meth:`release` says the caller is done with it. The bytes are the
    caller's to synchronize: do not read a destination before its copy's ``CopyDone`` says so,
    nor write a source before its copy ran.

    ``memoryview(buf)`` works where Python has the buffer protocol for classes (3.12 and later);
    everywhere, :meth:`view` and :meth:`array` give the same bytes.

    ``device_ordinal`` and ``driver`` (from :class:`DeviceBound`) name the device it was
    allocated through, the one it is copied with.

    Thread rule: any thread; the bytes have no lock.
    """

    __slots__ = ("_nbytes", "_owner", "_tag")

    def __init__(self, owner: _PinnedMemory, driver: Driver, ordinal: int, nbytes: int, tag: AllocTag) -> None:
        """Wrap ``owner`` (made by :meth:`PinnedAllocator.allocate`, the only caller)."""
        super().__init__(driver, ordinal)
        self._owner: _PinnedMemory | None = owner
        self._nbytes = nbytes
        self._tag = tag

    def __repr__(self) -> str:
        state = ", released" if self._owner is None else ""
        return f"PinnedBuffer(device={self._ordinal}, nbytes={self._nbytes}, tag={str(self._tag)!r}{state})"

    @property
    def nbytes(self) -> int:
        """Its size in bytes. Thread rule: any thread."""
        return self._nbytes

    @property
    def tag(self) -> AllocTag:
        """What it was allocated for. Thread rule: any thread."""
        return self._tag

    def array(self, dtype: npt.DTypeLike = np.uint8, count: int | None = None) -> npt.NDArray[Any]:
        """A writable, zero-copy numpy view of the buffer's first bytes.

        The view keeps the memory alive by itself (its ``base`` chain holds the owner).

        Args:
            dtype: a plain numpy dtype (no object fields).
            count: how many items; None for as many as fit.
        Returns:
            A 1-D array of ``count`` items of ``dtype``.
        Raises:
            InvalidRequest: the buffer was released, ``dtype`` is no plain dtype, or ``count``
                is not an int in 0..``nbytes // itemsize``.
        Thread rule: any thread.
        """
        owner = self._owned("array")
        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidRequest(f"PinnedBuffer.array: dtype {dtype!r} is not a numpy dtype ({exc})") from None
        if dt.hasobject or dt.itemsize == 0:
            raise InvalidRequest(f"PinnedBuffer.array: dtype {dt} holds no plain data")
        fit = self._nbytes // dt.itemsize
        if count is None:
            count = fit
        if type(count) is not int or not 0 <= count <= fit:
            raise InvalidRequest(f"PinnedBuffer.array: count must be an int in 0..{fit} for {dt}, got {count!r}")
        return np.frombuffer(np.asarray(owner), dtype=dt, count=count)

    def view(self) -> memoryview:
        """A writable byte ``memoryview`` of the whole buffer (format ``"B"``); like
        :meth:`array`, it keeps the memory alive by itself.

        Returns:
            The view.
        Raises:
            InvalidRequest: the buffer was released.
        Thread rule: any thread.
        """
        return np.asarray(self._owned("view")).data

    if sys.version_info >= (3, 12):  # pragma: no cover - the buffer protocol for classes (PEP 688)

        def __buffer__(self, flags: int) -> memoryview:
            """The buffer protocol: ``memoryview(buf)`` is :meth:`view`."""
            return self.view()

    def release(self) -> None:
        """Say the caller is done with the buffer. Idempotent.

        The memory is freed at once when nothing else uses it, else when the last view or
        in-flight copy lets go (never earlier). From then on :meth:`array`, :meth:`view` and
        every message taking the buffer refuse it with ``InvalidRequest``.

        Thread rule: any thread.
        """
        self._owner = None

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called. Thread rule: any thread."""
        return self._owner is None

    def _owned(self, what: str) -> _PinnedMemory:
        owner = self._owner
        if owner is None:
            raise InvalidRequest(f"PinnedBuffer.{what}: {self!r} was released")
        return owner
