"""Profiler ranges: every message an actor of the runtime serves, and every batch of allocations
the device actor serves at once, as an NVTX range, so Nsight Systems shows the runtime's stages.

With the optional ``nvtx`` package (``pip install xlog-actors[profile]``) the ranges go to the
NVTX domain ``xlog_actors``, named ``"<actor class>.<message class>"`` (``"CopyActor.CopyToHost"``,
``"KernelActor.Launches"``); a batch the device actor serves in one wake-up is one range, named
after its first message (``"DeviceActor.Allocate"``). Without a profiler attached,
``nvtx`` itself makes them no-ops. Without ``nvtx`` nothing changes: :data:`RANGES` is None, and
the one call site (``ResilientActor``'s loop) tests that name before anything else.

Thread rule: :data:`RANGES` is set at import and never changes; ``push``/``pop`` may be called
from any thread (NVTX ranges are per thread; each actor pushes and pops on its own).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["DOMAIN", "RANGES", "Ranges"]

#: The NVTX domain of the runtime's ranges.
DOMAIN = "xlog_actors"


class Ranges:
    """NVTX ranges in :data:`DOMAIN`, their attributes made once per name.

    Thread rule: any thread; the attribute cache is a dict filled with single operations.
    """

    def __init__(self, nvtx: ModuleType) -> None:
        """Args:
            nvtx: the ``nvtx`` module.
        Thread rule: any thread.
        """
        self._domain = nvtx.get_domain(DOMAIN)
        self._attributes: dict[tuple[type, type], Any] = {}

    def push(self, actor: type, message: type) -> None:
        """Open the range ``"<actor>.<message>"`` on this thread.

        Args:
            actor: the actor's class.
            message: the message's class.
        Thread rule: any thread; close it with :meth:`pop` on the same thread.
        """
        key = (actor, message)
        attributes = self._attributes.get(key)
        if attributes is None:
            name = f"{actor.__name__}.{message.__name__}"
            attributes = self._attributes[key] = self._domain.get_event_attributes(message=name)
        self._domain.push_range(attributes)

    def pop(self) -> None:
        """Close this thread's innermost range. Thread rule: the thread that pushed it."""
        self._domain.pop_range()


def _ranges() -> Ranges | None:
    try:
        import nvtx
    except ImportError:
        return None
    return Ranges(nvtx)


#: The runtime's ranges, or None where ``nvtx`` is not installed.
RANGES: Ranges | None = _ranges()
