"""Choosing a driver: ``open_driver(kind)`` and the ``XLOG_ACTORS_DRIVER`` override."""

from __future__ import annotations

import os
from typing import Literal

from ..errors import DeviceUnavailable, InvalidRequest
from .host import HostDriver
from .protocol import Driver

__all__ = ["DRIVER_ENV", "default_driver", "open_driver"]

DRIVER_ENV = "XLOG_ACTORS_DRIVER"
_KINDS = ("auto", "cuda", "host")


def open_driver(kind: Literal["auto", "cuda", "host"] | None = None) -> Driver:
    """A new driver of ``kind``.

    ``"cuda"``: cuda-python on the GPU; ``DeviceUnavailable`` where no GPU or libcuda is reachable.
    ``"host"``: the CUDA stream model emulated on the host; always available.
    ``"auto"``: cuda where a GPU is reachable, else host.
    ``None`` (or ``"auto"`` passed by default) takes ``XLOG_ACTORS_DRIVER`` when it is set.
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
    ``DeviceActor.start`` without ``driver=``): ``open_driver()`` on first use."""
    global _default
    if _default is None:
        _default = open_driver()
    return _default
