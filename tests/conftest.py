"""Shared fixtures: every driver present, the ``gpu`` marker, clean-up checks."""

from __future__ import annotations

import collections
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.errors import DeviceUnavailable
from xlog_actors.memory.stack import LOG_ENV, RESOURCE_ENV


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


#: Set by ``scripts/gpu-check`` for its compute-sanitizer runs.
UNDER_SANITIZER = os.environ.get("XLOG_ACTORS_SANITIZER") == "1"

# The suite checks the default stack (``async``): a stack setting in the environment it runs in
# (a block cache, say, whose frees never reach the driver) would change what dozens of tests
# check, and leave those that inject a fault on a free waiting for it. So the settings go for the
# whole run, child processes included; the tests of the settings set them themselves.
for _setting in (RESOURCE_ENV, LOG_ENV):
    os.environ.pop(_setting, None)

#: Why a ``concurrent_streams`` test skips under the sanitizers: such a test must *observe* an
#: untracked cross-stream race, and the sanitizers serialize the streams.
SANITIZER_SERIALIZES = "compute-sanitizer serializes streams: the untracked race cannot show under it"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_reason()
    gpu_skip = None if reason is None else pytest.mark.skip(reason=reason)
    race_skip = pytest.mark.skip(reason=SANITIZER_SERIALIZES) if UNDER_SANITIZER else None
    for item in items:
        if gpu_skip is not None and "gpu" in item.keywords:
            item.add_marker(gpu_skip)
        if race_skip is not None and "concurrent_streams" in item.keywords:
            item.add_marker(race_skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the tests are collected (the imported modules, ray's among them,
    hypothesis, numpy: some 150,000 objects) is moved out of the collector's reach
    (``gc.freeze``): none of it is garbage, and each full collection would walk it all again
    (0.1 to 0.2 s each, on a 2-core machine). A test's own ``gc.collect`` still finds every
    cycle made after this point, which is every object a test makes: what a test proves by
    collecting (a dropped handle freed, nothing held in a cycle) is unchanged."""
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line per distinct skip reason, with its count, instead of one line per skipping place."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: collections.Counter[str] = collections.Counter()
    for report in skipped:
        longrepr = report.longrepr
        text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[text.removeprefix("Skipped: ")] += 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for text, count in reasons.most_common():
        terminalreporter.write_line(f"{count:5d}  {text}")

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
def device(driver: xa.Driver) -> Iterator[pykka.ActorRef[Any]]:
    """A ``DeviceActor`` on device 0 of ``driver``; every actor is stopped after the test."""
    ref = xa.DeviceActor.start(0, driver)
    yield ref
    pykka.ActorRegistry.stop_all()


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


@pytest.fixture(params=[pytest.param("host", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def two_devices(request: pytest.FixtureRequest) -> Iterator[xa.Driver]:
    """A driver of two devices: two emulated ones of 64 MiB, or the first two GPUs (skipped with
    the reason where fewer are reachable). Every actor is stopped before the driver closes."""
    if request.param == "host":
        driver: xa.Driver = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    else:
        driver = _cuda_of_two()
    yield driver
    pykka.ActorRegistry.stop_all()
    driver.close()


@pytest.fixture
def cuda_pair() -> Iterator[xa.Driver]:
    """A CUDA driver of two GPUs or more (skipped with the reason where fewer are reachable), for
    gpu-marked tests that need real devices only. Every actor is stopped before it closes."""
    driver = _cuda_of_two()
    yield driver
    pykka.ActorRegistry.stop_all()
    driver.close()


def _cuda_of_two() -> xa.Driver:
    """A CUDA driver with at least two devices, else the test is skipped with the reason."""
    try:
        driver = xa.open_driver("cuda")
    except xa.DeviceUnavailable as exc:
        pytest.skip(f"no CUDA GPU reachable: {exc}")
    count = driver.device_count()
    if count < 2:
        driver.close()
        pytest.skip(f"needs two CUDA devices; this machine has {count}")
    return driver


@pytest.fixture
def run_threads() -> Callable[[Callable[[], object], int, float], list[BaseException]]:
    """Run ``target`` in ``count`` threads at once and join them all within ``timeout`` seconds;
    a thread still running then fails the test (a hang, never a wait). Returns what the threads
    raised, for the test to assert on."""

    def run(target: Callable[[], object], count: int, timeout: float) -> list[BaseException]:
        errors: list[BaseException] = []

        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

        threads = [threading.Thread(target=guarded, daemon=True) for _ in range(count)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in threads), f"a thread still runs after {timeout} s"
        return errors

    return run
