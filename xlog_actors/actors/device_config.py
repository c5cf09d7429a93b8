"""``DeviceConfig``: the whole configuration of a ``DeviceActor``, checked before the actor starts.

``DeviceActor.start`` runs its constructor in the caller's thread, and the constructor checks its
configuration here: a bad ordinal, driver, resource description (unknown base or adaptor, a bad
budget or guard size, a log file that cannot be created) or supervisor raises ``InvalidRequest``
in the caller, and no actor is left running. Only the building of the stack on the device waits
for the actor's thread, where the device's context is current.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from ..driver.open import default_driver, driver_of_kind
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from ..memory.resource import DeviceMemoryResource
from ..memory.stack import check_description, default_description
from ..memory.stream_pool import StreamPool
from ..runtime.device_runtime import check_device_ordinal
from .supervisor import Supervisor, checked_supervisor

__all__ = ["DeviceConfig", "ResourceFactory", "ResourceSpec"]

#: Builds a device's resource stack: ``factory(driver, ordinal, stream_pool)``.
ResourceFactory = Callable[[Driver, int, StreamPool], DeviceMemoryResource]
#: A stack description (``"async+stats"``), a factory, or None for the default description.
ResourceSpec = str | ResourceFactory | None

#: What a ``DeviceActor`` calls on its driver; a driver without them is refused at start.
_DRIVER_METHODS = ("device_count", "make_current", "check_context", "rebuild_context", "mem_info")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """A checked ``DeviceActor`` configuration.

    Fields: ``ordinal`` (in range for ``driver``), ``driver``, ``resource`` (a checked
    description, or a factory), ``supervisor``.

    Thread rule: immutable; any thread.
    """

    ordinal: int
    driver: Driver
    resource: str | ResourceFactory
    supervisor: Supervisor

    @classmethod
    def check(
        cls,
        ordinal: object,
        driver: object = None,
        resource: object = None,
        supervisor: object = None,
    ) -> DeviceConfig:
        """Check every part of a ``DeviceActor``'s configuration.

        Args:
            ordinal: the device ordinal (an int below the driver's device count).
            driver: a driver, a driver kind (``"cuda"``, ``"host"``, ``"auto"``: the process-wide
                driver of that kind, ``driver_of_kind``), or None for ``default_driver()``.
            resource: a stack description, a factory ``(driver, ordinal, stream_pool) ->
                resource``, or None for ``XLOG_ACTORS_RESOURCE`` (else ``"async"``).
            supervisor: a ``Supervisor``, or None for the defaults.
        Returns:
            the checked configuration (None replaced by the defaults).
        Raises:
            InvalidRequest: any part is bad; the message names it and what is expected.
            DeviceUnavailable: ``driver`` is None and no driver can be opened.
        Thread rule: any thread.
        """
        if driver is None:
            driver = default_driver()
        elif isinstance(driver, str):
            driver = driver_of_kind(driver)
        missing = [name for name in _DRIVER_METHODS if not callable(getattr(driver, name, None))]
        if missing:
            raise InvalidRequest(
                f"driver must be an xlog_actors Driver, got {driver!r} (it has no {', '.join(missing)})"
            )
        checked_driver = cast(Driver, driver)  # duck-checked just above: the protocol is not runtime-checkable
        checked_ordinal = check_device_ordinal(ordinal, checked_driver)
        if resource is None:
            resource = default_description()
        if isinstance(resource, str):
            check_description(resource)  # the whole grammar and every adaptor argument, building nothing
            checked_resource: str | ResourceFactory = resource.strip()
        elif callable(resource):
            checked_resource = resource
        else:
            raise InvalidRequest(f"resource must be a stack description or a factory, got {resource!r}")
        return cls(checked_ordinal, checked_driver, checked_resource, checked_supervisor(supervisor))
