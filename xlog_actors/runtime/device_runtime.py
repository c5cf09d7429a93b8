"""``XlogDeviceRuntime``: the per-ordinal runtime that owns a device's stream pool and resource
stack (the seed's ``runtime.rs``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from ..driver.open import default_driver
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from ..memory.block import Access, AllocTag, BlockId, DeviceBlock, StreamId
from ..memory.resource import DeviceMemoryResource
from ..memory.stack import build_resource, default_description
from ..memory.stream_pool import StreamPool

__all__ = ["XlogDeviceRuntime", "MAX_DEVICE_ORDINALS"]

MAX_DEVICE_ORDINALS = 16

_table_lock = threading.Lock()
# driver -> one slot per ordinal. Weak on the driver: a closed and dropped driver takes its
# runtimes with it.
_runtimes: weakref.WeakKeyDictionary[Driver, list[XlogDeviceRuntime | None]] = weakref.WeakKeyDictionary()
_init_locks: weakref.WeakKeyDictionary[Driver, list[threading.Lock]] = weakref.WeakKeyDictionary()


def _check_ordinal(ordinal: object, driver: Driver) -> int:
    if type(ordinal) is not int and (not isinstance(ordinal, int) or isinstance(ordinal, bool)):
        raise InvalidRequest(f"device ordinal must be an int, got {ordinal!r}")
    if not 0 <= ordinal < MAX_DEVICE_ORDINALS:
        raise InvalidRequest(
            f"device ordinal {ordinal} out of range: MAX_DEVICE_ORDINALS is {MAX_DEVICE_ORDINALS}"
        )
    count = driver.device_count()
    if ordinal >= count:
        raise InvalidRequest(f"device ordinal {ordinal} out of range: the {driver.kind} driver has {count} device(s)")
    return int(ordinal)


class XlogDeviceRuntime:
    """A device's stream pool plus resource stack, behind one facade.

    ``try_get(ordinal, driver)`` returns the one runtime of that (driver, ordinal) in the process:
    at most one thread builds it, even when many race on first use; a build that fails leaves the
    slot empty so a later call retries. ``with_resource`` composes an owned runtime that is never
    stored in that table (tests, custom stacks, the ``DeviceActor`` after a rebuild).

    The allocation methods are the resource's own bound methods, so going through the runtime
    costs nothing over calling the resource. Thread rules: as the resource's (all thread-safe).
    """

    allocate: Callable[..., DeviceBlock]
    deallocate: Callable[[DeviceBlock], None]
    bytes_outstanding: Callable[[], int]
    reap_pending: Callable[[], None]
    supports_block_use_tracking: Callable[[], bool]
    record_block_use: Callable[[DeviceBlock, StreamId], None]
    prepare_block_use: Callable[[BlockId, StreamId, Access], None]
    finish_block_use: Callable[[BlockId, StreamId, Access], None]

    def __init__(
        self, driver: Driver, ordinal: int, stream_pool: StreamPool, resource: DeviceMemoryResource
    ) -> None:
        if resource.device_ordinal != ordinal or stream_pool.device_ordinal != ordinal:
            raise InvalidRequest(
                f"XlogDeviceRuntime for device {ordinal}: resource is of device {resource.device_ordinal}, "
                f"stream pool of device {stream_pool.device_ordinal}"
            )
        self._driver = driver
        self._ordinal = ordinal
        self._stream_pool = stream_pool
        self._resource = resource
        self.allocate = resource.allocate
        self.deallocate = resource.deallocate
        self.bytes_outstanding = resource.bytes_outstanding
        self.reap_pending = resource.reap_pending
        self.supports_block_use_tracking = resource.supports_block_use_tracking
        self.record_block_use = resource.record_block_use
        self.prepare_block_use = resource.prepare_block_use
        self.finish_block_use = resource.finish_block_use

    @classmethod
    def with_resource(
        cls, driver: Driver, ordinal: int, stream_pool: StreamPool, resource: DeviceMemoryResource
    ) -> XlogDeviceRuntime:
        return cls(driver, ordinal, stream_pool, resource)

    @classmethod
    def build(cls, driver: Driver, ordinal: int, description: str | None = None) -> XlogDeviceRuntime:
        """An owned runtime with a fresh stream pool and the stack ``description`` names
        (default: ``XLOG_ACTORS_RESOURCE``, else ``"async"``)."""
        ordinal = _check_ordinal(ordinal, driver)
        driver.make_current(ordinal)
        pool = StreamPool(driver, ordinal)
        try:
            resource = build_resource(description or default_description(), driver, ordinal, pool)
        except BaseException:
            pool.close()
            raise
        return cls(driver, ordinal, pool, resource)

    @classmethod
    def try_get(cls, ordinal: int, driver: Driver | None = None) -> XlogDeviceRuntime:
        if driver is None:
            driver = default_driver()
        slots = _runtimes.get(driver)
        if slots is not None and type(ordinal) is int and 0 <= ordinal < MAX_DEVICE_ORDINALS:
            runtime = slots[ordinal]
            if runtime is not None:
                return runtime
        ordinal = _check_ordinal(ordinal, driver)
        with _table_lock:
            slots = _runtimes.get(driver)
            if slots is None:
                slots = _runtimes[driver] = [None] * MAX_DEVICE_ORDINALS
                _init_locks[driver] = [threading.Lock() for _ in range(MAX_DEVICE_ORDINALS)]
            lock = _init_locks[driver][ordinal]
        with lock:
            runtime = slots[ordinal]
            if runtime is None:
                runtime = cls.build(driver, ordinal)
                slots[ordinal] = runtime
        return runtime

    @property
    def device_ordinal(self) -> int:
        return self._ordinal

    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def stream_pool(self) -> StreamPool:
        return self._stream_pool

    @property
    def resource(self) -> DeviceMemoryResource:
        return self._resource

    def describe(self) -> str:
        return self._resource.describe()

    def close(self) -> None:
        """Close the stream pool (an owned runtime only; the table's runtimes live as long as
        their driver)."""
        self._stream_pool.close()

    def __repr__(self) -> str:
        return f"XlogDeviceRuntime(device={self._ordinal}, driver={self._driver.kind}, stack={self.describe()!r})"
