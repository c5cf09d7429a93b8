"""Choosing a driver: ``open_driver(kind)`` and the ``XLOG_ACTORS_DRIVER`` override.

The CUDA driver is imported only when one is asked for (or ``"auto"`` tries one), so choosing the
host driver never imports cuda-python.
"""

from __future__ import annotations

import os
import threading
from typing import Literal

from ..errors import DeviceUnavailable, InvalidRequest
from .host import HostDriver
from .protocol import Driver

__all__ = [
    "DRIVER_ENV",
    "DRIVER_KINDS",
    "DriverChoiceKind",
    "default_driver",
    "driver_of_kind",
    "env_driver_kind",
    "open_driver",
]

#: The environment variable naming the driver ``open_driver()`` picks by default:
#: ``auto``, ``cuda`` or ``host``.
DRIVER_ENV = "XLOG_ACTORS_DRIVER"

#: What ``open_driver`` takes, and ``XLOG_ACTORS_DRIVER`` may name.
DriverChoiceKind = Literal["auto", "cuda", "host"]
DRIVER_KINDS: tuple[DriverChoiceKind, ...] = ("auto", "cuda", "host")


def env_driver_kind() -> DriverChoiceKind | None:
    """The kind ``XLOG_ACTORS_DRIVER`` names (case and spaces ignored), or None when it is unset.

    Returns:
        ``"auto"``, ``"cuda"``, ``"host"`` or None.
    Raises:
        InvalidRequest: the variable names no known kind (the message names the variable, its value
            and the kinds it accepts).
    Thread rule: any thread (it reads the environment at each call).
    """
    env = os.environ.get(DRIVER_ENV, "").strip().lower()
    if not env:
        return None
    for kind in DRIVER_KINDS:
        if env == kind:
            return kind
    raise InvalidRequest(f"{DRIVER_ENV}={env!r}: expected one of {', '.join(DRIVER_KINDS)}")


def open_driver(kind: DriverChoiceKind | None = None) -> Driver:
    """A new driver of ``kind``.

    ``"cuda"``: cuda-python on the GPU; ``DeviceUnavailable`` where no GPU or libcuda is reachable.
    ``"host"``: the CUDA stream model emulated on the host; always available.
    ``"auto"``: cuda where a GPU is reachable, else host.
    ``None`` (or ``"auto"`` passed by default) takes ``XLOG_ACTORS_DRIVER`` when it is set.

    Args:
        kind: ``"auto"``, ``"cuda"``, ``"host"`` or None.
    Returns:
        A new driver; the caller closes it.
    Raises:
        InvalidRequest: an unknown ``kind``, or an unknown value of ``XLOG_ACTORS_DRIVER``.
        DeviceUnavailable: ``"cuda"`` asked for where no GPU is reachable.
    Thread rule: any thread.
    """
    if kind is None or kind == "auto":
        kind = env_driver_kind() or "auto"
    if kind not in DRIVER_KINDS:
        raise InvalidRequest(f"unknown driver kind {kind!r}; expected one of {DRIVER_KINDS}")
    if kind == "host":
        return HostDriver()
    from .cuda import CudaDriver

    if kind == "cuda":
        return CudaDriver()
    try:
        return CudaDriver()
    except DeviceUnavailable:
        return HostDriver()


_default: Driver | None = None


def default_driver() -> Driver:
    """The process-wide driver used where none is given (``XlogDeviceRuntime.try_get`` and
    ``DeviceActor.start`` without ``driver=``): ``open_driver()`` on first use.

    Returns:
        The process-wide driver (the same object on every call).
    Raises:
        InvalidRequest, DeviceUnavailable: as ``open_driver()``, on the first call.
    Thread rule: any thread; the first calls should not race (two racing first calls may each
    open a driver, and one of them is then dropped unclosed).
    """
    global _default
    if _default is None:
        _default = open_driver()
    return _default


_by_kind: dict[str, Driver] = {}
_by_kind_lock = threading.Lock()


def driver_of_kind(kind: object) -> Driver:
    """The process-wide driver of ``kind``, what a ``DeviceActor`` started with a driver kind
    (``DeviceActor.start(0, "cuda")``) runs on: opened on first use and shared by every device
    started the same way, so two devices of one kind are two ordinals of one driver (peer copies
    between them work). ``"auto"`` is :func:`default_driver`.

    Args:
        kind: ``"auto"``, ``"cuda"`` or ``"host"`` (case and spaces ignored).
    Returns:
        The driver (the same object for the same kind on every call).
    Raises:
        InvalidRequest: an unknown kind (the message names the kinds accepted).
        DeviceUnavailable: ``"cuda"`` where no GPU is reachable (nothing is kept).
    Thread rule: any thread; first uses are serialized, so one driver per kind is ever opened.
    """
    name = kind.strip().lower() if isinstance(kind, str) else kind
    if name not in DRIVER_KINDS:
        raise InvalidRequest(f"unknown driver kind {kind!r}; expected one of {', '.join(DRIVER_KINDS)}")
    if name == "auto":
        return default_driver()
    with _by_kind_lock:
        driver = _by_kind.get(name)
        if driver is None:
            driver = _by_kind[name] = open_driver(name)
        return driver
