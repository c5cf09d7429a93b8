"""A free list of driver events, so tracking a block use does not create and destroy an event
each time (``cuEventCreate`` + destroy costs more than the record itself)."""

from __future__ import annotations

from ..driver.protocol import Driver, Event

__all__ = ["EventPool"]


class EventPool:
    """A free list of the events of one device context.

    An event may go back to the pool as soon as nobody will enqueue a *new* wait on it: waits
    already enqueued keep the record they saw, so re-recording is safe (CUDA semantics, and the
    host driver's). ``created`` counts the events the pool ever created.

    Thread rule: ``get`` and ``put`` are single list operations, atomic under the GIL, so any
    thread may call them; the owning resource calls them under its own lock anyway, which also
    keeps ``created`` exact.
    """

    __slots__ = ("_driver", "_free", "_ordinal", "created")

    def __init__(self, driver: Driver, ordinal: int) -> None:
        """An empty pool for device ``ordinal`` of ``driver``; events are created on demand.

        Thread rule: any thread.
        """
        self._driver = driver
        self._ordinal = ordinal
        self._free: list[Event] = []
        self.created = 0

    def get(self) -> Event:
        """An event from the free list, or a new one.

        Returns:
            An event nobody will enqueue a new wait on until its taker records it.
        Raises:
            DriverError: the driver could not create an event; ``created`` is unchanged.
        Thread rule: any thread.
        """
        if self._free:
            return self._free.pop()
        event = self._driver.create_event(self._ordinal)
        self.created += 1  # after the driver call: a failed creation made no event
        return event

    def put(self, event: Event) -> None:
        """Give ``event`` back for reuse.

        Args:
            event: an event of this pool that nobody will enqueue a new wait on.
        Thread rule: any thread.
        """
        self._free.append(event)
