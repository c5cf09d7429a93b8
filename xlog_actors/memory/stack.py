"""Building a resource stack from a description such as ``"async"`` or ``"direct"``.

The grammar is ``BASE[+ADAPTOR[:ARG]]...``: the base resource first, then each adaptor that
wraps it, innermost first. ``XLOG_ACTORS_RESOURCE`` holds the default description.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..driver.protocol import Driver
from ..errors import InvalidRequest
from .async_resource import AsyncCudaResource
from .direct import DirectCudaResource
from .resource import DeviceMemoryResource
from .stream_pool import StreamPool

__all__ = ["ADAPTORS", "BASES", "LOG_ENV", "RESOURCE_ENV", "build_resource", "default_description"]

RESOURCE_ENV = "XLOG_ACTORS_RESOURCE"

BaseFactory = Callable[[Driver, int, StreamPool], DeviceMemoryResource]
AdaptorFactory = Callable[[DeviceMemoryResource, "str | None"], DeviceMemoryResource]

BASES: dict[str, BaseFactory] = {
    "async": lambda driver, ordinal, pool: AsyncCudaResource(driver, ordinal, pool),
    "direct": lambda driver, ordinal, _pool: DirectCudaResource(driver, ordinal),
}

# name -> factory(upstream, argument); filled in by the adaptors module.
ADAPTORS: dict[str, AdaptorFactory] = {}


LOG_ENV = "XLOG_ACTORS_LOG"


def default_description() -> str:
    """``XLOG_ACTORS_RESOURCE`` (else ``"async"``), with ``+log`` appended when
    ``XLOG_ACTORS_LOG`` names a log path and the description has no ``log`` adaptor yet."""
    description = os.environ.get(RESOURCE_ENV, "").strip() or "async"
    if os.environ.get(LOG_ENV, "").strip() and not any(
        part.strip().lower().partition(":")[0] == "log" for part in description.split("+")[1:]
    ):
        description += "+log"
    return description


def build_resource(
    description: str, driver: Driver, ordinal: int, stream_pool: StreamPool
) -> DeviceMemoryResource:
    """The resource stack ``description`` names, on ``driver``'s device ``ordinal``."""
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
    for factory, arg in wrappers:
        resource = factory(resource, arg)
    return resource


# Last: the adaptors package imports this module and registers itself in ADAPTORS.
from . import adaptors as _adaptors  # noqa: F401
