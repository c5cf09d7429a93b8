"""``BudgetResource``: a hard cap on what a stack holds, refused before the driver is called
(RMM's ``limiting_resource_adaptor``, with pending frees counted correctly)."""

from __future__ import annotations

import threading

from ...driver.checks import check_nbytes
from ...errors import BudgetExceeded
from ..block import AllocTag, DeviceBlock, StreamId
from ..resource import DeviceMemoryResource
from ..sizes import format_size, human_bytes
from .upstream import ResourceAdaptor

__all__ = ["BudgetResource"]

class BudgetResource(ResourceAdaptor):
    """Refuses, with :class:`~xlog_actors.errors.BudgetExceeded`, any request that would take
    the stack past ``limit_bytes``, before the upstream (and so the driver) is called.

    What counts: the upstream's ``bytes_outstanding()``, which includes frees that are queued
    but not yet reaped (RMM's limiting adaptor forgets those and so lets a stack overshoot while
    frees are in flight), plus requests admitted and still inside the upstream's ``allocate``.
    A request that does not fit first asks the upstream to ``reap_pending()``, then is checked
    once more; only then is it refused. A request larger than the whole budget is refused at once.

    Invariants: a refused or failed request changes nothing (its reservation is released
    whatever the upstream raised); ``outstanding + admitted-in-flight <= limit_bytes`` at every
    admission, so the stack never holds more than the budget, only what its upstream counts
    (over a ``GuardResource`` that includes the canaries).

    Thread rule: every method may be called from any thread at any time. One lock guards the
    in-flight reservations and each admission decision; the upstream's ``allocate`` and
    ``reap_pending`` run outside it. Under concurrency the check is
    conservative: an allocation that has entered the upstream's count but not yet left the
    reservations is counted twice for an instant, so a racing request at the very edge of the
    budget can be refused; the budget is never overshot.
    """

    __slots__ = ("_in_flight", "_limit", "_lock")

    def __init__(self, upstream: DeviceMemoryResource, limit_bytes: int) -> None:
        """Cap what ``upstream`` holds at ``limit_bytes``.

        Args:
            upstream: the resource to wrap.
            limit_bytes: the budget, a positive ``int``.
        Raises:
            InvalidRequest: ``upstream`` is not a ``DeviceMemoryResource``, or ``limit_bytes``
                is not a positive ``int``.
        Thread rule: any thread.
        """
        super().__init__(upstream)
        self._limit = check_nbytes(limit_bytes, "budget limit")
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def limit_bytes(self) -> int:
        """The budget, in bytes. Thread rule: any thread."""
        return self._limit

    def available(self) -> int:
        """Bytes a request could be granted now without reaping.

        Returns:
            ``limit - outstanding - admitted in flight``, never negative; taken under the lock.
        Thread rule: any thread.
        """
        with self._lock:
            return max(0, self._limit - self._upstream.bytes_outstanding() - self._in_flight)

    def label(self) -> str:
        """``"budget:SIZE"``, the size as :func:`format_size` writes it. Thread rule: any
        thread."""
        return f"budget:{format_size(self._limit)}"

    def _admit(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` and return None, or return what is outstanding when it does not fit."""
        with self._lock:
            used = self._upstream.bytes_outstanding() + self._in_flight
            if used + nbytes > self._limit:
                return used
            self._in_flight += nbytes
            return None

    def _exceeded(
        self, nbytes: int, stream: StreamId, tag: AllocTag, outstanding: int, why: str
    ) -> BudgetExceeded:
        return BudgetExceeded(
            f"budget of {human_bytes(self._limit)} ({self._limit} bytes) on device "
            f"{self.device_ordinal} ({self.describe()}): {nbytes} bytes requested for {tag} on "
            f"stream {int(stream)}, {outstanding} bytes outstanding ({why})",
            requested=nbytes,
            limit=self._limit,
            outstanding=outstanding,
        )

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Admit the request against the budget (reaping once if it does not fit), then
        allocate upstream.

        Args:
            nbytes: a positive ``int``.
            stream: as the upstream's.
            tag: as the upstream's.
        Returns:
            The upstream's block.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``.
            BudgetExceeded: the request does not fit, even after reaping; the upstream's
                ``allocate`` was not called.
            OutOfMemory, StreamMisuse, DriverError: as the upstream's; the reservation is
                released.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes)
        if nbytes > self._limit:
            raise self._exceeded(
                nbytes,
                stream,
                tag,
                self._upstream.bytes_outstanding(),
                "larger than the whole budget",
            )
        used = self._admit(nbytes)
        if used is not None:
            # Memory whose free is queued but not yet known complete still counts; waiting for
            # those frees may be all it takes.
            self._upstream.reap_pending()
            used = self._admit(nbytes)
            if used is not None:
                raise self._exceeded(
                    nbytes,
                    stream,
                    tag,
                    used,
                    "live blocks plus queued frees, after reaping the completed ones",
                )
        try:
            return self._upstream.allocate(nbytes, stream, tag)
        finally:
            with self._lock:
                self._in_flight -= nbytes
