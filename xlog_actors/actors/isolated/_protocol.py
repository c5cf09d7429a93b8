"""The wire between an isolated device's proxy (the parent) and its child process.

A frame is a tuple whose first item names its kind, sent as one pickle over a
``multiprocessing`` ``Connection`` (length-prefixed by the connection itself):

=====================================  ============  ============================================
frame                                  direction     meaning
=====================================  ============  ============================================
``("booted", t)``                      child→parent  the interpreter is up and imported (``t``:
                                                     ``time.monotonic()``, one clock per machine)
``("config", ordinal, kind, resource,  parent→child  open the driver (``ipc_pool``: a CUDA
max_restarts, within_s, ipc_pool,                    driver with an IPC-capable pool), start the
lane)``                                              device actor; ``lane``: the name of the
                                                     call lane's shared segment, or None
``("ready", t_driver, t_ready)``       child→parent  the device serves (driver opened at
                                                     ``t_driver``, actor ready at ``t_ready``)
``("failed", error)``                  child→parent  the configuration failed; the child exits
``("ask", rid, payload, frees)``       parent→child  free ``frees`` (None, or a ``"free"`` frame's
                                                     ``(generation, ptrs)``), then serve the
                                                     message pickled in ``payload`` (bytes,
                                                     :func:`dumps`); answer with ``rid``
``("reply", rid, ok, value)``          child→parent  the answer to ``rid``: a value, or an
                                                     encoded error when ``ok`` is False
``("free", generation, ptrs)``         parent→child  the parent dropped these handles of the
                                                     child's ``generation``
``("generation", generation, status)`` child→parent  the child's device changed status
``("poisoned", error)``                child→parent  sent just before the child exits with
                                                     ``EXIT_POISONED``
``("wake",)``                          parent→child  a call-lane request was posted while the
                                                     child slept (nothing else to do)
``("stop",)``                          parent→child  stop the actors, close the driver, exit
=====================================  ============  ============================================

Allocations may instead go through the **call lane** (``_core.call_lane``): fixed binary
records in a segment both processes map, served by the child's frame loop and answered in place,
with no pickle and no system call; an allocation the child does not answer there (an error, a
busy device actor, an asker that stopped waiting) is answered with a ``reply`` frame under its
request id.

An ask's message is pickled on its own, inside the frame: a message the child cannot read (a
kernel's host function from a module the device process cannot import, say) is then answered
under its ``rid`` with an ``InvalidRequest`` (:func:`loads_payload`), its frees still done, where
the whole frame's failed read would end the child.

Request ids make the parent's asks pipelined: many are in flight at once, and replies are matched
to their askers by id, in whatever order the child answers them.

Errors cross as :func:`encode_error` tuples (class, args, attributes) rather than as pickled
exceptions: the runtime's errors take keyword-only arguments (``OutOfMemory(requested=...)``),
which ``pickle`` cannot rebuild.

Thread rule: :class:`Channel.send` may be called from any thread (a lock keeps frames whole);
:meth:`Channel.recv` from one thread per end.

The module runs past 400 lines because it is the whole wire: every frame's payload type and its
pickled form (the library work's pickled once, and read once, included) and the channel, so that
both ends read them from one place.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

from ..._core.doorbell import Doorbell
from ..._core.fdwait import wait_readable
from ...errors import DriverError, InvalidRequest
from ...memory.block import AllocTag, BlockState, DeviceBlock, Generation, StreamId, make_block
from ..library_messages import CopyDeviceToDevice, CopyToDevice, CopyToHost, Fill, Launch, Launches

__all__ = [
    "STATE_INDEX",
    "Channel",
    "ChildFault",
    "ExportBlock",
    "ExportHandle",
    "FreeBlock",
    "LibraryStop",
    "MESSAGE_FIELDS",
    "LibraryWork",
    "PickledWork",
    "work_of",
    "RemoteBlock",
    "RemoteHandle",
    "block_of",
    "child_entry",
    "decode_error",
    "dumps",
    "encode_error",
    "loads_payload",
]

#: What a :class:`ChildFault` can do to the child.
FaultKind = Literal["sticky", "illegal_address", "exit", "kill"]
FAULT_KINDS: tuple[str, ...] = ("sticky", "illegal_address", "exit", "kill")


@dataclass(frozen=True, slots=True)
class ChildFault:
    """**Test hook**: asked of an isolated device, it makes the child process fail, so tests
    and benchmarks can drive the restart path. Not for production use.

    Fields: ``kind``: ``"sticky"`` (the host driver's ``inject_fault(ordinal, "sticky")``, met
    at once by an allocation: the device is poisoned and the child exits with
    ``EXIT_POISONED``; ``InvalidRequest`` on another driver), ``"illegal_address"`` (a kernel
    that writes address 16, launched through a ``KernelActor`` in the child: a real sticky
    error on a GPU, the host driver's checked-memory equivalent elsewhere), ``"exit"``
    (``os._exit(3)``), ``"kill"`` (the child sends itself ``SIGKILL``); ``hold``: how many of the
    asks that follow the child takes without serving before it fails (so they are in flight
    when it does); 0 fails at once.
    Reply: none in practice (the child ends); its asker gets the typed error of the death.
    Errors: ``InvalidRequest`` (an unknown kind, a bad hold, ``"sticky"`` off the host driver).
    """

    kind: FaultKind
    hold: int = 0


@dataclass(frozen=True, slots=True)
class RemoteBlock:
    """A ``GpuRef`` of the child as it crosses to the parent: its block and the child's
    generation it was made in. Thread rule: immutable; any thread."""

    block: DeviceBlock
    generation: int

    def __reduce__(self) -> tuple[Any, ...]:
        # Plain ints and a str on the wire (about 1 µs each way, against 12 µs and 9 µs for the
        # dataclasses' own pickling): every allocation's reply is one.
        b = self.block
        if type(b.alloc_stream) is StreamId and type(b.tag) is AllocTag and type(b.generation) is Generation:
            return (_remote_block, (b.ptr, b.device_ordinal, int(b.alloc_stream), b.nbytes, b.align, str(b.tag),
                                    int(b.generation), STATE_INDEX[b.state], self.generation))
        return (RemoteBlock, (b, self.generation))


#: A block's state as it crosses processes (a ``RemoteBlock``'s pickle, a call-lane reply): its
#: index here.
BLOCK_STATES: tuple[BlockState, ...] = tuple(BlockState)
STATE_INDEX: dict[BlockState, int] = {state: i for i, state in enumerate(BLOCK_STATES)}


def block_of(ptr: int, ordinal: int, stream: int, nbytes: int, align: int, tag: str, block_generation: int,
             state_index: int) -> DeviceBlock:
    """A block from the plain fields it crosses processes as (a ``RemoteBlock``'s pickle, a
    call-lane reply). Thread rule: any thread."""
    return make_block(ptr, ordinal, StreamId(stream), nbytes, align, AllocTag(tag), Generation(block_generation),
                      BLOCK_STATES[state_index])


def _remote_block(ptr: int, ordinal: int, stream: int, nbytes: int, align: int, tag: str, block_generation: int,
                  state_index: int, generation: int) -> RemoteBlock:
    """A :class:`RemoteBlock` from its plain fields (its ``__reduce__``)."""
    return RemoteBlock(block_of(ptr, ordinal, stream, nbytes, align, tag, block_generation, state_index), generation)


@dataclass(frozen=True, slots=True)
class FreeBlock:
    """The payload of a ``Free`` asked in the parent: the child frees its handle at ``ptr`` of
    its ``generation`` (nothing when that handle is gone). Thread rule: immutable; any thread."""

    ptr: int
    generation: int


@dataclass(frozen=True, slots=True)
class ExportHandle:
    """Asked of the proxy when a parent-side ``GpuRef`` is pickled: have the child export it
    (answered with the child's ``GpuRefExport``). Thread rule: immutable; any thread."""

    ref: Any


@dataclass(frozen=True, slots=True)
class ExportBlock:
    """The payload of an ``ExportHandle``: the child exports its handle at ``ptr`` of its
    ``generation`` (``GpuRefStale("released")`` when that handle is gone). Thread rule:
    immutable; any thread."""

    ptr: int
    generation: int


@dataclass(frozen=True, slots=True)
class RemoteHandle:
    """A parent-side ``GpuRef`` inside a library actor's message as it crosses to the child: the
    child serves its own handle at ``ptr`` of its ``generation`` in its place
    (``GpuRefStale("released")`` when that handle is gone). Thread rule: immutable; any thread."""

    ptr: int
    generation: int

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        # Its two ints, rebuilt by the constructor: a frozen slots dataclass's own pickling
        # walks its fields on both sides (a few µs each way, on every copy's frame).
        return (RemoteHandle, (self.ptr, self.generation))


#: Each library message type's fields, by name, read once (``dataclasses.fields`` walks the class's
#: field table on every call): a ``LibraryWork`` pickles its message as its type and these values,
#: rebuilt by calling the type with them, and ``_library.map_refs`` rebuilds one by keyword (every
#: field is an ``__init__`` field, in order).
MESSAGE_FIELDS: dict[type, tuple[str, ...]] = {
    kind: tuple(f.name for f in dataclasses.fields(kind))
    for kind in (CopyToDevice, CopyToHost, CopyDeviceToDevice, Fill, Launch, Launches)
}


@dataclass(frozen=True, slots=True)
class LibraryWork:
    """Forwarded by the proxy for a parent-side library actor (``CopyActor.start(isolated)``):
    the child serves ``message`` on its own library actor ``library`` (the parent actor's URN),
    an ``actor_class`` started on the child's device with ``track``, which it starts on first use
    (so a new child re-creates it lazily). In the payload the child gets, every ``GpuRef`` of
    ``message`` is a :class:`RemoteHandle`, and a copy's source whose export the parent keeps a
    ``_sources.KeptSource``. ``forget``: the kept sources (their ``ident``) the child drops
    before it serves ``message`` (see :mod:`._sources`). Thread rule: immutable; any thread."""

    library: str
    actor_class: type[Any]
    track: bool
    message: Any
    forget: tuple[int, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Its fields, and a library message's as its type and values: the dataclasses' own
        # pickling walks each one's fields on both sides, on every forwarded message.
        message = self.message
        names = MESSAGE_FIELDS.get(type(message))
        if names is None:
            return (LibraryWork, (self.library, self.actor_class, self.track, message, self.forget))
        values = tuple([getattr(message, name) for name in names])
        return (_library_work, (self.library, self.actor_class, self.track, self.forget, type(message), values))


def _library_work(library: str, actor_class: type[Any], track: bool, forget: tuple[int, ...], kind: type,
                  values: tuple[Any, ...]) -> LibraryWork:
    """A :class:`LibraryWork` from its pickled parts (its ``__reduce__``)."""
    return LibraryWork(library, actor_class, track, kind(*values), forget)


class PickledWork:
    """A :class:`LibraryWork` payload pickled once (``data``) and sent again as those bytes: it
    unpickles, in the child, as the ``LibraryWork`` itself (``_library.payload_of`` says when),
    and the same bytes twice in a row as the same object (:func:`work_of`). Only a payload whose
    unpickling does nothing else is pickled this way: a copy of a kept source's token alone,
    which carries no handle (no count is taken when it is read).

    Thread rule: immutable; any thread.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        """Args:
            data: the pickled ``LibraryWork``.
        """
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (work_of, (self.data,))


#: The bytes :func:`work_of` unpickled last, and what they gave.
_last_work: tuple[bytes, Any] = (b"", None)


def work_of(data: bytes) -> Any:
    """The ``LibraryWork`` pickled in ``data``: unpickled, or, for the same bytes as the previous
    call's, the object that call made. A copy sent again unchanged is sent as the same bytes, and
    unpickling them makes nothing new: a ``LibraryWork``, its message and their handles' wire
    forms are immutable and made of nothing but the bytes, so equal bytes make equal objects.

    Args:
        data: the pickled ``LibraryWork``.
    Returns:
        the ``LibraryWork``.
    Thread rule: any thread (the child's frame reader in practice); the one-entry memo is swapped
    whole, with the GIL held.
    """
    global _last_work
    last = _last_work
    if data == last[0]:
        return last[1]
    work = pickle.loads(data)
    _last_work = (data, work)
    return work


@dataclass(frozen=True, slots=True)
class LibraryStop:
    """Told to the proxy when a parent-side library actor stops: the child stops its library
    actor ``library`` (nothing when it has none). Thread rule: immutable; any thread."""

    library: str


def encode_error(exc: BaseException) -> tuple[Any, ...]:
    """``exc`` as a picklable tuple for :func:`decode_error`.

    Args:
        exc: the error.
    Returns:
        ``(class, args, attributes)``, or ``(None, text, code)`` when the class or its
        attributes cannot cross (then it is rebuilt as a ``DriverError``).
    Thread rule: any thread.
    """
    attributes = {k: v for k, v in vars(exc).items() if not k.startswith("__")}
    encoded = (type(exc), exc.args, attributes)
    try:
        pickle.dumps(encoded)
    except Exception:  # noqa: BLE001 - an error whose parts cannot cross: keep its text and code
        return (None, f"{type(exc).__name__}: {exc}", getattr(exc, "code", None))
    return encoded


def decode_error(encoded: tuple[Any, ...]) -> BaseException:
    """The error :func:`encode_error` encoded, rebuilt without calling its ``__init__``.

    Args:
        encoded: the tuple.
    Returns:
        the error.
    Thread rule: any thread.
    """
    cls, args, attributes = encoded
    if cls is None:
        return DriverError(f"in the device process: {args}", code=attributes)
    # BaseException's own allocator: a subclass of MemoryError (OutOfMemory) refuses its base's.
    error: BaseException = BaseException.__new__(cls)
    error.args = args
    error.__dict__.update(attributes)
    return error


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for the pipe.

    Raises:
        InvalidRequest: ``obj`` cannot be pickled.
    Thread rule: any thread.
    """
    try:
        # The standard pickler first: the ForkingPickler that Connection.send uses builds a
        # pickler and a buffer per frame (about 3 µs) for reducers that only a few objects need,
        # which are tried second.
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - perhaps an object only multiprocessing's reducers know
        try:
            return bytes(ForkingPickler.dumps(obj))
        except Exception as exc:  # noqa: BLE001 - any pickling failure: reported as bad input
            kind = obj[0] if type(obj) is tuple and obj else type(obj).__name__
            raise InvalidRequest(f"a {kind!r} frame cannot be pickled: {exc!r}") from None


def loads_payload(payload: bytes, ordinal: int) -> Any:
    """The message an ask's ``payload`` carries (:func:`dumps`'s bytes), read in the child.

    Raises:
        InvalidRequest: the bytes do not read here (a class or function of a module this process
            cannot import, or one whose import or rebuilding raises), with the reason.
    Thread rule: the child's frame reader.
    """
    try:
        return pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickling ran raised: the asker's error
        raise InvalidRequest(
            f"isolated device {ordinal}: the device process could not read the request sent to it "
            f"({exc!r}); what crosses must be importable there, by the same module names"
        ) from None


class Channel:
    """One end of the pipe, with a lock so that frames sent from several threads stay whole.

    Thread rule: ``send`` from any thread; ``recv`` and ``poll`` from one thread.
    """

    __slots__ = ("_closed", "_conn", "_lock", "received", "sent")

    def __init__(self, conn: Connection) -> None:
        """Args:
            conn: the connection (duplex).
        """
        self._conn = conn
        self._lock = threading.Lock()
        self._closed = False
        #: Frames sent and frames read through this end: a call-lane request is ordered after
        #: the frames its asker sent before it by their count (``_core.call_lane``).
        self.sent = 0
        self.received = 0

    def send(self, frame: tuple[Any, ...]) -> None:
        """Send one frame.

        Raises:
            InvalidRequest: the frame cannot be pickled; nothing was sent.
            OSError, ValueError: the pipe is closed or broken (the other side is gone).
        Thread rule: any thread.
        """
        # What Connection.send does, split so that a pickling failure is told apart from a
        # broken pipe (and pickling holds no lock).
        data = dumps(frame)
        with self._lock:
            self._conn.send_bytes(data)
            self.sent += 1

    def recv(self) -> tuple[Any, ...]:
        """The next frame.

        Raises:
            EOFError, OSError: the other side is gone.
        Thread rule: one thread per end.
        """
        frame: tuple[Any, ...] = self._conn.recv()
        self.received += 1
        return frame

    def spin(self, seconds: float, bell: Doorbell | None = None) -> bool:
        """Spin up to ``seconds``, the GIL released, until a frame (or the end of the pipe) can
        be read (``_core.fdwait``); whether one can. ``bell``: rung first, once the GIL is
        released. Thread rule: the receiving thread."""
        return wait_readable(self._conn.fileno(), seconds, bell)

    def fileno(self) -> int:
        """The pipe's descriptor, to wait on. Thread rule: the receiving thread."""
        return self._conn.fileno()

    def poll(self, timeout: float) -> bool:
        """Whether a frame (or the end of the pipe) can be read within ``timeout`` seconds.
        Thread rule: the receiving thread."""
        return self._conn.poll(timeout)

    def close(self) -> None:
        """Close this end. Idempotent. Thread rule: any thread (the reader and ``stop()`` may
        both close it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._conn.close()


def child_entry(conn: Connection, module: str) -> None:
    """The spawned child's entry point: ``serve(conn)`` of ``module``.

    The child's module is named, not imported, by the parent: it imports ``DeviceActor``, whose
    ``start(isolate=True)`` imports the proxy, so an import would close a circle; in the child,
    spawn imports it by name anyway.

    Args:
        conn: the child's end of the pipe.
        module: the module that serves the device.
    Thread rule: the child's main thread.
    """
    importlib.import_module(module).serve(conn)
