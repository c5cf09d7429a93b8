"""``XlogDeviceRuntime``: the per-ordinal runtime that owns a device's stream pool and resource
stack (the seed's ``runtime.rs``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from ..driver.checks import check_ordinal
from ..driver.open import default_driver
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from ..memory.block import Access, BlockId, DeviceBlock, StreamId
from ..memory.resource import DeviceMemoryResource
from ..memory.stack import build_resource, default_description
from ..memory.stream_pool import StreamPool

__all__ = ["MAX_DEVICE_ORDINALS", "XlogDeviceRuntime"]

MAX_DEVICE_ORDINALS = 16

_table_lock = threading.Lock()
# Each driver's table, (one slot per ordinal, one init lock per ordinal), hangs off the driver
# itself (attribute ``_TABLE_ATTR``), so a dropped driver takes its runtimes with it: the cycle
# driver -> table -> runtime -> driver is collected with the driver. (A WeakKeyDictionary keyed by
# the driver cannot do that: its values, the runtimes, refer to their driver, and an entry whose
# value refers to its key is never dropped.) A driver without a ``__dict__`` falls back to
# ``_fallback``, which keeps it alive for the life of the process.
_TABLE_ATTR = "_xlog_runtime_table"
_Table = tuple[list["XlogDeviceRuntime | None"], list[threading.Lock]]
_fallback: weakref.WeakKeyDictionary[Driver, _Table] = weakref.WeakKeyDictionary()


def _table(driver: Driver) -> _Table | None:
    try:
        return vars(driver).get(_TABLE_ATTR)  # type: ignore[no-any-return]
    except TypeError:  # no __dict__
        return _fallback.get(driver)


def _new_table(driver: Driver) -> _Table:
    """The driver's table, created if missing. Call under ``_table_lock``."""
    table = _table(driver)
    if table is None:
        table = ([None] * MAX_DEVICE_ORDINALS, [threading.Lock() for _ in range(MAX_DEVICE_ORDINALS)])
        try:
            vars(driver)[_TABLE_ATTR] = table
        except TypeError:
            _fallback[driver] = table
    return table


def check_device_ordinal(ordinal: object, driver: Driver) -> int:
    """``ordinal`` checked against ``MAX_DEVICE_ORDINALS`` and then against ``driver``'s devices."""
    ordinal = check_ordinal(ordinal, MAX_DEVICE_ORDINALS, "the runtime table (MAX_DEVICE_ORDINALS)")
    return check_ordinal(ordinal, driver.device_count(), f"the {driver.kind} driver")


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
        ordinal = check_device_ordinal(ordinal, driver)
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
        table = _table(driver)
        if table is not None and type(ordinal) is int and 0 <= ordinal < MAX_DEVICE_ORDINALS:
            runtime = table[0][ordinal]
            if runtime is not None:
                return runtime
        ordinal = check_device_ordinal(ordinal, driver)
        with _table_lock:
            slots, locks = _new_table(driver)
            lock = locks[ordinal]
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
