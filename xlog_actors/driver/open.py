"""Choosing a driver: ``open_driver(kind)`` and the ``XLOG_ACTORS_DRIVER`` override.

The CUDA driver is imported only when one is asked for (or ``"auto"`` tries one), so choosing the
host driver never imports cuda-python.
"""

from __future__ import annotations

import os
from typing import Literal

from ..errors import DeviceUnavailable, InvalidRequest
from .host import HostDriver
from .protocol import Driver

__all__ = ["DRIVER_ENV", "default_driver", "open_driver"]

#: The environment variable naming the driver ``open_driver()`` picks by default:
#: ``auto``, ``cuda`` or ``host``.
DRIVER_ENV = "XLOG_ACTORS_DRIVER"
_KINDS = ("auto", "cuda", "host")


def open_driver(kind: Literal["auto", "cuda", "host"] | None = None) -> Driver:
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
        env = os.environ.get(DRIVER_ENV, "").strip().lower()
        if env:
            if env not in _KINDS:
                raise InvalidRequest(f"{DRIVER_ENV}={env!r}: expected one of {_KINDS}")
            kind = env  # type: ignore[assignment]
        else:
            kind = "auto"
    if kind not in _KINDS:
        raise InvalidRequest(f"unknown driver kind {kind!r}; expected one of {_KINDS}")
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
