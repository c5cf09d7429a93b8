"""``XlogDeviceRuntime``: the per-ordinal runtime that owns a device's stream pool and resource
stack, and the process-wide table of shared runtimes behind ``XlogDeviceRuntime.try_get``."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from ..driver.checks import check_ordinal
from ..driver.open import default_driver
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from ..memory.adaptors.block_cache import BlockCacheResource
from ..memory.adaptors.upstream import ResourceAdaptor
from ..memory.block import Access, BlockId, DeviceBlock, StreamId
from ..memory.device_bound import DeviceBound
from ..memory.history import MemoryHistory
from ..memory.resource import DeviceMemoryResource
from ..memory.stack import build_resource, default_description
from ..memory.stream_pool import StreamPool

__all__ = ["MAX_DEVICE_ORDINALS", "XlogDeviceRuntime"]

#: The size of each driver's runtime table: ``try_get`` refuses an ordinal at or past it.
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
    """The driver's table, or None while no runtime was ever asked of it."""
    try:
        table: _Table | None = vars(driver).get(_TABLE_ATTR)
    except TypeError:  # no __dict__
        return _fallback.get(driver)
    return table


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
    """Check ``ordinal`` against the runtime table's size, then against ``driver``'s devices.

    Args:
        ordinal: the ordinal asked for.
        driver: the driver it must be a device of.
    Returns:
        ``ordinal``, an ``int`` in ``range(min(MAX_DEVICE_ORDINALS, driver.device_count()))``.
    Raises:
        InvalidRequest: ``ordinal`` is not an ``int``, is negative, is ``MAX_DEVICE_ORDINALS`` or
            more, or is not a device of ``driver``.
        DriverError: the driver could not count its devices.
    Thread rule: any thread.
    """
    ordinal = check_ordinal(ordinal, MAX_DEVICE_ORDINALS, "the runtime table (MAX_DEVICE_ORDINALS)")
    return check_ordinal(ordinal, driver.device_count(), f"the {driver.kind} driver")


class XlogDeviceRuntime(DeviceBound):
    """A device's stream pool plus resource stack, behind one facade.

    Three ways to get one, and no other (the class is not called directly):

    * ``try_get(ordinal, driver)``: the one shared runtime of that (driver, ordinal) in the
      process. At most one thread builds it, even when many race on first use; a build that fails
      leaves the slot empty so a later call retries. It lives as long as its driver.
    * ``build(driver, ordinal, description)``: an owned runtime with a new stream pool and stack.
    * ``with_resource(driver, ordinal, stream_pool, resource)``: an owned runtime of parts the
      caller built (tests, custom stacks, a device actor after a rebuild).

    Owned runtimes are never stored in the table; their owner closes them.

    The allocation methods (``allocate``, ``deallocate``, ``bytes_outstanding``,
    ``reap_pending``, ``supports_block_use_tracking``, ``record_block_use``,
    ``prepare_block_use``, ``finish_block_use``) are the resource's own bound methods, so going
    through the runtime costs nothing over calling the resource: their arguments, results,
    errors and thread rules are the resource's (see
    :class:`~xlog_actors.memory.DeviceMemoryResource`).

    Thread rule: every method may be called from any thread at any time, except ``close``
    (see there).
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
        """The implementation of :meth:`with_resource`; call that instead (same arguments, same
        errors), or :meth:`build` or :meth:`try_get`."""
        if resource.device_ordinal != ordinal or stream_pool.device_ordinal != ordinal:
            raise InvalidRequest(
                f"XlogDeviceRuntime for device {ordinal}: resource is of device {resource.device_ordinal}, "
                f"stream pool of device {stream_pool.device_ordinal}"
            )
        super().__init__(driver, ordinal)
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
        """An owned runtime of the given parts, never stored in the shared table.

        Args:
            driver: the driver of the device.
            ordinal: the device's ordinal.
            stream_pool: the device's stream pool; the runtime takes it over (``close`` closes
                it).
            resource: the stack to forward to, of the same device.
        Returns:
            The new runtime.
        Raises:
            InvalidRequest: ``resource`` or ``stream_pool`` belongs to another device.
        Thread rule: any thread.
        """
        return cls(driver, ordinal, stream_pool, resource)

    @classmethod
    def build(cls, driver: Driver, ordinal: int, description: str | None = None) -> XlogDeviceRuntime:
        """An owned runtime with a new stream pool and the stack ``description`` names.

        Args:
            driver: the driver of the device.
            ordinal: the device's ordinal.
            description: a stack description such as ``"async+stats"``; default
                ``XLOG_ACTORS_RESOURCE``, else ``"async"``.
        Returns:
            The new runtime (the device's context is made current on the calling thread first,
            as the stream pool needs).
        Raises:
            InvalidRequest: a bad ordinal (see :func:`check_device_ordinal`) or description; the
                new stream pool is closed again.
            DriverError: the driver failed; the new stream pool is closed again.
        Thread rule: any thread.
        """
        ordinal = check_device_ordinal(ordinal, driver)
        driver.make_current(ordinal)
        pool = StreamPool(driver, ordinal)
        try:
            resource = build_resource(description or default_description(), driver, ordinal, pool)
        except BaseException:
            pool.close()
            raise
        return cls.with_resource(driver, ordinal, pool, resource)

    @classmethod
    def try_get(cls, ordinal: int, driver: Driver | None = None) -> XlogDeviceRuntime:
        """The shared runtime of device ``ordinal`` of ``driver``, built on first use.

        Args:
            ordinal: the device's ordinal, below ``MAX_DEVICE_ORDINALS``.
            driver: the driver; default the process-wide default driver.
        Returns:
            The same runtime for every call with this (driver, ordinal), with the default stack.
        Raises:
            InvalidRequest: a bad ordinal (see :func:`check_device_ordinal`) or default stack
                description; the slot stays empty.
            DriverError: the build failed; the slot stays empty, so a later call retries.
        Thread rule: any thread. A built runtime is returned without a lock; the first build of
        each slot runs under that slot's own lock, so racing threads build it once and other
        slots are not held up.
        """
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
    def stream_pool(self) -> StreamPool:
        """The device's stream pool. Thread rule: any thread."""
        return self._stream_pool

    @property
    def resource(self) -> DeviceMemoryResource:
        """The resource stack every allocation method forwards to. Thread rule: any thread."""
        return self._resource

    def base_resource(self) -> DeviceMemoryResource:
        """The base resource under the stack's adaptors (``async`` or ``direct``, or a factory's
        own). Thread rule: any thread."""
        base = self._resource
        while isinstance(base, ResourceAdaptor):
            base = base.upstream
        return base

    def block_cache(self) -> BlockCacheResource | None:
        """The block cache in the stack (``cache``), or None. Thread rule: any thread."""
        layer = self._resource
        while isinstance(layer, ResourceAdaptor):
            if isinstance(layer, BlockCacheResource):
                return layer
            layer = layer.upstream
        return None

    def _history_layer(self) -> DeviceMemoryResource:
        """Where the history is recorded: the block cache where the stack has one (it sees every
        block the user holds, its hits and its trims), else the base resource."""
        cache = self.block_cache()
        return self.base_resource() if cache is None else cache

    def set_history(self, history: MemoryHistory | None) -> None:
        """Record every allocation and free of the stack's base resource into ``history`` from
        now on (None: stop). The base resource sees the blocks it hands out: under a ``guard``
        adaptor those include the canaries. Where the stack has a block cache, the cache records
        instead: each allocation (``cache_hit`` where it served a kept block), each free and each
        kept block it gives back (``trim``).

        Args:
            history: a ``MemoryHistory``, or None.
        Raises:
            InvalidRequest: ``history`` is neither, or the base resource cannot record a history
                (a factory's own resource without ``set_history``); nothing changes.
        Thread rule: any thread; an allocation racing with the call may or may not be recorded.
        """
        if history is not None and not isinstance(history, MemoryHistory):
            raise InvalidRequest(f"set_history takes a MemoryHistory or None, got {type(history).__name__}")
        base = self._history_layer()
        setter = getattr(base, "set_history", None)
        if not callable(setter):
            raise InvalidRequest(
                f"device {self._ordinal}: the stack's base resource {type(base).__name__} cannot record a memory "
                "history (only AsyncCudaResource and DirectCudaResource do)"
            )
        setter(history)

    @property
    def history(self) -> MemoryHistory | None:
        """The history the base resource (or the block cache) records into, or None. Thread
        rule: any thread."""
        history = getattr(self._history_layer(), "history", None)
        return history if isinstance(history, MemoryHistory) else None

    def trim_caches(self) -> int:
        """Give the blocks a block cache in the stack keeps back to its upstream (an orderly close
        does it before its last reap).

        Returns:
            The bytes given back (0 without a cache).
        Raises:
            DriverError: a free failed (see ``BlockCacheResource.trim``).
        Thread rule: any thread.
        """
        cache = self.block_cache()
        return 0 if cache is None else cache.trim()

    def drop_caches(self) -> int:
        """Forget the blocks a block cache in the stack keeps, without freeing them: for a context
        that was rebuilt, whose memory went with it.

        Returns:
            The bytes forgotten (0 without a cache).
        Thread rule: any thread.
        """
        cache = self.block_cache()
        return 0 if cache is None else cache.drop()

    def describe(self) -> str:
        """The stack's description, such as ``"async+stats"``. Thread rule: any thread."""
        return self._resource.describe()

    def close(self) -> None:
        """Close the stream pool. For an owned runtime only: a shared one lives as long as its
        driver. Idempotent.

        Thread rule: any thread, once no other thread uses the runtime.
        """
        self._stream_pool.close()

    def __repr__(self) -> str:
        return f"XlogDeviceRuntime(device={self._ordinal}, driver={self._driver.kind}, stack={self.describe()!r})"
