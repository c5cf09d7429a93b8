"""Shared fixtures: every driver present, the ``gpu`` marker, clean-up checks."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.errors import DeviceUnavailable


@functools.cache
def cuda_reason() -> str | None:
    """None when a CUDA GPU is reachable, else why not."""
    try:
        driver = xa.CudaDriver()
    except DeviceUnavailable as exc:
        return f"no CUDA GPU reachable: {exc}"
    except ImportError as exc:  # pragma: no cover - cuda-python is a dependency
        return f"cuda-python missing: {exc}"
    try:
        if driver.device_count() < 1:
            return "no CUDA device"
    finally:
        driver.close()
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Set by ``scripts/gpu-check`` for its compute-sanitizer runs.
UNDER_SANITIZER = os.environ.get("XLOG_ACTORS_SANITIZER") == "1"

#: For tests that must *observe* an untracked cross-stream race: the sanitizers serialize the
#: streams, so the race cannot happen under them. The plain GPU run and the host run check these.
needs_concurrent_streams = pytest.mark.skipif(
    UNDER_SANITIZER, reason="compute-sanitizer serializes streams: the untracked race cannot show under it"
)

DRIVER_KINDS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=DRIVER_KINDS)
def driver(request: pytest.FixtureRequest) -> Iterator[xa.Driver]:
    """One driver per kind present, shared by a module's tests."""
    drv: xa.Driver = xa.open_driver(request.param)
    yield drv
    drv.close()


@pytest.fixture
def stop_actors(host_driver: xa.HostDriver) -> Iterator[None]:
    """Stops every actor after the test; depends on ``host_driver`` so that the actors stop
    before the driver closes."""
    yield
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def host_device(host_driver: xa.HostDriver) -> Iterator[pykka.ActorRef[Any]]:
    """A ``DeviceActor`` on device 0 of ``host_driver``."""
    ref = xa.DeviceActor.start(0, driver=host_driver)
    yield ref
    ref.stop()


@pytest.fixture
def host_driver() -> Iterator[xa.HostDriver]:
    """A fresh host driver of two 64 MiB devices, for tests that inject faults or count bytes."""
    drv = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    yield drv
    drv.close()
