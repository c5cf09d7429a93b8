"""Building a resource stack from a description such as ``"async"`` or ``"direct"``.

The grammar is ``BASE[+ADAPTOR[:ARG]]...``: the base resource first, then each adaptor that
wraps it, innermost first. ``XLOG_ACTORS_RESOURCE`` holds the default description.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..driver.protocol import Driver
from ..errors import InvalidRequest
from .adaptors import (
    DEFAULT_GUARD_BYTES,
    LOG_ENV,
    BlockCacheResource,
    BudgetResource,
    GuardResource,
    LoggingResource,
    StatisticsResource,
    check_guard_bytes,
)
from .async_resource import AsyncCudaResource
from .direct import DirectCudaResource
from .resource import DeviceMemoryResource
from .sizes import parse_size
from .stream_pool import StreamPool

__all__ = [
    "ADAPTORS",
    "BASES",
    "LOG_ENV",
    "RESOURCE_ENV",
    "AdaptorSpec",
    "StackPlan",
    "build_resource",
    "check_description",
    "default_description",
]

#: The environment variable holding the default stack description.
RESOURCE_ENV = "XLOG_ACTORS_RESOURCE"

#: ``factory(driver, ordinal, stream_pool)``: builds a base resource.
BaseFactory = Callable[[Driver, int, StreamPool], DeviceMemoryResource]

#: The one table of base resources the grammar knows: name -> factory(driver, ordinal, pool).
BASES: dict[str, BaseFactory] = {
    "async": lambda driver, ordinal, pool: AsyncCudaResource(driver, ordinal, pool),
    "direct": lambda driver, ordinal, _pool: DirectCudaResource(driver, ordinal),
}


@dataclass(frozen=True, slots=True)
class AdaptorSpec:
    """How the grammar reads one adaptor.

    ``parse(argument)`` checks the text after ``:`` (None where there is none) without building
    anything and returns what ``build`` takes, or raises ``InvalidRequest`` naming what it
    expects; ``build(upstream, parsed)`` wraps ``upstream``. Splitting the two lets a whole
    description be checked before a device is touched (``check_description``). ``right_on``,
    where set, is the one base the adaptor must come right after (the block cache: ``async``).

    Thread rule: immutable; any thread.
    """

    parse: Callable[[str | None], Any]
    build: Callable[[DeviceMemoryResource, Any], DeviceMemoryResource]
    right_on: str | None = None


def _no_argument(arg: str | None) -> None:
    if arg is not None:
        raise InvalidRequest(f"takes no argument, got {arg!r}")


def _log_target(arg: str | None) -> str:
    path = arg or os.environ.get(LOG_ENV, "").strip() or "-"
    folder = os.path.dirname(os.path.abspath(path))
    if path != "-" and (not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        raise InvalidRequest(f"cannot create the log file {path!r}: {folder!r} is not a writable folder")
    return path


def _budget_size(arg: str | None) -> int:
    if arg is None:
        raise InvalidRequest("needs a size, for example 'budget:8GiB'")
    return parse_size(arg)


def _guard_size(arg: str | None) -> int:
    return check_guard_bytes(DEFAULT_GUARD_BYTES if arg is None else parse_size(arg))


def _cache_limit(arg: str | None) -> int | None:
    return None if arg is None else parse_size(arg)


#: The one table of adaptors the grammar knows, by name.
ADAPTORS: dict[str, AdaptorSpec] = {
    "stats": AdaptorSpec(_no_argument, lambda upstream, _none: StatisticsResource(upstream)),
    "log": AdaptorSpec(_log_target, LoggingResource),
    "budget": AdaptorSpec(_budget_size, BudgetResource),
    "guard": AdaptorSpec(_guard_size, GuardResource),
    "cache": AdaptorSpec(_cache_limit, BlockCacheResource, right_on="async"),
}


@dataclass(frozen=True, slots=True)
class StackPlan:
    """A checked description: the base's factory and each adaptor's spec with its parsed argument,
    innermost first. Thread rule: immutable; any thread."""

    base: BaseFactory
    adaptors: tuple[tuple[AdaptorSpec, Any], ...]


def check_description(description: object) -> StackPlan:
    """Check a stack description completely, building nothing.

    Args:
        description: ``BASE[+ADAPTOR[:ARG]]...``, names case-insensitive (see :data:`BASES` and
            :data:`ADAPTORS`).
    Returns:
        the plan ``build_resource`` follows.
    Raises:
        InvalidRequest: not a non-empty str, an unknown base or adaptor, or an argument its adaptor
            cannot take (a bad size, a guard size that is not a multiple of 256, a log file whose
            folder is missing or not writable); the message names the part at fault.
    Thread rule: any thread (the ``log`` adaptor's default path is read from the environment).
    """
    if not isinstance(description, str) or not description.strip():
        raise InvalidRequest(f"resource description must be a non-empty string, got {description!r}")
    parts = [p.strip() for p in description.strip().split("+")]
    base = BASES.get(parts[0].lower())
    if base is None:
        raise InvalidRequest(
            f"resource description {description!r}: unknown base {parts[0]!r}; expected one of {sorted(BASES)}"
        )
    adaptors: list[tuple[AdaptorSpec, Any]] = []
    for part in parts[1:]:
        raw_name, _, raw_arg = part.partition(":")
        name = raw_name.strip().lower()
        spec = ADAPTORS.get(name)
        if spec is None:
            raise InvalidRequest(
                f"resource description {description!r}: unknown adaptor {raw_name!r}; "
                f"expected one of {sorted(ADAPTORS)}"
            )
        try:
            parsed = spec.parse(raw_arg.strip() or None)
        except InvalidRequest as exc:
            raise InvalidRequest(f"resource description {description!r}: adaptor {name!r}: {exc}") from None
        if spec.right_on is not None and (adaptors or parts[0].strip().lower() != spec.right_on):
            raise InvalidRequest(
                f"resource description {description!r}: adaptor {name!r} must come right after the "
                f"{spec.right_on!r} base (for example {spec.right_on + '+' + name + '+stats'!r})"
            )
        adaptors.append((spec, parsed))
    return StackPlan(base, tuple(adaptors))


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
        InvalidRequest: the description fails ``check_description`` (refused before anything is
            built).
        DriverError: a base or adaptor could not be built.
    Thread rule: any thread.
    """
    plan = check_description(description)
    resource = plan.base(driver, ordinal, stream_pool)
    for spec, parsed in plan.adaptors:
        resource = spec.build(resource, parsed)
    return resource
