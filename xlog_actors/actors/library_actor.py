"""What every library actor shares: its own stream on a device, and the tracking protocol
around each piece of work (validate, ``prepare_block_use``, enqueue, ``finish_block_use``,
``record_write``), on the actor's own device and, through bridge streams, on a peer device
(:mod:`.peer_use`).

Past 400 lines because the actor's life (start, attach, stop), the three ways a message is served
(its thread, a blocking asker's, a posting asker's) and the one tracked ``_run`` they all end in
share one lock and one attach state, and read best together."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import pykka

from .._core.library_core import EnqueueCore
from .._core.ops import ops_for
from .._core.posted_serve import PostedServe
from ..driver.protocol import Driver, Stream
from ..errors import ContextLost, ContextPoisoned, DeviceUnavailable, GpuRefStale, InvalidRequest, XlogError
from ..memory.block import Access, BlockId, DeviceBlock, StreamId
from ..memory.pinned import PinnedBuffer
from . import ranges
from .device_actor import DeviceActor
from .device_context import DeviceContext
from .gpu_ref import GpuRef
from .hot_waits import FUTURE_SPIN_S, INBOX_SPIN_S, SpinningFuture, SpinningInbox, spin_budget
from .isolated._library import start_library
from .isolated._proxy import IsolatedDevice
from .library_messages import BufferArg, CopyDone, CopyToDevice, CopyToHost, Launch
from .messages import Attach, GenerationChanged, ReportFailure, Subscribe, Unsubscribe
from .peer_use import PeerBridges, claim_peer_failure
from .pykka_internals import ResilientActor, is_actor_ref_of
from .served_ref import NOT_SERVED, ServedRef
from .supervisor import SupervisedFailure

__all__ = ["LibraryActor", "raise_if_rebuilt"]

logger = logging.getLogger(__name__)


class LibraryActor(ResilientActor):
    """Base of ``CopyActor`` and ``KernelActor``.

    Each instance owns one stream of its device's current context. It re-attaches (new context,
    new stream) when it meets a handle of a newer generation or is told ``GenerationChanged``.
    ``track=False`` switches the cross-stream tracking off, which only tests and the demo's
    ``--no-tracking`` use, to show what goes wrong without it.

    On a resource stack without tracking (the direct, sanitizer stack) the actor synchronizes
    its own stream before it replies, so every piece of work is complete when its reply
    arrives: slower, still correct.

    No message stops it: an unknown or malformed one that is told is logged and dropped; one that
    is asked is answered with ``InvalidRequest`` naming the field at fault.

    Its ``ActorRef`` is a :class:`.served_ref.ServedRef`: a blocking ask with no timeout, of the
    types in :attr:`caller_served`, is served in the asker's own thread while the actor is idle,
    with the same reply and errors (see :mod:`.served_ref` for the conditions and the order kept).

    Thread rules: one handler runs at a time, on the actor's thread or on the thread of an asker
    served in its own thread, under the actor's ``exclusive`` lock (``on_start`` and the stop
    too); every driver call makes the device's context current in its calling thread; the
    resource's tracking calls are thread-safe.
    """

    #: The names of the messages a subclass serves, for the answer to one it does not understand.
    expected_messages: str = ""

    #: The message types whose blocking asks may be served in the asker's thread (exact types).
    caller_served: ClassVar[tuple[type, ...]] = ()

    #: Of ``CopyToDevice``, ``CopyToHost`` and ``Launch``: those whose posted asks
    #: :class:`~xlog_actors._core.posted_serve.PostedServe` serves in C, making the checks and the
    #: ``EnqueueCore`` call of the handler's compiled path. A subclass that overrides one of
    #: these handlers must leave its type out.
    posted_compiled: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def start(cls, *args: Any, **kwargs: Any) -> pykka.ActorRef[Any]:
        """Start the actor on ``device`` (see ``__init__``) and return its ``ActorRef``.

        On the ``ActorRef`` of an isolated device (``DeviceActor.start(..., isolate=True)``) the
        actor runs in the device's process, next to the memory: the ref returned is that of a
        parent-side ``IsolatedLibrary`` that forwards each message to it (see
        :mod:`.isolated._library` for what crosses and what is refused).

        Args:
            args, kwargs: ``device`` and ``track``, as ``__init__`` takes them.
        Returns:
            the new actor's ``ActorRef``.
        Raises:
            InvalidRequest: as ``__init__``; nothing is started.
        Thread rule: any thread.
        """
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, pykka.ActorRef) and device.actor_class is IsolatedDevice and device.is_alive():
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            if len(args) > 1 or set(rest) - {"track"}:
                raise InvalidRequest(f"{cls.__name__}.start takes device and track, got {args!r} {kwargs!r}")
            return start_library(cls, device, rest.get("track", True))
        ref: pykka.ActorRef[Any] = super().start(*args, **kwargs)
        return ref

    actor_inbox: SpinningInbox  # what _create_actor_inbox makes

    @staticmethod
    def _create_actor_inbox() -> SpinningInbox:
        # pykka's hook: an inbox that looks for the next message a while before the thread
        # sleeps, so a pipeline's next stage does not wait for this thread to wake (hot_waits).
        return SpinningInbox(spin_budget(INBOX_SPIN_S))

    @staticmethod
    def _create_future() -> SpinningFuture:
        # pykka's hook, for ``ask``: the caller spins a while for the reply before it sleeps.
        return SpinningFuture(spin_budget(FUTURE_SPIN_S))

    def __init__(self, device: pykka.ActorRef[Any], *, track: bool = True) -> None:
        """Args:
            device: the ``ActorRef`` of a running ``DeviceActor``.
            track: False switches the cross-stream tracking off (tests and the demo only).
        Raises:
            InvalidRequest: ``device`` is not the ref of a running ``DeviceActor`` (another
                kind of actor, a stopped one, anything else), or ``track`` is not a bool.
                Nothing is started, and nothing is stopped.
        Thread rule: the caller's thread (``start`` runs it there, before the actor exists).
        """
        if not is_actor_ref_of(device, DeviceActor):
            what = (
                f"a ref of a stopped {device.actor_class.__name__}"
                if isinstance(device, pykka.ActorRef) and not device.is_alive()
                else f"a ref of a {device.actor_class.__name__}"
                if isinstance(device, pykka.ActorRef)
                else f"a {type(device).__name__}"
            )
            raise InvalidRequest(f"{type(self).__name__}.start needs the ActorRef of a running DeviceActor, got {what}")
        if not isinstance(track, bool):
            raise InvalidRequest(f"{type(self).__name__}.start: track must be a bool, got {track!r}")
        super().__init__()
        self._device = device
        self._track = track
        self._ctx: DeviceContext | None = None
        #: The generation of the context being attached, until the attach completes.
        self._attaching: int | None = None
        self._stream_id = StreamId.DEFAULT
        self._stream: Stream | None = None
        self._tracking = False
        self._driver: Driver | None = None
        self._check_context: Callable[[], None] = lambda: None  # set on attach
        #: The compiled one-handle path of the attached context, on a tracked stack (see
        #: ``_core.library_core``); None: every piece of work takes ``_run``.
        self._core: EnqueueCore | None = None
        self._peers = PeerBridges()
        #: Held by whoever runs a handler (module docstring of ``served_ref``).
        self._exclusive = threading.Lock()
        #: Set once ``on_start`` ran: no asker serves before it.
        self._started = False
        ref = ServedRef(self)  # pykka's own ref, made in its __init__, is replaced
        if self.posted_compiled:
            ref.serve_posts_with(PostedServe(weakref.ref(self), ref.serve_posted, NOT_SERVED, ranges,
                                             self.posted_compiled, PinnedBuffer, CopyDone, CopyToDevice,
                                             CopyToHost, Launch))
        self._actor_ref = ref

    def on_start(self) -> None:
        """Subscribe to the device's status changes and attach to its context.
        Thread rule: the actor's thread (pykka calls it), holding ``exclusive``."""
        with self._exclusive:
            try:
                self._start()
            finally:
                self._started = True

    def _start(self) -> None:
        try:
            self._device.tell(Subscribe(self.actor_ref))
        except pykka.ActorDeadError:
            # The device stopped after the check in __init__: every piece of work then answers
            # with DeviceUnavailable (see _attach).
            logger.warning("%s: its device stopped before it started", type(self).__name__)
            return
        try:
            self._attach()  # so ``stream_id`` names this actor's stream from the start
        except XlogError as exc:
            # A device that is not running yet: attach on the first piece of work instead,
            # which then answers with the device's typed error. A context failure met here is
            # still the device's supervisor's business.
            logger.info("%s: device not ready at start (%r); attaching later", type(self).__name__, exc)
            if isinstance(exc, (ContextLost, ContextPoisoned)):
                self._report(exc, None)

    def _serve_envelope(self, envelope: Any) -> None:
        # Every message the actor takes is served holding ``exclusive`` and counted as served
        # after its handler returned (served_ref). The box: this frame must not hold the envelope
        # while it is served (ResilientActor's loop says why).
        box = [envelope]
        del envelope
        with self._exclusive:
            try:
                super()._serve_envelope(box.pop())
            finally:
                self.actor_inbox.served()

    def serve_in_caller(self, message: Any) -> Any:
        """Serve ``message`` in the calling thread, as the actor would, when nothing is queued
        or being served and the actor runs (see :mod:`.served_ref`).

        Args:
            message: a message of one of :attr:`caller_served`.
        Returns:
            the reply, or :data:`.served_ref.NOT_SERVED` (the ask must go through the inbox).
        Raises:
            the message's own errors, as ``on_receive`` raises them (a lost or poisoned context is
            reported to the device's supervisor first, as on the actor's thread).
        Thread rule: any thread; runs the handler holding ``exclusive``.
        """
        exclusive = self._exclusive
        if not exclusive.acquire(blocking=False):
            return NOT_SERVED
        try:
            if not self._started or self.actor_stopped.is_set() or self.actor_inbox.unserved():
                return NOT_SERVED
            tracer = ranges.RANGES
            if tracer is None:
                return self.on_receive(message)
            tracer.push(type(self), type(message))
            try:
                return self.on_receive(message)
            finally:
                tracer.pop()
        finally:
            exclusive.release()

    def posts_in_caller(self, message: Any) -> bool:
        """Whether a non-blocking ask of ``message`` may be served in the asker's thread: its
        handler only enqueues work on a tracked stack (see :mod:`.served_ref`). A subclass names
        its messages in :meth:`_enqueue_only`; on an untracked stack every handler waits for its
        work, so none qualifies.

        Args:
            message: the message.
        Returns:
            True when it may be served in the asker's thread.
        Thread rule: any thread (reads fields set once per attach).
        """
        return (self._tracking or not self._track) and self._ctx is not None and self._enqueue_only(message)

    def _enqueue_only(self, message: Any) -> bool:
        """Whether ``message``'s handler never waits (a subclass's messages; none here)."""
        return False

    def on_stop(self) -> None:
        """Unsubscribe from the device, once the host buffers of copies in flight are let go.
        Thread rule: the actor's thread (pykka calls it)."""
        self._drop_core()
        try:
            self._device.tell(Unsubscribe(self.actor_ref))
        except pykka.ActorDeadError:
            pass  # the device went first; nothing to unsubscribe from

    @property
    def stream_id(self) -> StreamId:
        """The stream of the device's current context this actor works on.
        Thread rule: the actor's thread (read it from outside through ``proxy()``)."""
        return self._stream_id

    def _attach(self) -> DeviceContext:
        # The device actor never waits on a library actor, so this ask cannot deadlock; it
        # has no timeout because the device may be in the middle of a rebuild, which takes as
        # long as the driver does.
        try:
            ctx = cast(DeviceContext, self._device.ask(Attach()))
        except pykka.ActorDeadError as exc:
            raise DeviceUnavailable(f"{type(self).__name__}: its DeviceActor was stopped") from exc
        except (ContextLost, ContextPoisoned) as exc:
            # The device's own answer: its supervisor acted on it before answering, so reporting
            # it back would count one failure twice (a second rebuild for one lost context).
            raise SupervisedFailure(exc) from None
        # A failure met from here on is in this context, whatever ours was: report its generation,
        # so a device that has rebuilt since (on its own check) does not rebuild again.
        self._attaching = ctx.generation
        self._drop_core()
        ctx.driver.make_current(ctx.ordinal)
        self._stream_id = ctx.runtime.stream_pool.acquire()
        stream = ctx.runtime.stream_pool.resolve(self._stream_id)
        assert stream is not None
        self._stream = stream
        self._driver = ctx.driver
        # The driver's check_context, in one C call on CUDA (the compiled core's ops).
        self._check_context = ops_for(ctx.driver, ctx.ordinal).check_context
        self._tracking = self._track and ctx.runtime.supports_block_use_tracking()
        if self._tracking:
            runtime = ctx.runtime
            self._core = EnqueueCore(ctx, stream, self._stream_id, runtime.prepare_block_use,
                                     runtime.finish_block_use, Access.READ, Access.WRITE, PinnedBuffer, BufferArg)
        self._ctx = ctx
        self._attaching = None
        return ctx

    def _drop_core(self) -> None:
        """Forget the compiled path of the context left, once its kept host buffers may go."""
        core, self._core = self._core, None
        if core is not None:
            core.close()

    def _compiled(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a method of the attached context's ``EnqueueCore``, with the error
        rule of ``_run``: a failure while the context was rebuilt is a stale handle."""
        try:
            return call(*args)
        except XlogError as exc:
            self._stale_if_rebuilt(exc)
            raise

    def _stale_if_rebuilt(self, exc: XlogError) -> None:
        """``GpuRefStale`` from ``exc``, a compiled call's error, when the context it ran in was
        rebuilt meanwhile; nothing otherwise."""
        core = self._core
        if core is not None and not isinstance(exc, GpuRefStale):
            raise_if_rebuilt([core.context], exc)

    def _compiled_failed(self, exc: BaseException) -> None:
        """What the handler's path does with ``exc``, the error of a compiled call that
        :class:`~xlog_actors._core.posted_serve.PostedServe` made, before it is raised: the rule
        of :meth:`_compiled`, then :meth:`on_receive`'s report of a lost or poisoned context.

        Raises:
            GpuRefStale: the context was rebuilt during the call (from ``exc``).
        Thread rule: whoever holds ``exclusive``; the caller raises ``exc`` after.
        """
        if isinstance(exc, XlogError):
            self._stale_if_rebuilt(exc)
        if isinstance(exc, (ContextLost, ContextPoisoned)):
            self._context_failed(exc, self._ctx)

    def _context_for(self, refs: Sequence[GpuRef]) -> DeviceContext:
        """The context the handles belong to, re-attaching when they are newer than ours."""
        ctx = self._ctx
        if ctx is None or not ctx.open or any(r.generation > ctx.generation for r in refs):
            ctx = self._attach()
        return ctx

    def on_receive(self, message: Any) -> Any:
        """Serve ``message``: the reply, or its typed error.

        Raises:
            InvalidRequest: a message this actor does not understand, or a malformed one.
            XlogError: the message's own error; a lost or poisoned context is also reported
                to the device's supervisor.
        Thread rule: the actor's thread (pykka calls it).
        """
        if isinstance(message, GenerationChanged):
            self._ctx = None  # re-attach lazily, on the next piece of work
            self._drop_core()
            return None
        handler = self._handler(message)
        if handler is None:
            raise InvalidRequest(
                f"{type(self).__name__} does not understand {type(message).__name__} messages; "
                f"expected {self.expected_messages}"
            )
        ctx = self._ctx
        try:
            return handler(message)
        except SupervisedFailure as wrapped:
            raise wrapped.error from None
        except (ContextLost, ContextPoisoned) as exc:
            self._context_failed(exc, ctx)
            raise

    def _context_failed(self, exc: ContextLost | ContextPoisoned, ctx: DeviceContext | None) -> None:
        """Report ``exc``, met serving a message, to the device actor's supervisor, which decides
        what a lost or poisoned context means (the asker gets the error either way); ``ctx``: the
        context attached when the message came."""
        ctx = self._ctx or ctx
        generation = self._attaching if self._attaching is not None else None if ctx is None else ctx.generation
        self._attaching = None
        self._report(exc, generation)

    def _report(self, exc: BaseException, generation: int | None) -> None:
        """Tell the device actor's supervisor about a context failure met here (``generation``
        None: in the device's current context, as when it hit while attaching)."""
        try:
            self._device.tell(ReportFailure(exc, generation))
        except pykka.ActorDeadError:
            pass  # the device is gone: nothing left to supervise

    def _handler(self, message: Any) -> Callable[[Any], Any] | None:
        raise NotImplementedError

    @staticmethod
    def _check_refs(message: object, *fields: str) -> None:
        """Each named field of ``message`` must be a ``GpuRef``; else ``InvalidRequest`` naming it."""
        for name in fields:
            value = getattr(message, name)
            if not isinstance(value, GpuRef):
                raise InvalidRequest(f"{type(message).__name__}.{name} must be a GpuRef, got {type(value).__name__}")

    def _run(
        self,
        uses: Sequence[tuple[GpuRef, Access]],
        enqueue: Callable[[Driver, Stream, list[DeviceBlock]], None],
        *,
        wait: bool = False,
        peers: Sequence[tuple[GpuRef, Access, str]] = (),
    ) -> None:
        """Validate every handle, queue the waits the work needs, enqueue it, record what it did.
        ``enqueue`` gets the blocks in the order of ``uses``, then those of ``peers``. ``wait``:
        also wait for the work to finish (a copy to the host must hand over its bytes), inside the
        same guard, so a rebuild that retires the stream meanwhile reads as a stale handle too.
        ``peers``: ``(handle, access, field)`` of handles of *other* devices of the driver, each
        ordered through a bridge stream on its device (see :mod:`.peer_use`)."""
        if len(uses) == 1 and not peers and not wait and self._tracking:
            self._run_one(uses[0][0], uses[0][1], enqueue)
            return
        refs = [ref for ref, _ in uses]
        ctx = self._context_for(refs)
        self._check_context()  # a reset from outside: report it, touch nothing
        blocks = [ctx.check_ref(ref) for ref in refs]
        for ref in refs:
            if ref.context is not ctx:
                raise GpuRefStale("context rebuilt", f"{ref!r} is not of device {ctx.ordinal}'s current context")
        stream, driver, sid = self._stream, self._driver, self._stream_id
        assert stream is not None and driver is not None
        merged = _merge_uses(blocks, [a for _, a in uses])
        runtime = ctx.runtime
        peer_refs = [ref for ref, _, _ in peers]
        peer_uses = []
        try:
            peer_uses = [self._peers.use(ref, access, ctx, track=self._track, field=f) for ref, access, f in peers]
            if self._tracking:
                for block_id, access in merged:
                    runtime.prepare_block_use(block_id, sid, access)
            for peer in peer_uses:
                peer.prepare(stream)
            enqueue(driver, stream, blocks + [peer.block for peer in peer_uses])
            if self._tracking:
                for block_id, access in merged:
                    runtime.finish_block_use(block_id, sid, access)
            for peer in peer_uses:
                peer.finish(stream)
            if wait or (self._track and not (self._tracking and all(p.tracked for p in peer_uses))):
                # Asked for, or an untracked stack: finish before anyone sees it. No timeout: the
                # stream is this actor's own and holds only work it enqueued, which ends (a kernel
                # that faults ends it with a sticky error, which this wait raises).
                stream.synchronize()
                if self._core is not None:
                    self._core.prune()  # every compiled copy before the wait ran: its buffer may go
        except XlogError as exc:
            # A rebuild that ran on the device actor's thread between the validation above and
            # this work took the context (its streams, its blocks) away: that is a stale handle,
            # whatever the dead context's streams answered.
            if peer_refs and isinstance(exc, (ContextLost, ContextPoisoned)):
                claim_peer_failure(exc, peer_refs)
            if not isinstance(exc, GpuRefStale):
                raise_if_rebuilt([ctx, *(ref.context for ref in peer_refs)], exc)
            raise
        for ref, access in uses:
            if access.writes:
                ref.record_write(sid)
        for peer in peer_uses:
            peer.record_write()


    def _run_one(self, ref: GpuRef, access: Access,
                 enqueue: Callable[[Driver, Stream, list[DeviceBlock]], None]) -> None:
        """``_run`` of one handle on a tracked stack, with no peer and no wait: the same steps
        in the same order (most messages: a fill, a copy, a one-buffer launch), without the lists
        and merges several handles need."""
        ctx = self._ctx
        if ctx is None or not ctx.open or ref.generation > ctx.generation:
            ctx = self._attach()
        self._check_context()  # a reset from outside: report it, touch nothing
        block = ctx.check_ref(ref)
        if ref.context is not ctx:
            raise GpuRefStale("context rebuilt", f"{ref!r} is not of device {ctx.ordinal}'s current context")
        stream, driver, sid = self._stream, self._driver, self._stream_id
        assert stream is not None and driver is not None
        runtime = ctx.runtime
        try:
            runtime.prepare_block_use(block, sid, access)
            enqueue(driver, stream, [block])
            runtime.finish_block_use(block, sid, access)
        except XlogError as exc:
            if not isinstance(exc, GpuRefStale):  # a rebuild in the middle: a stale handle (see _run)
                raise_if_rebuilt([ctx], exc)
            raise
        if access.writes:
            ref.record_write(sid)


def raise_if_rebuilt(contexts: list[DeviceContext], exc: XlogError) -> None:
    """Raise ``GpuRefStale`` ("context rebuilt", from ``exc``) when one of ``contexts`` is no
    longer its device's current one: an error met by work that a rebuild took the context of
    reads as a stale handle, whatever the dead context answered. Returns when all are current.

    Args:
        contexts: the contexts the work ran in.
        exc: the error the work met.
    Raises:
        GpuRefStale: one of ``contexts`` was rebuilt.
    Thread rule: any thread.
    """
    for ctx in contexts:
        if not ctx.is_current():
            raise GpuRefStale("context rebuilt", f"device {ctx.ordinal} was rebuilt during the work") from exc


def _merge_uses(blocks: list[DeviceBlock], accesses: list[Access]) -> list[tuple[BlockId, Access]]:
    """One (block, access) per distinct block: a block both read and written is READ_WRITE."""
    if len(blocks) == 1:  # most work touches one handle
        return [(BlockId.from_block(blocks[0]), accesses[0])]
    merged: dict[BlockId, Access] = {}
    for block, access in zip(blocks, accesses, strict=False):
        key = BlockId.from_block(block)
        prev = merged.get(key)
        merged[key] = access if prev is None or prev is access else Access.READ_WRITE
    return list(merged.items())
