"""``DeviceBound``: the base of everything that serves one device of one driver (the stream pool,
the base resources, the runtime), holding the two and exposing them read-only."""

from __future__ import annotations

from ..driver.protocol import Driver

__all__ = ["DeviceBound"]


class DeviceBound:
    """Holds a driver and one of its device ordinals, both fixed for the object's life.

    Nothing is checked here: each subclass checks what its own use of the pair needs. Thread
    rule: the properties may be read from any thread at any time.
    """

    __slots__ = ("_driver", "_ordinal")

    def __init__(self, driver: Driver, ordinal: int) -> None:
        """Bind to device ``ordinal`` of ``driver``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal in that driver.
        Thread rule: any thread.
        """
        self._driver = driver
        self._ordinal = ordinal

    @property
    def device_ordinal(self) -> int:
        """The ordinal of the device served. Thread rule: any thread."""
        return self._ordinal

    @property
    def driver(self) -> Driver:
        """The driver of the device served. Thread rule: any thread."""
        return self._driver
