"""The messages a ``DeviceActor`` answers (SPEC section 6). All are frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..memory.block import AllocTag, DeviceBlock, StreamId

if TYPE_CHECKING:
    import pykka

    from .gpu_ref import GpuRef

__all__ = [
    "Allocate",
    "AllocateMany",
    "DeviceStats",
    "Free",
    "GenerationChanged",
    "GetClient",
    "GetReport",
    "GetStats",
    "Rebuild",
    "Subscribe",
    "Unsubscribe",
]


@dataclass(frozen=True, slots=True)
class Allocate:
    """Reply: a ``GpuRef`` of ``nbytes`` bytes, stream-ordered on ``stream``."""

    nbytes: int
    stream: StreamId = StreamId.DEFAULT
    tag: AllocTag = AllocTag.UNTAGGED


@dataclass(frozen=True, slots=True)
class AllocateMany:
    """Reply: ``list[GpuRef]``, one per size, all or none (one actor round trip for many
    allocations)."""

    sizes: tuple[int, ...] | list[int]
    stream: StreamId = StreamId.DEFAULT
    tag: AllocTag = AllocTag.UNTAGGED


@dataclass(frozen=True, slots=True)
class Free:
    """Reply: None. Frees ``ref`` now; idempotent (a released or stale ref is a no-op)."""

    ref: GpuRef


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Reply: the new generation. Every older ``GpuRef`` is stale ("context rebuilt")."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Reply: None. ``actor_ref`` is told ``GenerationChanged`` on every bump."""

    actor_ref: pykka.ActorRef[Any]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    actor_ref: pykka.ActorRef[Any]


@dataclass(frozen=True, slots=True)
class GenerationChanged:
    """Told to subscribers after a rebuild (or to ``"poisoned"``/``"stopped"`` status changes,
    with the unchanged generation)."""

    device_id: int
    generation: int
    status: str = "running"


@dataclass(frozen=True, slots=True)
class GetStats:
    """Reply: ``DeviceStats``; completed frees are reaped first."""


@dataclass(frozen=True, slots=True)
class GetReport:
    """Reply: a ``MemoryReport`` of the device's stack, listing every live block with its tag,
    stream and age (``.format()`` renders it; ``.as_dict()`` is JSON-ready)."""


@dataclass(frozen=True, slots=True)
class GetClient:
    """Reply: a ``DeviceClient`` for direct, thread-safe allocation without a round trip."""


@dataclass(frozen=True, slots=True)
class DeviceStats:
    device_id: int
    generation: int
    bytes_outstanding: int
    live_blocks: int
    restarts: int
    status: str
    driver: str
    stack: str
    mem_free: int | None = None
    mem_total: int | None = None
    #: the memory report without its per-block list: statistics, budget, live blocks grouped by
    #: tag and by stream with the oldest age (``GetReport`` has every block)
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reclaim:
    """Internal: a ``GpuRef`` of ``generation`` went away or was released."""

    block: DeviceBlock
    generation: int


@dataclass(frozen=True, slots=True)
class Attach:
    """Internal: a library actor asks for the current ``DeviceContext``."""
