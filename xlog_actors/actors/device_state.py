"""``DeviceState``: the generation counter and liveness flags of one device."""

from __future__ import annotations

import threading

__all__ = ["DeviceState"]


class DeviceState:
    """What a ``GpuRef`` validates against.

    ``generation`` starts at 0 and is bumped on every context rebuild; ``accepting_ops`` turns
    false for good on ``begin_shutdown``; ``poisoned`` turns true for good when a sticky error
    poisoned the context. ``token`` is replaced on every one of those changes, so a handle can
    validate with one identity comparison on its fast path.

    Thread rules: writes take a lock; reads are single attribute loads.
    """

    __slots__ = ("__weakref__", "_accepting", "_device_id", "_generation", "_lock", "_poisoned", "token")

    def __init__(self, device_id: int) -> None:
        self._device_id = device_id
        self._generation = 0
        self._accepting = True
        self._poisoned = False
        self.token: object = object()
        self._lock = threading.Lock()

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def accepting_ops(self) -> bool:
        return self._accepting

    @property
    def poisoned(self) -> bool:
        return self._poisoned

    def bump_generation(self) -> int:
        with self._lock:
            self._generation += 1
            self.token = object()
            return self._generation

    def begin_shutdown(self) -> None:
        with self._lock:
            self._accepting = False
            self.token = object()

    def poison(self) -> None:
        with self._lock:
            self._poisoned = True
            self.token = object()

    def __repr__(self) -> str:
        return (
            f"DeviceState(device_id={self._device_id}, generation={self._generation}, "
            f"accepting_ops={self._accepting}, poisoned={self._poisoned})"
        )
