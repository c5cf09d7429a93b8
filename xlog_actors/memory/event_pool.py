"""A free list of driver events, so tracking a block use does not create and destroy an event
each time (``cuEventCreate`` + destroy costs more than the record itself)."""

from __future__ import annotations

from ..driver.protocol import Driver, Event

__all__ = ["EventPool"]


class EventPool:
    """Events of one device context.

    An event may go back to the pool as soon as nobody will enqueue a *new* wait on it: waits
    already enqueued keep the record they saw, so re-recording is safe (CUDA semantics, and the
    host driver's). Thread rules: ``get``/``put`` are single list operations, atomic under the
    GIL; the owning resource calls them under its own lock anyway.
    """

    __slots__ = ("_driver", "_free", "_ordinal", "created")

    def __init__(self, driver: Driver, ordinal: int) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self._free: list[Event] = []
        self.created = 0

    def get(self) -> Event:
        if self._free:
            return self._free.pop()
        event = self._driver.create_event(self._ordinal)
        self.created += 1  # after the driver call: a failed creation made no event
        return event

    def put(self, event: Event) -> None:
        self._free.append(event)

    def __len__(self) -> int:
        return len(self._free)
