"""The messages a ``DeviceActor`` answers, and what it tells its subscribers.

Every message is a frozen dataclass: it can be shared between threads without a copy. A message
that is asked gets its reply, or its typed error; one that is told and fails is logged and dropped
(the actor lives on). A malformed message (a field of the wrong type) is answered with
``InvalidRequest`` naming the field, and changes nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pykka

from ..errors import InvalidRequest
from ..memory.block import AllocTag, StreamId
from ..memory.history import DEFAULT_MAX_ENTRIES, ORIGIN_CAPTURE, Frames, capture_frames
from .gpu_ref import GpuRef, Reclaim  # Reclaim: the context's wake-up, which lives beside it

__all__ = [
    "Allocate",
    "AllocateMany",
    "AllocatePinned",
    "Attach",
    "DeviceStats",
    "FailedInCaller",
    "Free",
    "GenerationChanged",
    "GetClient",
    "GetMemorySnapshot",
    "GetReport",
    "GetStats",
    "Rebuild",
    "Reclaim",
    "RecordMemoryHistory",
    "ReportFailure",
    "Subscribe",
    "Unsubscribe",
    "check_actor_ref",
    "check_origin",
    "check_stream_and_tag",
]


class _Originated:
    """The ``__post_init__`` of the messages that carry an ``origin`` field: while a device
    records a memory history, the stack where the message was made (the caller of its
    ``__init__``, two frames up)."""

    __slots__ = ()
    origin: Frames | None

    def __post_init__(self) -> None:
        if ORIGIN_CAPTURE[0] and self.origin is None:
            object.__setattr__(self, "origin", capture_frames(sys._getframe(2)))


@dataclass(frozen=True, slots=True)
class Allocate(_Originated):
    """Allocate one block.

    Fields: ``nbytes`` (a positive int), ``stream`` (a ``StreamId`` of the device's stream pool;
    the allocation is stream-ordered on it), ``tag`` (a str, grouped by in statistics).
    Reply: a ``GpuRef`` of ``nbytes`` bytes.
    Errors: ``InvalidRequest`` (a bad field), ``OutOfMemory``/``BudgetExceeded``, ``StreamMisuse``
    (an unknown stream), ``ContextPoisoned``/``DeviceUnavailable`` (the device's status).
    ``origin`` (keyword only, left out of equality and repr) is filled in by the message itself
    while a device records a memory history: the stack where it was made, for the history.
    """

    nbytes: int
    stream: StreamId = StreamId.DEFAULT
    tag: AllocTag = AllocTag.UNTAGGED
    origin: Frames | None = field(default=None, compare=False, repr=False, kw_only=True)

    def __reduce__(self) -> tuple[Any, ...]:
        # An isolated device's every allocation crosses a pipe: plain fields pickle in about 3 µs,
        # against 7 µs for the dataclass's own state. Unpickling makes no origin (as before).
        if type(self.stream) is StreamId and type(self.tag) is AllocTag:
            return (_allocate, (self.nbytes, int(self.stream), str(self.tag), self.origin, True))
        return (_allocate, (self.nbytes, self.stream, self.tag, self.origin, False))


def _allocate(nbytes: Any, stream: Any, tag: Any, origin: Frames | None, plain: bool) -> Allocate:
    """An :class:`Allocate` from its ``__reduce__``, fields as they were (no check, no origin
    captured: unpickling is not where it was made)."""
    msg = object.__new__(Allocate)
    object.__setattr__(msg, "nbytes", nbytes)
    object.__setattr__(msg, "stream", StreamId(stream) if plain else stream)
    object.__setattr__(msg, "tag", AllocTag(tag) if plain else tag)
    object.__setattr__(msg, "origin", origin)
    return msg


@dataclass(frozen=True, slots=True)
class AllocatePinned:
    """Allocate a pinned (page-locked) host buffer through the device.

    Fields: ``nbytes`` (a positive int), ``tag`` (a str, grouped by in the memory report).
    Reply: a ``PinnedBuffer`` of ``nbytes`` bytes, a copy source (``CopyToDevice.data``) and
    destination (``CopyToHost.out``) with no staging copy. It outlives context rebuilds; its
    memory is freed once it is released and no copy uses it any more.
    Errors: ``InvalidRequest`` (a bad field; nothing is allocated), ``OutOfMemory`` (the host
    cannot lock that much), ``ContextPoisoned``/``DeviceUnavailable`` (the device's status).
    """

    nbytes: int
    tag: AllocTag = AllocTag.UNTAGGED


@dataclass(frozen=True, slots=True)
class AllocateMany(_Originated):
    """Allocate several blocks in one round trip, all or none.

    Fields: ``sizes`` (a list or tuple of positive ints), ``stream`` and ``tag`` as in
    :class:`Allocate`.
    Reply: ``list[GpuRef]``, one per size, in order.
    Errors: as :class:`Allocate`; on any error nothing stays allocated.
    ``origin`` (keyword only, left out of equality and repr) is filled in by the message itself
    while a device records a memory history: the stack where it was made, for the history.
    """

    sizes: tuple[int, ...] | list[int]
    stream: StreamId = StreamId.DEFAULT
    tag: AllocTag = AllocTag.UNTAGGED
    origin: Frames | None = field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class Free(_Originated):
    """Free a handle now rather than when its last reference goes.

    Fields: ``ref``, a ``GpuRef`` of this device.
    Reply: None. Idempotent: a released handle, or one of an older generation, is a no-op.
    Errors: ``InvalidRequest`` (not a ``GpuRef``, or a handle of another device actor),
    ``CorruptionDetected`` (a guard found its canaries overwritten; the block is freed anyway).
    ``origin`` (keyword only, left out of equality and repr) is filled in by the message itself
    while a device records a memory history: the stack where it was made, for the history.
    """

    ref: GpuRef
    origin: Frames | None = field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Rebuild the device's context on purpose (not counted against the restart intensity).

    Fields: ``reason``, a str for the log.
    Reply: the new generation; every older ``GpuRef`` is stale ("context rebuilt").
    Errors: ``InvalidRequest`` (``reason`` not a str), ``ContextPoisoned`` (a poisoned device
    cannot be rebuilt in this process), ``DeviceUnavailable`` (stopped for good, or the rebuild
    failed: the device is then broken and the next request retries).
    """

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Subscribe an actor to the device's status changes.

    Fields: ``actor_ref``, a pykka ``ActorRef``; it is told :class:`GenerationChanged` after
    every rebuild, poisoning or stop for good. A stopped subscriber is dropped.
    Reply: None (subscribing twice is a no-op).
    Errors: ``InvalidRequest`` (not an ``ActorRef``).
    """

    actor_ref: pykka.ActorRef[Any]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """Undo :class:`Subscribe`.

    Fields: ``actor_ref``, the pykka ``ActorRef`` that subscribed.
    Reply: None (an actor that was not subscribed is a no-op).
    Errors: ``InvalidRequest`` (not an ``ActorRef``).
    """

    actor_ref: pykka.ActorRef[Any]


@dataclass(frozen=True, slots=True)
class GenerationChanged:
    """Told to subscribers when the device's status changed.

    Fields: ``device_id``; ``generation`` (bumped after a rebuild, unchanged for the others);
    ``status``: ``"running"`` after a rebuild, ``"poisoned"``, or ``"stopped"``.
    Reply: none (it is told, never asked).
    """

    device_id: int
    generation: int
    status: str = "running"


@dataclass(frozen=True, slots=True)
class GetStats:
    """Ask for the device's figures; completed frees are reaped first.

    Fields: none.
    Reply: :class:`DeviceStats`. A device that is not running still answers (with zero
    figures and its status).
    Errors: none of its own.
    """


@dataclass(frozen=True, slots=True)
class GetReport:
    """Ask for a memory report of the device's stack.

    Fields: none.
    Reply: a ``MemoryReport`` listing every live block with its tag, stream and age, and the
    device's pinned host memory by tag (``.format()`` renders it; ``.as_dict()`` is JSON-ready).
    Errors: ``ContextPoisoned``/``DeviceUnavailable`` (the device's status).
    """


@dataclass(frozen=True, slots=True)
class RecordMemoryHistory:
    """Switch the device's memory history on or off.

    Fields: ``enabled`` (a bool); ``max_entries`` (a positive int: the most events kept, the
    newest; default 100,000).
    Reply: None. On: every allocation and free of the device's base resource from now on is
    recorded, with the Python stack that asked for it, across rebuilds (each new context records
    into the same history; the blocks a rebuild took are recorded as freed, note
    ``"context rebuilt"``). On while already on: the bound changes, the newest events are kept.
    Off: recording stops; what was recorded stays readable with :class:`GetMemorySnapshot`, and
    switching on again starts an empty history.
    Errors: ``InvalidRequest`` (a bad field, or a stack whose base resource cannot record;
    nothing changes).
    """

    enabled: bool = True
    max_entries: int = DEFAULT_MAX_ENTRIES


@dataclass(frozen=True, slots=True)
class GetMemorySnapshot:
    """Ask for the device's memory history.

    Fields: none.
    Reply: a dict in the format of ``torch.cuda.memory._snapshot()`` (see
    ``MemoryHistory.snapshot``); with no history recorded, ``segments`` and ``device_traces`` are
    empty. ``pickle.dump`` it to a file for ``xlog-actors memory PATH`` or PyTorch's viewer.
    Errors: none of its own.
    """


@dataclass(frozen=True, slots=True)
class GetClient:
    """Ask for a client that allocates without an actor round trip.

    Fields: none.
    Reply: a ``DeviceClient`` for direct, thread-safe allocation.
    Errors: none.
    """


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """The reply to :class:`GetStats`.

    Fields: ``device_id``; ``generation``; ``bytes_outstanding`` (live and freed-but-not-yet-
    reaped bytes); ``live_blocks`` (handles of this generation not yet freed); ``restarts``
    (completed rebuilds); ``status`` (``starting``, ``running``, ``rebuilding``, ``broken``,
    ``poisoned`` or ``stopped``); ``driver`` (its kind); ``stack`` (the resource stack's
    description); ``mem_free``/``mem_total`` (the driver's figures, None when not running);
    ``report``: the memory report without its per-block list (statistics, budget, live blocks
    grouped by tag and by stream with the oldest age, and ``"pinned"``; ``GetReport`` has every
    block); ``pinned_count``/``pinned_bytes``/``pinned_by_tag`` (tag -> ``{"count", "nbytes"}``):
    the device's pinned host buffers not yet freed (a released buffer counts until its last copy
    ran), reported whatever the device's status; ``batches``/``batched_messages``/
    ``largest_batch``: the actor's wake-ups that served two or more queued ``Allocate``/
    ``AllocateMany``/``Free`` messages at once, the messages they served and the most in one
    (counted since the actor started, across rebuilds).
    """

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
    report: dict[str, Any] = field(default_factory=dict)
    pinned_count: int = 0
    pinned_bytes: int = 0
    pinned_by_tag: dict[str, dict[str, int]] = field(default_factory=dict)
    batches: int = 0
    batched_messages: int = 0
    largest_batch: int = 0


@dataclass(frozen=True, slots=True)
class Attach:
    """Internal: a library actor asks for the device's current context.

    Fields: none.
    Reply: the running ``DeviceContext`` (a broken one is rebuilt first).
    Errors: ``ContextPoisoned``/``DeviceUnavailable`` (the device's status).
    """


@dataclass(frozen=True, slots=True)
class FailedInCaller:
    """Internal: an ``Allocate``/``AllocateMany`` ask served in the asker's thread met ``error``
    in the context of ``generation``; the device actor answers it with that error after its
    supervisor acted on it (see ``DeviceActor._serve_in_caller``). Reply: raises ``error``.
    """

    error: BaseException
    generation: int


@dataclass(frozen=True, slots=True)
class ReportFailure:
    """Internal: a ``DeviceClient`` or a library actor met a context failure in another thread,
    for the device's supervisor to act on.

    Fields: ``error``, what was met; ``generation``, the context it was met in (None: the
    current one). A report about an older context is ignored: a rebuild already replaced it.
    Reply: None (it is told).
    """

    error: BaseException
    generation: int | None


def check_stream_and_tag(msg: Allocate | AllocateMany) -> None:
    """Check the ``stream``, ``tag`` and ``origin`` fields of an allocation message (the runtime checks the
    sizes itself).

    Args:
        msg: the message.
    Raises:
        InvalidRequest: ``stream`` is not an int (a ``StreamId``), ``tag`` not a str, or
            ``origin`` not None or a tuple.
    Thread rule: any thread.
    """
    name = type(msg).__name__
    if isinstance(msg.stream, bool) or not isinstance(msg.stream, int):
        raise InvalidRequest(f"{name}.stream must be a StreamId, got {msg.stream!r}")
    if not isinstance(msg.tag, str):
        raise InvalidRequest(f"{name}.tag must be an AllocTag (a str), got {msg.tag!r}")
    check_origin(msg)


def check_origin(msg: Allocate | AllocateMany | Free) -> None:
    """Check the ``origin`` field of a message (None, or the tuple the message captured itself).

    Raises:
        InvalidRequest: ``origin`` is something else.
    Thread rule: any thread.
    """
    if msg.origin is not None and type(msg.origin) is not tuple:
        raise InvalidRequest(f"{type(msg).__name__}.origin must be None (it is filled in), got {msg.origin!r}")


def check_actor_ref(msg: Subscribe | Unsubscribe) -> None:
    """Check the ``actor_ref`` field of a subscription message.

    Args:
        msg: the message.
    Raises:
        InvalidRequest: ``actor_ref`` is not a pykka ``ActorRef``.
    Thread rule: any thread.
    """
    if not isinstance(msg.actor_ref, pykka.ActorRef):
        raise InvalidRequest(
            f"{type(msg).__name__}.actor_ref must be a pykka ActorRef, got {type(msg.actor_ref).__name__}"
        )
