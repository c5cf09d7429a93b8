"""Choosing a driver with ``open_driver`` and ``XLOG_ACTORS_DRIVER``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import xlog_actors as xa
from xlog_actors.driver.open import DRIVER_ENV
from xlog_actors.errors import DeviceUnavailable, InvalidRequest


def cuda_reason() -> str | None:
    """None when a CUDA GPU is reachable, else why not."""
    try:
        drv = xa.CudaDriver()
    except (DeviceUnavailable, ImportError) as exc:
        return str(exc)
    try:
        return None if drv.device_count() > 0 else "no CUDA device"
    finally:
        drv.close()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DRIVER_ENV, raising=False)


@pytest.fixture
def opened() -> Iterator[list[xa.Driver]]:
    drivers: list[xa.Driver] = []
    yield drivers
    for d in drivers:
        d.close()


def test_open_host(opened: list[xa.Driver]) -> None:
    drv = xa.open_driver("host")
    opened.append(drv)
    assert isinstance(drv, xa.HostDriver)
    assert drv.kind == "host"
    assert drv.device_count() >= 1
    free, total = drv.mem_info(0)
    assert 0 < free <= total


@pytest.mark.parametrize("value", ["host", "HOST", " host "])
def test_env_overrides_the_default_kind(
    monkeypatch: pytest.MonkeyPatch, opened: list[xa.Driver], value: str
) -> None:
    monkeypatch.setenv(DRIVER_ENV, value)
    for drv in (xa.open_driver(), xa.open_driver("auto")):
        opened.append(drv)
        assert drv.kind == "host"


@pytest.mark.parametrize("kind", ["tpu", "", "Host", 3])
def test_bad_kind_is_invalid_request(kind: object) -> None:
    with pytest.raises(InvalidRequest):
        xa.open_driver(kind)  # type: ignore[arg-type]


def test_bad_env_value_is_invalid_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DRIVER_ENV, "tpu")
    with pytest.raises(InvalidRequest, match=DRIVER_ENV):
        xa.open_driver()


def test_auto_gives_host_without_a_gpu(opened: list[xa.Driver]) -> None:
    drv = xa.open_driver("auto")
    opened.append(drv)
    if cuda_reason() is None:
        assert drv.kind == "cuda"
    else:
        assert drv.kind == "host"
    default = xa.open_driver()
    opened.append(default)
    assert default.kind == drv.kind


def test_cuda_without_a_gpu_is_device_unavailable() -> None:
    if cuda_reason() is None:
        pytest.skip("a CUDA GPU is reachable here")
    with pytest.raises(DeviceUnavailable) as info:
        xa.open_driver("cuda")
    assert str(info.value), "DeviceUnavailable says why"
