"""``XlogDeviceRuntime``: the shared table of ``try_get``, owned runtimes, forwarding."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

import xlog_actors as xa
from xlog_actors import (
    MAX_DEVICE_ORDINALS,
    Access,
    AllocTag,
    AsyncCudaResource,
    BlockId,
    DirectCudaResource,
    StreamId,
    StreamPool,
    XlogDeviceRuntime,
)
from xlog_actors.errors import DriverError, InvalidRequest, StreamMisuse
from xlog_actors.memory.stack import RESOURCE_ENV


@pytest.fixture
def fresh() -> Iterator[xa.HostDriver]:
    """A driver no runtime was ever built for: its table slots start empty."""
    drv = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    yield drv
    drv.close()


@pytest.fixture(autouse=True)
def _default_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESOURCE_ENV, raising=False)


# -- the shared table and owned runtimes ---------------------------------------------------------
def test_try_get_returns_same_singleton(driver: xa.Driver) -> None:
    a = XlogDeviceRuntime.try_get(0, driver)
    b = XlogDeviceRuntime.try_get(0, driver)
    assert a is b, "singleton must be stable for ordinal 0"
    assert a.device_ordinal == 0
    assert a.driver is driver


def test_allocate_then_deallocate_via_runtime(driver: xa.Driver) -> None:
    rt = XlogDeviceRuntime.try_get(0, driver)
    rt.reap_pending()
    before = rt.bytes_outstanding()
    block = rt.allocate(2048, StreamId.DEFAULT, AllocTag.UNTAGGED)
    assert block.nbytes == 2048
    assert rt.bytes_outstanding() == before + 2048
    rt.deallocate(block)
    rt.reap_pending()
    assert rt.bytes_outstanding() == before


@pytest.mark.parametrize("ordinal", [MAX_DEVICE_ORDINALS, MAX_DEVICE_ORDINALS + 1, 1 << 40, -1])
def test_try_get_rejects_out_of_range_ordinal(driver: xa.Driver, ordinal: int) -> None:
    assert MAX_DEVICE_ORDINALS == 16
    with pytest.raises(InvalidRequest):
        XlogDeviceRuntime.try_get(ordinal, driver)


def test_with_resource_composes_owned_runtime_outside_singleton(driver: xa.Driver) -> None:
    singleton = XlogDeviceRuntime.try_get(0, driver)
    pool = StreamPool(driver, 0)
    resource = AsyncCudaResource(driver, 0, pool)
    owned = XlogDeviceRuntime.with_resource(driver, 0, pool, resource)
    try:
        assert owned.device_ordinal == 0
        block = owned.allocate(1024, StreamId.DEFAULT, AllocTag.UNTAGGED)
        assert block.nbytes == 1024
        assert owned.bytes_outstanding() == 1024
        owned.deallocate(block)
        owned.reap_pending()
        assert owned.bytes_outstanding() == 0
        # Not stored in the singleton table.
        assert owned is not singleton
        assert XlogDeviceRuntime.try_get(0, driver) is singleton
        assert owned.resource is resource and owned.stream_pool is pool
    finally:
        owned.close()


def test_try_get_runtime_record_block_use_rejected_with_stream_misuse(
    fresh: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The direct backend (the sanitizer mode) offers no tracking.
    monkeypatch.setenv(RESOURCE_ENV, "direct")
    rt = XlogDeviceRuntime.try_get(0, fresh)
    assert isinstance(rt.resource, DirectCudaResource)
    assert not rt.supports_block_use_tracking()
    block = rt.allocate(64, StreamId.DEFAULT, AllocTag.UNTAGGED)
    with pytest.raises(StreamMisuse) as info:
        rt.record_block_use(block, StreamId.DEFAULT)
    assert "unsupported" in str(info.value)
    assert rt.bytes_outstanding() == 64
    rt.deallocate(block)  # still works
    assert rt.bytes_outstanding() == 0


# -- per driver and ordinal ----------------------------------------------------------------------
def test_default_stack_is_async(fresh: xa.HostDriver) -> None:
    rt = XlogDeviceRuntime.try_get(0, fresh)
    assert isinstance(rt.resource, AsyncCudaResource)
    assert rt.supports_block_use_tracking()


def test_one_runtime_per_driver_and_ordinal(fresh: xa.HostDriver) -> None:
    other = xa.HostDriver(memory_per_device=1 << 20)
    try:
        r0, r1 = XlogDeviceRuntime.try_get(0, fresh), XlogDeviceRuntime.try_get(1, fresh)
        assert r0 is not r1 and (r0.device_ordinal, r1.device_ordinal) == (0, 1)
        assert XlogDeviceRuntime.try_get(0, other) is not r0
        assert XlogDeviceRuntime.try_get(1, fresh) is r1
    finally:
        other.close()


def test_ordinal_past_the_drivers_devices(fresh: xa.HostDriver) -> None:
    with pytest.raises(InvalidRequest):
        XlogDeviceRuntime.try_get(2, fresh)  # < MAX_DEVICE_ORDINALS, but the driver has 2


def test_100_threads_racing_on_first_use_build_one_runtime(
    fresh: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[int] = []
    real_build = XlogDeviceRuntime.build.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def slow_build(
        cls: type[XlogDeviceRuntime],
        driver: xa.Driver,
        ordinal: int,
        description: str | None = None,
    ) -> XlogDeviceRuntime:
        builds.append(ordinal)
        time.sleep(0.02)  # widen the race window: a missing lock builds more than once
        return real_build(cls, driver, ordinal, description)

    monkeypatch.setattr(XlogDeviceRuntime, "build", classmethod(slow_build))
    barrier = threading.Barrier(100)
    got: list[XlogDeviceRuntime] = []
    errors: list[BaseException] = []

    def racer() -> None:
        try:
            barrier.wait()
            got.append(XlogDeviceRuntime.try_get(0, fresh))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 100
    assert len({id(r) for r in got}) == 1, "racing threads got different runtimes"
    assert builds == [0], f"the runtime was built {len(builds)} times"


def test_a_failed_build_leaves_the_slot_empty_for_a_retry(fresh: xa.HostDriver) -> None:
    fresh.inject_fault(0, "error")  # the stream pool's first stream cannot be created
    with pytest.raises(DriverError):
        XlogDeviceRuntime.try_get(0, fresh)
    rt = XlogDeviceRuntime.try_get(0, fresh)
    assert XlogDeviceRuntime.try_get(0, fresh) is rt
    block = rt.allocate(128)
    rt.deallocate(block)
    rt.reap_pending()
    assert rt.bytes_outstanding() == 0


def test_a_failed_resource_build_closes_its_stream_pool(
    fresh: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESOURCE_ENV, "no-such-stack")
    names_before = {t.name for t in threading.enumerate()}
    with pytest.raises(InvalidRequest):
        XlogDeviceRuntime.try_get(0, fresh)
    leaked = {t.name for t in threading.enumerate()} - names_before
    assert not leaked, f"the failed build left stream threads behind: {leaked}"
    monkeypatch.setenv(RESOURCE_ENV, "direct")
    assert isinstance(XlogDeviceRuntime.try_get(0, fresh).resource, DirectCudaResource)


def test_runtime_forwards_every_resource_method(fresh: xa.HostDriver) -> None:
    rt = XlogDeviceRuntime.try_get(0, fresh)
    assert rt.driver is fresh and rt.stream_pool.device_ordinal == 0
    other = rt.stream_pool.acquire()
    block = rt.allocate(4096, StreamId.DEFAULT, AllocTag("fwd"))
    bid = BlockId.from_block(block)
    rt.prepare_block_use(bid, other, Access.WRITE)
    fresh.fill(block.ptr, 0x3C, 4096, rt.stream_pool.resolve(other))  # type: ignore[arg-type]  # resolved, so not None
    rt.finish_block_use(bid, other, Access.WRITE)
    rt.record_block_use(block, other)
    assert rt.resource.pending_use_event_count(block.ptr) == 2  # type: ignore[attr-defined]  # async's diagnostic
    rt.deallocate(block)
    assert rt.bytes_outstanding() == 4096
    rt.reap_pending()
    assert rt.bytes_outstanding() == 0


def test_with_resource_rejects_mismatched_parts(fresh: xa.HostDriver) -> None:
    pool0, pool1 = StreamPool(fresh, 0), StreamPool(fresh, 1)
    try:
        with pytest.raises(InvalidRequest):
            XlogDeviceRuntime.with_resource(fresh, 0, pool1, DirectCudaResource(fresh, 0))
        with pytest.raises(InvalidRequest):
            XlogDeviceRuntime.with_resource(fresh, 0, pool0, DirectCudaResource(fresh, 1))
    finally:
        pool0.close()
        pool1.close()


def test_with_resource_does_not_fill_the_table(
    fresh: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = StreamPool(fresh, 0)
    owned = XlogDeviceRuntime.with_resource(fresh, 0, pool, DirectCudaResource(fresh, 0))
    builds: list[int] = []
    real_build = XlogDeviceRuntime.build.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def counting(
        cls: type[XlogDeviceRuntime],
        driver: xa.Driver,
        ordinal: int,
        description: str | None = None,
    ) -> XlogDeviceRuntime:
        builds.append(ordinal)
        return real_build(cls, driver, ordinal, description)

    monkeypatch.setattr(XlogDeviceRuntime, "build", classmethod(counting))
    singleton = XlogDeviceRuntime.try_get(0, fresh)
    assert builds == [0], "try_get found a runtime that with_resource must not have stored"
    assert singleton is not owned
    owned.close()


def test_try_get_without_a_driver_uses_the_default_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from xlog_actors.driver import open as open_mod

    monkeypatch.setenv(open_mod.DRIVER_ENV, "host")
    monkeypatch.setattr(open_mod, "_default", None)
    rt = XlogDeviceRuntime.try_get(0)
    try:
        assert rt.driver is open_mod.default_driver()
        assert rt.driver.kind == "host"
        assert XlogDeviceRuntime.try_get(0) is rt
    finally:
        rt.driver.close()


def test_a_closed_and_dropped_driver_takes_its_runtimes_with_it() -> None:
    drv = xa.HostDriver(memory_per_device=1 << 20)
    rt = XlogDeviceRuntime.try_get(0, drv)
    assert XlogDeviceRuntime.try_get(0, drv) is rt
    gone = weakref.ref(drv), weakref.ref(rt)
    drv.close()
    del drv, rt
    gc.collect()
    assert gone[0]() is None, "the runtime table keeps every driver it ever saw alive"
    assert gone[1]() is None


def test_build_and_try_get_compose_through_with_resource(
    fresh: xa.HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One construction path: every runtime, shared or owned, is made by ``with_resource``."""
    made: list[tuple[int, str]] = []
    real = XlogDeviceRuntime.with_resource.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def counting(
        cls: type[XlogDeviceRuntime],
        driver: xa.Driver,
        ordinal: int,
        stream_pool: StreamPool,
        resource: xa.DeviceMemoryResource,
    ) -> XlogDeviceRuntime:
        made.append((ordinal, resource.describe()))
        return real(cls, driver, ordinal, stream_pool, resource)

    monkeypatch.setattr(XlogDeviceRuntime, "with_resource", classmethod(counting))
    owned = XlogDeviceRuntime.build(fresh, 1, "direct")
    shared = XlogDeviceRuntime.try_get(0, fresh)
    try:
        assert made == [(1, "direct"), (0, "async")]
        assert XlogDeviceRuntime.try_get(0, fresh) is shared and len(made) == 2
    finally:
        owned.close()


def test_a_runtime_exposes_its_parts_and_description(fresh: xa.HostDriver) -> None:
    pool = StreamPool(fresh, 1)
    resource = DirectCudaResource(fresh, 1)
    rt = XlogDeviceRuntime.with_resource(fresh, 1, pool, resource)
    try:
        assert (rt.driver, rt.device_ordinal, rt.stream_pool, rt.resource) == (fresh, 1, pool, resource)
        assert rt.describe() == "direct" and "device=1" in repr(rt) and "'direct'" in repr(rt)
    finally:
        rt.close()
    assert pool.resolve(StreamId.DEFAULT) is None, "close closes the stream pool it took over"


class _SlottedDriver:
    """A driver with no ``__dict__`` (forwarding to a host driver): the table cannot hang off it."""

    __slots__ = ("__weakref__", "_inner")

    def __init__(self, inner: xa.HostDriver) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # not __dict__: that would be the inner driver's
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_driver_without_a_dict_still_gets_one_runtime_per_ordinal(fresh: xa.HostDriver) -> None:
    slotted = _SlottedDriver(fresh)
    with pytest.raises(TypeError):
        vars(slotted)
    rt = XlogDeviceRuntime.try_get(1, slotted)  # type: ignore[arg-type]  # a forwarding proxy
    assert rt.driver is slotted and rt.device_ordinal == 1
    assert XlogDeviceRuntime.try_get(1, slotted) is rt  # type: ignore[arg-type]  # a forwarding proxy
    assert XlogDeviceRuntime.try_get(1, fresh) is not rt, "the proxy has a table of its own"
