"""The driver protocol: the one place that talks to a device.

Two drivers implement it: :class:`~xlog_actors.driver.host.HostDriver` (the CUDA stream model
emulated on host threads and host memory) and :class:`~xlog_actors.driver.cuda.CudaDriver`
(cuda-python). Everything above this layer is written once against these protocols, so the
tracking code CI tests on the host driver is the very code that runs on the GPU.

The protocols are generic in the types each driver makes: ``Stream[E]`` records and waits on
events of type ``E``, and ``Driver[S, E]`` makes streams of type ``S`` and events of type ``E``
and takes its own streams back. So ``HostDriver`` is a ``Driver[HostStream, HostEvent]`` and
``CudaDriver`` a ``Driver[CudaStream, CudaEvent]``, each annotated with its own types. Code above
this layer writes plain ``Driver`` (``Driver[Any, Event]``), ``Stream`` (``Stream[Any]``) and
``Event``: it only ever hands a driver the streams and events that driver made.

This module is over 400 lines because it is the reference of the driver contract: every method
documents its arguments, errors and thread rule here once, for both drivers.

Thread rules: every method may be called from any thread. On CUDA the driver makes the device's
context current in the calling thread itself, so callers never have to.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .graph import Graph, GraphStep
    from .kernel import Kernel

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:  # pragma: no cover - the buffer protocol has no ABC before 3.12
    Buffer = Any

__all__ = ["Buffer", "Driver", "DriverKind", "Event", "Stream"]

DriverKind = Literal["cuda", "host"]

# The type parameters have defaults (PEP 696), so that code above this layer may write a plain
# ``Driver`` or ``Stream``. Only the type checker reads the defaults; ``typing.TypeVar``
# takes none before Python 3.13 and ``typing_extensions`` is no runtime dependency, so the
# runtime makes the same type variables without them.
if TYPE_CHECKING:
    from typing_extensions import TypeVar

    #: A stream's event type. Invariant: a stream both takes its events (``record``, ``wait``)
    #: and makes them (``record_event``).
    E = TypeVar("E", bound="Event", default=Any)
    #: A driver's event type. Covariant: a driver only makes events (``create_event``); so its
    #: default can be ``Event`` itself, which every driver's events are.
    E_co = TypeVar("E_co", bound="Event", covariant=True, default="Event")
    #: A driver's stream type. Invariant: a driver both makes its streams and takes them back.
    S = TypeVar("S", bound="Stream[Any]", default=Any)
else:
    E = typing.TypeVar("E", bound="Event")
    E_co = typing.TypeVar("E_co", bound="Event", covariant=True)
    S = typing.TypeVar("S", bound="Stream[Any]")


@runtime_checkable
class Event(Protocol):
    """A completion marker recorded on a stream.

    ``query()`` is True once the stream has run every operation enqueued before the most recent
    ``Stream.record(event)``; an event that was never recorded counts as complete (as in CUDA).
    An event belongs to the context it was made in: after that context is rebuilt or its driver
    closed, every method raises ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``).

    Thread rule: any thread.
    """

    @property
    def ordinal(self) -> int:
        """The device ordinal whose context made this event. Thread rule: any thread."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the work before the latest record ran.

        Raises:
            DriverError: the event's context is gone (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def query(self) -> bool:
        """Whether the work before the latest record ran; never blocks.

        Returns:
            True once it ran (or the event was never recorded), else False.
        Raises:
            DriverError: the event's context is gone (``CUDA_ERROR_INVALID_HANDLE``).
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...


@runtime_checkable
class Stream(Protocol[E]):
    """An in-order queue of device work, making and taking events of type ``E``.

    Streams run concurrently with each other; ``wait`` orders this stream after an event without
    blocking the host. After its context is rebuilt or its driver closed, every method but
    ``close`` raises ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``).

    Thread rule: any thread; work enqueued from several threads runs in the order the calls took
    the stream.
    """

    @property
    def id(self) -> int:
        """A process-unique id, from 1 (0 is the default stream). Thread rule: any thread."""
        ...

    @property
    def ordinal(self) -> int:
        """The device ordinal whose context made this stream. Thread rule: any thread."""
        ...

    @property
    def handle(self) -> int:
        """The driver's raw stream handle (``CUstream`` as an int; a host-unique int on the host
        driver). What ``__cuda_array_interface__`` and DLPack exports carry. Thread rule: any
        thread."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until everything enqueued so far ran.

        Raises:
            DriverError: the stream was closed or its context is gone.
            ContextPoisoned: the device saw a sticky error (perhaps raised by this stream's work).
        Thread rule: any thread.
        """
        ...

    def query(self) -> bool:
        """Whether everything enqueued so far ran; never blocks.

        Returns:
            True when the stream is idle, else False.
        Raises:
            DriverError: the stream was closed or its context is gone.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def record_event(self) -> E:
        """A new event recorded at the current end of this stream.

        Returns:
            The event, of this stream's device.
        Raises:
            DriverError: the stream was closed or its context is gone.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def record(self, event: E) -> None:
        """Re-record ``event`` (from ``Driver.create_event``) at the current end of this stream.

        Waits already enqueued on the event keep the record they saw (CUDA semantics), so a
        pooled event can be recorded again as soon as nobody will enqueue a new wait on it.

        Args:
            event: an event of this stream's device and driver.
        Raises:
            InvalidRequest: ``event`` is of another device, driver or type.
            DriverError: the stream or the event belongs to a context that is gone.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def wait(self, event: E) -> None:
        """Make later work on this stream wait for ``event``; never blocks the host.

        Args:
            event: an event of this driver (of any of its devices).
        Raises:
            InvalidRequest: ``event`` is not one of this driver's event type.
            DriverError: the stream or the event belongs to a context that is gone.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def close(self) -> None:
        """Destroy the stream once its queued work is done; never blocks. Idempotent, and never
        raises for a stream whose context is gone. Thread rule: any thread."""
        ...


class Driver(Protocol[S, E_co]):
    """The one place that talks to a device: streams of type ``S``, events of type ``E_co``.

    Pointers are plain ints (device virtual addresses). Every method taking a stream takes only
    one this driver made. Common errors, not repeated below: ``InvalidRequest`` for a malformed
    argument (an ordinal out of range, a stream of another driver, a bad size), ``DriverError``
    for a closed driver or a stream of a context that is gone, ``ContextPoisoned`` once the device
    saw a sticky error, ``ContextLost`` when its context was reset behind the driver's back.

    Thread rule: every method may be called from any thread.
    """

    @property
    def kind(self) -> DriverKind:
        """``"cuda"`` or ``"host"``. Thread rule: any thread."""
        ...

    def device_count(self) -> int:
        """How many devices this driver drives (ordinals ``0 .. count - 1``). Thread rule: any."""
        ...

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        """``(free, total)`` bytes of device ``ordinal``.

        Args:
            ordinal: the device.
        Returns:
            Free and total bytes, as the device reports them now.
        Thread rule: any thread.
        """
        ...

    def device_name(self, ordinal: int) -> str:
        """Device ``ordinal``'s product name. Thread rule: any thread."""
        ...

    def make_current(self, ordinal: int) -> None:
        """Make ``ordinal``'s context current in the calling thread (a no-op on the host).

        Args:
            ordinal: the device.
        Thread rule: any thread; it acts on the calling thread.
        """
        ...

    def create_stream(self, ordinal: int) -> S:
        """A new non-blocking stream on device ``ordinal``.

        Args:
            ordinal: the device.
        Returns:
            The stream; close it when done (a garbage-collected stream is destroyed later).
        Thread rule: any thread.
        """
        ...

    def create_event(self, ordinal: int) -> E_co:
        """A new, never recorded event (it queries complete) on device ``ordinal``.

        Args:
            ordinal: the device.
        Returns:
            The event; record it with ``Stream.record``.
        Thread rule: any thread.
        """
        ...

    # Synchronous allocation: cuMemAlloc / cuMemFree. ``free`` is device-synchronizing, as
    # cuMemFree is.
    def alloc(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` on device ``ordinal``, synchronously.

        Args:
            ordinal: the device.
            nbytes: a positive byte count.
        Returns:
            The pointer.
        Raises:
            OutOfMemory: the device cannot give ``nbytes`` (``.requested`` says how many).
        Thread rule: any thread.
        """
        ...

    def free(self, ordinal: int, ptr: int) -> None:
        """Free an ``alloc`` pointer; waits for the device's work first, as ``cuMemFree`` does.

        Args:
            ordinal: the device ``ptr`` was allocated on.
            ptr: a live pointer from ``alloc`` of this driver.
        Raises:
            DriverError: ``ptr`` is no live ``alloc`` pointer (``CUDA_ERROR_INVALID_VALUE``).
        Thread rule: any thread.
        """
        ...

    # Stream-ordered allocation: cuMemAllocAsync / cuMemFreeAsync on the device's pool, whose
    # release threshold keeps freed memory cached.
    def alloc_async(self, nbytes: int, stream: S) -> int:
        """Allocate ``nbytes`` from the device's pool, ordered on ``stream``.

        Args:
            nbytes: a positive byte count.
            stream: the stream the block is first used on; other streams must wait on it.
        Returns:
            The pointer.
        Raises:
            OutOfMemory: the pool cannot give ``nbytes``.
            DriverError: the device has no memory pools (``CUDA_ERROR_NOT_SUPPORTED``).
        Thread rule: any thread.
        """
        ...

    def free_async(self, ptr: int, stream: S) -> None:
        """Give ``ptr`` back to the pool once the work enqueued on ``stream`` so far ran.

        Args:
            ptr: a pointer from ``alloc_async``.
            stream: a stream ordered after every use of ``ptr``.
        Raises:
            DriverError: ``ptr`` is no device pointer (``CUDA_ERROR_INVALID_VALUE``).
        Thread rule: any thread.
        """
        ...

    # Page-locked host memory: cuMemHostAlloc / cuMemFreeHost. Portable: usable with every
    # context of the process, and it outlives a context rebuild; ``close`` frees what is left.
    def alloc_pinned(self, ordinal: int, nbytes: int) -> int:
        """Allocate ``nbytes`` of page-locked host memory through device ``ordinal``.

        Copies to and from it are truly asynchronous and need no staging copy. The memory is
        portable (``CU_MEMHOSTALLOC_PORTABLE``): a context rebuild does not free it, and any
        device of this driver may copy to or from it. It is at least 4096-byte aligned.

        Args:
            ordinal: the device whose context allocates it.
            nbytes: a positive byte count.
        Returns:
            The host address of its first byte.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int, or a bad ordinal.
            OutOfMemory: the host cannot lock ``nbytes`` more bytes (``.requested`` says how many).
        Thread rule: any thread.
        """
        ...

    def free_pinned(self, ordinal: int, ptr: int) -> None:
        """Free an ``alloc_pinned`` pointer. The caller makes sure no copy still uses it.

        Args:
            ordinal: the device it was allocated through.
            ptr: a live pointer from ``alloc_pinned`` of this driver and device.
        Raises:
            DriverError: ``ptr`` is no live ``alloc_pinned`` pointer of this driver and device
                (freed already, or foreign); nothing is freed then.
        Thread rule: any thread, finalizers included: it takes no lock another driver call
        holds while it could run a finalizer, and never makes a context current in the caller.
        """
        ...

    def pinned_view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of the first ``nbytes`` of a live ``alloc_pinned`` allocation.

        The view does not keep the allocation alive: the caller keeps it so until the view and
        everything made from it are gone.

        Args:
            ptr: a live pointer from ``alloc_pinned`` of this driver.
            nbytes: how many bytes to view, 1 to the allocation's size.
        Returns:
            A writable ``memoryview`` of format ``"B"``.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive int.
            DriverError: ``ptr`` is no live ``alloc_pinned`` pointer, or ``nbytes`` exceeds it.
        Thread rule: any thread.
        """
        ...

    def copy_to_device(self, ptr: int, data: Buffer, stream: S) -> None:
        """Enqueue a host-to-device copy of ``data`` to ``ptr``.

        The driver keeps ``data`` referenced until the copy ran. A pageable buffer may be reused
        as soon as the call returns (CUDA stages it; the host driver snapshots it); a page-locked
        buffer must keep its bytes until the copy ran, as with ``cudaMemcpyAsync``.

        Args:
            ptr: the destination.
            data: a contiguous buffer (its bytes are copied).
            stream: the stream the copy is ordered on.
        Raises:
            DriverError: ``ptr`` is no device pointer.
        Thread rule: any thread; the caller must not resize ``data`` until the copy ran.
        """
        ...

    def copy_to_host(self, ptr: int, nbytes: int, stream: S) -> bytearray:
        """Enqueue a device-to-host copy of ``nbytes`` from ``ptr``.

        Args:
            ptr: the source.
            nbytes: how many bytes to copy (0 or more).
            stream: the stream the copy is ordered on.
        Returns:
            The buffer, valid once ``stream`` (or an event recorded after this call) is
            synchronized.
        Raises:
            DriverError: ``ptr`` is no device pointer.
        Thread rule: any thread.
        """
        ...

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: S) -> None:
        """Like ``copy_to_host`` into a caller-provided writable buffer (pinned, for speed).

        Args:
            ptr: the source.
            out: a writable contiguous buffer; ``len(out)`` bytes are copied into it.
            stream: the stream to enqueue on.
        Raises:
            InvalidRequest: ``out`` is read-only.
            DriverError: ``ptr`` is no device pointer.
        Thread rule: any thread.
        """
        ...

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: S) -> None:
        """Enqueue a copy of ``nbytes`` from ``src`` to ``dst`` on the device.

        Args:
            dst: the destination.
            src: the source.
            nbytes: a non-negative byte count.
            stream: the stream to enqueue on.
        Raises:
            DriverError: ``dst`` or ``src`` is no device pointer.
        Thread rule: any thread.
        """
        ...

    def fill(self, ptr: int, byte: int, nbytes: int, stream: S) -> None:
        """Enqueue setting ``nbytes`` at ``ptr`` to ``byte``.

        Args:
            ptr: the destination.
            byte: an int in 0..255.
            nbytes: a non-negative byte count.
            stream: the stream to enqueue on.
        Raises:
            InvalidRequest: ``byte`` is out of range.
            DriverError: ``ptr`` is no device pointer.
        Thread rule: any thread.
        """
        ...

    def sleep(self, stream: S, microseconds: int) -> None:
        """Enqueue a spin of about ``microseconds`` on the stream (``torch.cuda._sleep``).

        Args:
            stream: the stream to enqueue on.
            microseconds: a non-negative duration.
        Raises:
            InvalidRequest: ``microseconds`` is negative or not a number.
        Thread rule: any thread.
        """
        ...

    def launch(
        self,
        kernel: Kernel,
        grid: Sequence[int] | int,
        block: Sequence[int] | int,
        args: Sequence[object],
        stream: S,
    ) -> None:
        """Enqueue ``kernel`` with already-resolved arguments (pointers as ints, scalars).

        Args:
            kernel: the kernel (its source for CUDA, its host twin for the host driver).
            grid: blocks per grid, 1 to 3 positive ints.
            block: threads per block, 1 to 3 positive ints.
            args: one value per ``kernel.params`` entry.
            stream: the stream to enqueue on.
        Raises:
            InvalidRequest: bad dimensions, or arguments that do not match ``kernel.params``.
            DriverError: the kernel does not compile (naming ``libnvrtc`` when NVRTC is missing).
        Thread rule: any thread.
        """
        ...

    def record_graph(self, ordinal: int, steps: Sequence[GraphStep], lanes: Sequence[int] | None = None) -> Graph:
        """Record ``steps`` once as a graph of device ``ordinal``, to be launched many times
        (see :mod:`.graph` for what a launch runs, what may be replaced and what it keeps).

        Args:
            ordinal: the device.
            steps: one or more :data:`~.graph.GraphStep`; host views must be of pinned memory.
            lanes: each lane's number of steps, summing to ``len(steps)``: consecutive runs of
                the steps with no order between them (see :mod:`.graph`); None for one chain.
        Returns:
            The graph, valid until closed or until the device's context is rebuilt.
        Raises:
            InvalidRequest: a malformed step (:func:`~.graph.check_steps`) or lane list
                (:func:`~.graph.check_lanes`), a host view that is not of pinned memory, a bad
                ordinal.
            DriverError: the kernel does not compile; a step's pointer is no device pointer.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    # Peer copies: cuMemcpyPeerAsync between two devices of this driver.
    def copy_peer(self, dst_ordinal: int, dst: int, src_ordinal: int, src: int, nbytes: int, stream: S) -> None:
        """Enqueue a copy of ``nbytes`` from ``src`` on device ``src_ordinal`` to ``dst`` on device
        ``dst_ordinal``, ordered on ``stream``, a stream of either of the two devices.

        Peer access need not be enabled: ``cuMemcpyPeerAsync`` works without it, staging through
        the host where the devices cannot reach each other. The copy is ordered only on
        ``stream``; ordering it after work on the other device's streams (the source's last
        write, say) is the caller's, with events (a stream may wait on an event of another
        device of the same driver). A copy within one device is refused: it is
        ``copy_device_to_device``.

        Args:
            dst_ordinal: the destination's device.
            dst: the destination, a pointer of that device.
            src_ordinal: the source's device, another device of this driver.
            src: the source, a pointer of that device.
            nbytes: a positive byte count.
            stream: a stream of device ``dst_ordinal`` or ``src_ordinal``.
        Raises:
            InvalidRequest: a bad ordinal or ``nbytes``, the same device twice, or ``stream`` of
                neither device.
            DriverError: ``dst`` or ``src`` is no pointer of its device
                (``CUDA_ERROR_INVALID_VALUE``).
            ContextPoisoned: either device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def check_context(self, ordinal: int) -> None:
        """Raise when ``ordinal``'s context is gone, including a reset made by foreign code
        behind the driver's back. Cheap; called once per actor message, not per allocation.

        Args:
            ordinal: the device.
        Raises:
            ContextLost: the context was reset from outside; rebuild it.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def rebuild_context(self, ordinal: int) -> None:
        """Destroy everything of ``ordinal``'s context (every allocation, stream and event this
        driver made in it) and start afresh; old streams and events raise from then on.

        Args:
            ordinal: the device.
        Raises:
            ContextPoisoned: a sticky error makes a rebuild impossible in this process.
        Thread rule: any thread; concurrent work on the device's streams either ran before
        or is refused.
        """
        ...

    def close(self) -> None:
        """Release every stream, thread and byte this driver holds. Idempotent; never raises.
        Thread rule: any thread."""
        ...
