"""Cross-device ordering: a library actor's work that uses a handle of *another* device.

A peer copy runs on the actor's own stream, of its own device, but one of its handles lives on
a peer device, whose resource tracks that handle's uses on the peer's streams only: its last
write is an event of the peer's context, and its free waits, on the peer's allocation stream,
for the events of the peer's streams. The tracking is not extended to foreign streams. Instead
each actor keeps a **bridge** in each peer device's stream pool (acquired on first use, and again
once that device's context was rebuilt): two streams of that device that carry only waits and
events, one inbound and one outbound:

1. ``prepare``: the peer's resource prepares the use on the inbound stream
   (``prepare_block_use(block, inbound, access)``: it waits for the handle's last write, and for a
   write also for its reads); an event recorded there is then waited for by the actor's stream (a
   stream may wait on an event of another device of the same driver, in CUDA as on the host
   driver).
2. The work is enqueued on the actor's stream.
3. ``finish``: the outbound stream waits for an event recorded on the actor's stream after the
   work, and the peer's resource finishes the use there (``finish_block_use``): a read becomes a
   read event on the outbound stream, which the handle's free waits for; a write becomes the
   handle's last write, and ``record_write`` names the outbound stream.

So the peer's resource sees an ordinary use on its own streams, which completes only after the
cross-device work did, and nothing in the memory layer changes. The bridge holds no work of its
own: waiting on it delays nobody but the next users of the same handle. Two streams rather than
one, so that the inbound event of the next piece of work never queues behind the outbound wait
of the last one: consecutive reads of one source by copies on the actor's stream then run back to
back, without a cross-device round trip between them. It costs two events per peer use, next to
a copy of megabytes.

A context failure (``ContextLost``, ``ContextPoisoned``) met during peer work is checked against
each peer device's context (:func:`claim_peer_failure`): when a peer's is the failed one, it is
reported to *that* device actor's supervisor and the asker gets ``GpuRefStale`` for the peer
handle, so the actor's own device is not taken for the failed one.

When tracking is off (``track=False``) nothing is bridged; when the peer's stack does not track
(the direct stack), the actor synchronizes its stream before it replies, as it does for its own.

Thread rule: a :class:`PeerBridges` belongs to one actor and is used on its thread only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import pykka

from ..driver.protocol import Stream
from ..errors import ContextLost, ContextPoisoned, GpuRefStale, InvalidRequest
from ..memory.block import Access, BlockId, DeviceBlock, StreamId
from .device_context import DeviceContext
from .gpu_ref import GpuRef
from .messages import ReportFailure

__all__ = ["PeerBridges", "PeerUse", "claim_peer_failure"]


def claim_peer_failure(exc: ContextLost | ContextPoisoned, refs: Sequence[GpuRef]) -> None:
    """Make a context failure met during peer work the failed peer device's, when it is one.

    The driver does not say which device a failure came from, so each peer device's context is
    checked: the first that fails its check is told (``ReportFailure``, for its supervisor) and
    the asker gets ``GpuRefStale`` for its handle. When every peer is well, this returns and the
    failure stays the actor's own device's.

    Args:
        exc: the failure met.
        refs: the handles of peer devices the work used.
    Raises:
        GpuRefStale: a peer device's context failed (``"context poisoned"`` for a sticky error,
            else ``"context rebuilt"``: its supervisor rebuilds it).
    Thread rule: the actor's thread.
    """
    for ref in refs:
        ctx = ref.context
        try:
            ctx.driver.check_context(ctx.ordinal)
        except (ContextLost, ContextPoisoned):
            try:
                ctx.actor_ref.tell(ReportFailure(exc, ctx.generation))
            except pykka.ActorDeadError:
                pass  # the peer device is gone: nothing left to supervise
            detail = f"{ref!r}: device {ctx.ordinal} failed during the peer work: {exc}"
            if isinstance(exc, ContextPoisoned):
                raise GpuRefStale("context poisoned", detail) from exc
            raise GpuRefStale("context rebuilt", detail) from exc


@dataclass(frozen=True)
class PeerUse:
    """One use of a handle of a peer device by work on an actor's stream.

    Attributes:
        ref: the handle.
        block: its block (validated).
        access: how the work uses it.
        context: the handle's device context (its generation).
        inbound: the bridge's inbound stream (the peer's waits before the work).
        outbound_id: the bridge's outbound stream, in that context's stream pool.
        outbound: the outbound stream itself (waits for the work; the use is recorded there).
        tracked: whether the peer's resource tracks uses (and the actor tracks at all).
    Thread rule: immutable; made and used on the actor's thread.
    """

    ref: GpuRef
    block: DeviceBlock
    access: Access
    context: DeviceContext
    inbound_id: StreamId
    inbound: Stream
    outbound_id: StreamId
    outbound: Stream
    tracked: bool

    def prepare(self, stream: Stream) -> None:
        """Order ``stream`` (the actor's) after what the use must wait for on the peer device.

        Args:
            stream: the stream the work goes on.
        Raises:
            XlogError: the peer's resource or either driver call refused; waits already queued
                are harmless (they only order a stream after work that was enqueued).
        Thread rule: the actor's thread.
        """
        if not self.tracked:
            return
        self.context.runtime.prepare_block_use(BlockId.from_block(self.block), self.inbound_id, self.access)
        stream.wait(self.inbound.record_event())

    def finish(self, stream: Stream) -> None:
        """Record, after the work was enqueued on ``stream``, the use on the peer device: later
        users of the handle and its free then wait for the work.

        Args:
            stream: the stream the work went on.
        Raises:
            XlogError: the peer's resource or either driver call refused.
        Thread rule: the actor's thread.
        """
        if not self.tracked:
            return
        self.outbound.wait(stream.record_event())
        self.context.runtime.finish_block_use(BlockId.from_block(self.block), self.outbound_id, self.access)

    def record_write(self) -> None:
        """Name the outbound stream as the handle's last writer, when the use writes. Thread
        rule: the actor's thread."""
        if self.access.writes:
            self.ref.record_write(self.outbound_id)


class PeerBridges:
    """An actor's bridges, one per peer device (two streams each), in that device's current
    context.

    Invariant: a bridge is used only with handles of the context whose pool made it; a handle of
    a newer context gets a new bridge (the old one went with its pool). Contexts are held weakly,
    so a rebuilt device's old context is not kept alive here.

    Thread rule: the owning actor's thread only.
    """

    def __init__(self) -> None:
        """No bridge yet. Thread rule: the actor's thread."""
        self._bridges: dict[int, tuple[weakref.ref[DeviceContext], tuple[StreamId, Stream, StreamId, Stream]]] = {}

    def use(self, ref: GpuRef, access: Access, own: DeviceContext, *, track: bool, field: str) -> PeerUse:
        """Validate ``ref`` as a handle of a peer device of ``own``'s driver and bridge to it.

        Args:
            ref: the handle.
            access: how the work uses it.
            own: the actor's own device context.
            track: whether the actor tracks at all (False: no bridge is used).
            field: the message field ``ref`` came in, for the error.
        Returns:
            The use, its bridge acquired.
        Raises:
            GpuRefStale: the handle cannot be used (released, its device rebuilt, stopped).
            InvalidRequest: the handle is of ``own``'s device or of another driver.
            DriverError: the bridge stream could not be created; nothing was enqueued.
        Thread rule: the actor's thread.
        """
        block = ref.access()
        ctx = ref.context
        if block.device_ordinal == own.ordinal:
            raise InvalidRequest(f"{field}: {ref!r} is of the actor's own device {own.ordinal}, not a peer")
        if ctx.driver is not own.driver:
            raise InvalidRequest(f"{field}: {ref!r} is of another driver than device {own.ordinal}'s")
        if not ctx.is_current():
            raise GpuRefStale("context rebuilt", f"{ref!r} is not of device {ctx.ordinal}'s current context")
        tracked = track and ctx.runtime.supports_block_use_tracking()
        return PeerUse(ref, block, access, ctx, *self._bridge(ctx), tracked)

    def _bridge(self, ctx: DeviceContext) -> tuple[StreamId, Stream, StreamId, Stream]:
        entry = self._bridges.get(ctx.ordinal)
        if entry is not None and entry[0]() is ctx:
            return entry[1]
        streams = (*_acquire(ctx), *_acquire(ctx))
        self._bridges[ctx.ordinal] = (weakref.ref(ctx), streams)
        return streams


def _acquire(ctx: DeviceContext) -> tuple[StreamId, Stream]:
    """A new stream of ``ctx``'s pool."""
    pool = ctx.runtime.stream_pool
    sid = pool.acquire()
    stream = pool.resolve(sid)
    if stream is None:  # the pool was closed between the two calls: the context is gone
        raise GpuRefStale("context rebuilt", f"device {ctx.ordinal}'s stream pool closed during the work")
    return sid, stream
