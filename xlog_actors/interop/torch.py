"""PyTorch allocates through a device: ``use_device(device)`` installs a
``torch.cuda.memory.CUDAPluggableAllocator`` over the compiled core's allocator bridge
(:mod:`xlog_actors._core.alloc_bridge`), whose C functions call a :class:`DeviceAllocator`
registered for the device's CUDA ordinal. Every tensor's memory is then a block of the device,
counted under the tag (``"torch"`` by default) in its budget, statistics, report and history,
and given back when torch frees it.

PyTorch's rules, which this module cannot change:

* the allocator can be set only before the process's first CUDA allocation through torch, and
  never swapped back: there is no ``restore``. One pluggable allocator serves every device of
  the process; ``use_device`` for another device registers that device with it.
* a refusal reaches torch as a C++ ``std::runtime_error`` thrown by the bridge, which torch
  raises as ``RuntimeError`` carrying our message (the error, the budget, the report).
  ``torch.OutOfMemoryError`` (a ``RuntimeError`` subclass) is raised by torch only for its own
  C++ error type, which a library outside libtorch cannot throw. The error object itself stays
  reachable: :meth:`TorchRoute.last_error`.
* torch's caching allocator statistics (``torch.cuda.memory_allocated`` ...) are not offered
  by a pluggable allocator: the device's ``GetStats``/``GetReport`` are the figures (their
  ``cached`` part is the share of the tag the bridge's cache holds idle, the rest is in
  tensors), and :meth:`TorchRoute.cache_stats` has the cache's own counters.
* ``torch.cuda.empty_cache()`` does not reach a pluggable allocator: :meth:`TorchRoute.empty_cache`
  gives the bridge's cached blocks back to the device.

The bridge caches freed blocks per (stream, size class), as torch's own allocator does, so an
allocation torch made before on that stream costs no Python and no driver call
(:mod:`xlog_actors._core.alloc_bridge` says what it keeps and when it lets go). By default the
cache has no limit, as torch's own has none: what it holds goes back when a refused allocation
needs it (the refusal gives the cache back and tries once more), at :meth:`TorchRoute.empty_cache`
or when the allocator closes. ``use_device(..., cache_limit=N)`` or
:meth:`TorchRoute.set_cache_limit` bound it: past ``N`` bytes idle, the oldest cached blocks are
freed (stream-ordered, as any free), and a block larger than ``N`` is not cached.

Thread rule: ``use_device`` from any thread but a device actor's; the bridge's functions run in
whatever thread torch allocates or frees in (autograd's included), taking the GIL.
"""

from __future__ import annotations

from typing import Any

from .._core import alloc_bridge
from ..errors import InvalidRequest
from .allocator import DeviceAllocator, as_client, driver_kind

__all__ = ["TorchRoute", "use_device"]

_installed = False


class TorchRoute:
    """The route of one device's torch allocations: its allocator, last refusal and the
    bridge's cache.

    Thread rule: any thread.
    """

    def __init__(self, allocator: DeviceAllocator) -> None:
        """Args:
            allocator: the allocator registered with the bridge.
        Thread rule: any thread.
        """
        self.allocator = allocator

    def last_error(self) -> BaseException | None:
        """The last refusal or failure of the bridge for this device (the exception, with its
        report), or None. Thread rule: any thread."""
        return alloc_bridge.last_error(self.allocator.device_id)

    def cache_stats(self) -> dict[str, int | bool | None]:
        """The bridge's cache figures for this device: ``hits``, ``misses``, ``cached_bytes`` and
        ``cached_blocks`` (counted under the tag, free for torch to reuse), ``live_blocks``,
        ``limit``, ``evicted_blocks``, ``evicted_bytes``, ``epoch``, ``enabled``
        (``alloc_bridge.cache_stats``). Thread rule: any thread."""
        stats: dict[str, int | bool | None] = alloc_bridge.cache_stats(self.allocator.device_id)
        return stats

    @property
    def cache_limit(self) -> int | None:
        """The most bytes the bridge's cache may hold idle for this device (None: no limit).
        Thread rule: any thread."""
        limit = alloc_bridge.cache_stats(self.allocator.device_id)["limit"]
        return None if limit is None else int(limit)

    def set_cache_limit(self, limit: int | None) -> int:
        """Bound what the bridge's cache holds idle for this device (see the module docstring).

        Args:
            limit: bytes, >= 0 (0: nothing is cached), or None for no limit.
        Returns:
            the bytes given back now (the oldest cached blocks past the new limit).
        Raises:
            InvalidRequest: ``limit`` is not None nor an int >= 0, or the route's allocator is
                no longer the one registered (closed); nothing changed.
        Thread rule: any thread but the device actor's own.
        """
        _check_limit(limit)
        if alloc_bridge.registered(self.allocator.device_id) is not self.allocator:
            raise InvalidRequest(
                f"device {self.allocator.device_id}: this torch route's allocator is no longer registered"
            )
        freed: int = alloc_bridge.set_cache_limit(self.allocator.device_id, limit)
        return freed

    def empty_cache(self) -> int:
        """Give the bridge's cached blocks of this device back to it (what
        ``torch.cuda.empty_cache()`` does for torch's own allocator).

        Returns:
            the bytes given back.
        Thread rule: any thread but the device actor's own.
        """
        if alloc_bridge.registered(self.allocator.device_id) is not self.allocator:
            return 0
        freed: int = alloc_bridge.empty_cache(self.allocator.device_id)
        return freed

    def __repr__(self) -> str:
        return f"TorchRoute({self.allocator!r})"


def _check_limit(limit: object) -> None:
    if limit is not None and (type(limit) is bool or not isinstance(limit, int) or limit < 0):
        raise InvalidRequest(f"a cache limit is None or an int >= 0 (bytes), got {limit!r}")


def use_device(ref_or_client: Any, tag: str = "torch", cache_limit: int | None = None) -> TorchRoute:
    """Route PyTorch's CUDA allocations on the device's ordinal through the device.

    Args:
        ref_or_client: a ``DeviceActor``'s ref or its ``DeviceClient``, on the CUDA driver.
        tag: the tag torch's blocks are counted under.
        cache_limit: the most bytes the bridge's cache may hold idle (None, the default: no
            limit, as torch's own cache; see the module docstring).
    Returns:
        the route (its allocator, its last error, its cache).
    Raises:
        ImportError: torch is not installed.
        InvalidRequest: the device is not on the CUDA driver; a bad ``cache_limit``; its
            ordinal already routes to another allocator; or torch already allocated on CUDA in
            this process (the allocator can no longer be set). Nothing is changed then.
    Thread rule: any thread but the device actor's own.
    """
    import torch

    global _installed
    _check_limit(cache_limit)
    client = as_client(ref_or_client)
    kind = driver_kind(client)
    if kind != "cuda":
        raise InvalidRequest(f"device {client.device_id}: torch can allocate only on the CUDA driver, not on {kind}")
    allocator = DeviceAllocator(client, tag)
    try:
        alloc_bridge.register(client.device_id, allocator)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    if not _installed:
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            alloc_bridge.library_path(), alloc_bridge.ALLOC_SYMBOL, alloc_bridge.FREE_SYMBOL
        )
        try:
            torch.cuda.memory.change_current_allocator(pluggable)
        except RuntimeError as exc:
            alloc_bridge.unregister(client.device_id, allocator)
            raise InvalidRequest(
                "torch already allocated CUDA memory in this process: its allocator can only be set before "
                f"the first CUDA allocation ({exc})"
            ) from exc
        _installed = True
    route = TorchRoute(allocator)
    if cache_limit is not None:
        route.set_cache_limit(cache_limit)
    return route
