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

Thread rules: every method may be called from any thread. On CUDA the driver makes the device's
context current in the calling thread itself, so callers never have to.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
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
    """

    @property
    def ordinal(self) -> int: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@runtime_checkable
class Stream(Protocol[E]):
    """An in-order queue of device work. Streams run concurrently with each other; ``wait``
    orders this stream after an event without blocking the host."""

    @property
    def id(self) -> int: ...

    @property
    def ordinal(self) -> int: ...

    @property
    def handle(self) -> int:
        """The driver's raw stream handle (``CUstream`` as an int; a host-unique int on the host
        driver). What ``__cuda_array_interface__`` and DLPack exports carry."""
        ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def record_event(self) -> E:
        """A new event recorded at the current end of this stream."""
        ...

    def record(self, event: E) -> None:
        """Re-record ``event`` (from ``Driver.create_event``) at the current end of this stream.
        Waits already enqueued on the event keep the record they saw (CUDA semantics), so a
        pooled event can be recorded again as soon as nobody will enqueue a new wait on it."""
        ...

    def wait(self, event: E) -> None:
        """Make later work on this stream wait for ``event``; never blocks the host."""
        ...

    def close(self) -> None:
        """Destroy the stream once its queued work is done. Idempotent."""
        ...


class Driver(Protocol[S, E_co]):
    """See the module docstring. Pointers are plain ints (device virtual addresses)."""

    @property
    def kind(self) -> DriverKind: ...

    def device_count(self) -> int: ...

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        """``(free, total)`` bytes of device ``ordinal``."""
        ...

    def device_name(self, ordinal: int) -> str: ...

    def make_current(self, ordinal: int) -> None:
        """Make ``ordinal``'s context current in the calling thread (a no-op on the host)."""
        ...

    def create_stream(self, ordinal: int) -> S: ...

    def create_event(self, ordinal: int) -> E_co: ...

    # Synchronous allocation: cuMemAlloc / cuMemFree. ``free`` is device-synchronizing, as
    # cuMemFree is.
    def alloc(self, ordinal: int, nbytes: int) -> int: ...

    def free(self, ordinal: int, ptr: int) -> None: ...

    # Stream-ordered allocation: cuMemAllocAsync / cuMemFreeAsync on the device's pool, whose
    # release threshold keeps freed memory cached.
    def alloc_async(self, nbytes: int, stream: S) -> int: ...

    def free_async(self, ptr: int, stream: S) -> None: ...

    def copy_to_device(self, ptr: int, data: Buffer, stream: S) -> None:
        """Enqueue a host-to-device copy of ``data``; the driver keeps ``data`` referenced until
        the copy ran. A pageable buffer may be reused as soon as the call returns (CUDA stages
        it; the host driver snapshots it); a page-locked buffer must keep its bytes until the
        copy ran, as with ``cudaMemcpyAsync``."""
        ...

    def copy_to_host(self, ptr: int, nbytes: int, stream: S) -> bytearray:
        """Enqueue a device-to-host copy; the returned buffer is valid once ``stream`` (or an
        event recorded after this call) is synchronized."""
        ...

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: S) -> None:
        """Like ``copy_to_host`` into a caller-provided writable buffer (pinned, for speed)."""
        ...

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: S) -> None: ...

    def fill(self, ptr: int, byte: int, nbytes: int, stream: S) -> None: ...

    def sleep(self, stream: S, microseconds: int) -> None:
        """Enqueue a spin of about ``microseconds`` on the stream (``torch.cuda._sleep``)."""
        ...

    def launch(
        self,
        kernel: Kernel,
        grid: Sequence[int] | int,
        block: Sequence[int] | int,
        args: Sequence[object],
        stream: S,
    ) -> None:
        """Enqueue ``kernel`` with already-resolved arguments (pointers as ints, scalars)."""
        ...

    def check_context(self, ordinal: int) -> None:
        """Raise ``ContextLost`` (or ``ContextPoisoned``) when ``ordinal``'s context is gone,
        including a reset made by foreign code behind the driver's back. Cheap; called once per
        actor message, not per allocation."""
        ...

    def rebuild_context(self, ordinal: int) -> None:
        """Destroy ``ordinal``'s context (every allocation, stream and event of it) and make a new
        one. Raises ``ContextPoisoned`` where a sticky error makes that impossible in-process."""
        ...

    def close(self) -> None:
        """Release every stream, thread and byte this driver holds. Idempotent."""
        ...
