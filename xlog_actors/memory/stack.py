"""Building a resource stack from a description such as ``"async"`` or ``"direct"``.

The grammar is ``BASE[+ADAPTOR[:ARG]]...``: the base resource first, then each adaptor that
wraps it, innermost first. ``XLOG_ACTORS_RESOURCE`` holds the default description.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..driver.protocol import Driver
from ..errors import InvalidRequest
from .adaptors import (
    DEFAULT_GUARD_BYTES,
    LOG_ENV,
    BudgetResource,
    GuardResource,
    LoggingResource,
    StatisticsResource,
)
from .async_resource import AsyncCudaResource
from .direct import DirectCudaResource
from .resource import DeviceMemoryResource
from .sizes import parse_size
from .stream_pool import StreamPool

__all__ = ["ADAPTORS", "BASES", "LOG_ENV", "RESOURCE_ENV", "build_resource", "default_description"]

#: The environment variable holding the default stack description.
RESOURCE_ENV = "XLOG_ACTORS_RESOURCE"

#: ``factory(driver, ordinal, stream_pool)``: builds a base resource.
BaseFactory = Callable[[Driver, int, StreamPool], DeviceMemoryResource]
#: ``factory(upstream, argument)``: wraps ``upstream``; ``argument`` is the text after ``:``, or
#: None. Raises ``InvalidRequest`` for an argument it cannot take.
AdaptorFactory = Callable[[DeviceMemoryResource, "str | None"], DeviceMemoryResource]

#: The one table of base resources the grammar knows: name -> factory(driver, ordinal, pool).
BASES: dict[str, BaseFactory] = {
    "async": lambda driver, ordinal, pool: AsyncCudaResource(driver, ordinal, pool),
    "direct": lambda driver, ordinal, _pool: DirectCudaResource(driver, ordinal),
}


def _stats(upstream: DeviceMemoryResource, arg: str | None) -> DeviceMemoryResource:
    if arg is not None:
        raise InvalidRequest(f"adaptor 'stats' takes no argument, got {arg!r}")
    return StatisticsResource(upstream)


def _log(upstream: DeviceMemoryResource, arg: str | None) -> DeviceMemoryResource:
    return LoggingResource(upstream, arg or os.environ.get(LOG_ENV, "").strip() or "-")


def _budget(upstream: DeviceMemoryResource, arg: str | None) -> DeviceMemoryResource:
    if arg is None:
        raise InvalidRequest("adaptor 'budget' needs a size, for example 'budget:8GiB'")
    return BudgetResource(upstream, parse_size(arg))


def _guard(upstream: DeviceMemoryResource, arg: str | None) -> DeviceMemoryResource:
    return GuardResource(upstream, DEFAULT_GUARD_BYTES if arg is None else parse_size(arg))


#: The one table of adaptors the grammar knows: name -> factory(upstream, argument).
ADAPTORS: dict[str, AdaptorFactory] = {"stats": _stats, "log": _log, "budget": _budget, "guard": _guard}


def default_description() -> str:
    """The stack description to use where none is given.

    Returns:
        ``XLOG_ACTORS_RESOURCE`` (else ``"async"``), with ``+log`` appended when
        ``XLOG_ACTORS_LOG`` names a log path and the description has no ``log`` adaptor yet.
        It is not checked here: ``build_resource`` checks it.
    Thread rule: any thread (it reads the environment at each call).
    """
    description = os.environ.get(RESOURCE_ENV, "").strip() or "async"
    if os.environ.get(LOG_ENV, "").strip() and not any(
        part.strip().lower().partition(":")[0] == "log" for part in description.split("+")[1:]
    ):
        description += "+log"
    return description


def build_resource(
    description: str, driver: Driver, ordinal: int, stream_pool: StreamPool
) -> DeviceMemoryResource:
    """The resource stack ``description`` names, on ``driver``'s device ``ordinal``.

    Args:
        description: ``BASE[+ADAPTOR[:ARG]]...``, names case-insensitive (see :data:`BASES`
            and :data:`ADAPTORS`).
        driver: the driver of the device.
        ordinal: the device's ordinal.
        stream_pool: the device's stream pool (the ``async`` base orders its work on it).
    Returns:
        The outermost resource of the new stack.
    Raises:
        InvalidRequest: the description is empty or names an unknown base or adaptor (refused
            before anything is built), or gives an adaptor an argument it cannot take (refused
            when that adaptor is built; the layers below it hold no memory yet).
        DriverError: a base or adaptor could not be built.
    Thread rule: any thread.
    """
    if not isinstance(description, str) or not description.strip():
        raise InvalidRequest(f"resource description must be a non-empty string, got {description!r}")
    parts = [p.strip() for p in description.strip().split("+")]
    base = BASES.get(parts[0].lower())
    if base is None:
        raise InvalidRequest(
            f"resource description {description!r}: unknown base {parts[0]!r}; expected one of {sorted(BASES)}"
        )
    wrappers: list[tuple[AdaptorFactory, str | None]] = []
    for part in parts[1:]:
        name, _, arg = part.partition(":")
        factory = ADAPTORS.get(name.strip().lower())
        if factory is None:
            raise InvalidRequest(
                f"resource description {description!r}: unknown adaptor {name!r}; expected one of {sorted(ADAPTORS)}"
            )
        wrappers.append((factory, arg.strip() or None))
    resource = base(driver, ordinal, stream_pool)
    for factory, argument in wrappers:
        resource = factory(resource, argument)
    return resource
