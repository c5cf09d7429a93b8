"""Zero-copy exchange of a ``GpuRef`` with other CUDA libraries (CuPy, PyTorch, Numba): the CUDA
Array Interface (v3), DLPack, and writes those libraries declare on their own streams. All of it
is offered on the CUDA driver only; ``GpuRef``'s protocol methods delegate here.

The CUDA Array Interface is a dict: a 1-D ``|u1`` view of the allocation, with the stream of the
handle's last write (the consumer orders its work after it).

cuda.core builds the DLPack capsule: a ``Buffer`` over the allocation, kept alive by the
``GpuRef`` as its owner, viewed through a ``StridedMemoryView`` as a 1-D ``uint8`` tensor. The
view is needed for the dtype: a bare ``Buffer`` exports ``int8`` (PyTorch showed it on the H200),
while ``__cuda_array_interface__`` says ``|u1``; both protocols must agree. cuda.core does not
order the consumer's stream, so the ordering the DLPack protocol asks of the producer is done
here: the consumer's stream is made to wait for the handle's last write before the capsule is
handed over.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..driver.protocol import Driver
from ..errors import InvalidRequest
from ..memory.block import Access, BlockId, DeviceBlock, StreamId
from ..runtime.device_runtime import XlogDeviceRuntime

__all__ = [
    "ExportedRef",
    "consumer_stream_handle",
    "cuda_array_interface",
    "dlpack_device",
    "export_dlpack",
    "foreign_stream_handle",
    "import_foreign_write",
    "require_cuda",
    "stream_handle",
]

_BYTES = np.dtype(np.uint8)


class _Context(Protocol):
    """What the exchange needs of a handle's context (``DeviceContext`` has it)."""

    @property
    def driver(self) -> Driver: ...

    @property
    def runtime(self) -> XlogDeviceRuntime: ...

    @property
    def ordinal(self) -> int: ...


class ExportedRef(Protocol):
    """What the exchange needs of a handle (``GpuRef`` has it). A protocol rather than
    ``GpuRef`` itself, so that this module does not import the handle that imports it."""

    @property
    def context(self) -> _Context:
        """The handle's context (driver, runtime, ordinal)."""
        ...

    @property
    def last_write_stream(self) -> StreamId | None:
        """The stream of the handle's last recorded write."""
        ...

    def access(self) -> DeviceBlock:
        """The handle's block, validated (``GpuRefStale`` otherwise). Thread rule: any thread."""
        ...

    def record_write(self, stream_id: StreamId) -> None:
        """Record a write on ``stream_id``. Thread rule: any thread."""
        ...


def require_cuda(ref: ExportedRef, what: str) -> None:
    """Refuse ``what`` on a handle that is not on the CUDA driver.

    Args:
        ref: the handle.
        what: the protocol's name, for the message.
    Raises:
        AttributeError: not on the CUDA driver (so ``hasattr(ref, what)`` is False there).
    Thread rule: any thread.
    """
    kind = ref.context.driver.kind
    if kind != "cuda":
        raise AttributeError(f"{what} is only offered on the CUDA driver (this device runs on {kind})")


def stream_handle(ctx: _Context, stream_id: StreamId | None) -> int | None:
    """The raw handle of ``stream_id`` in ``ctx``'s stream pool.

    Args:
        ctx: the handle's context.
        stream_id: a stream of its pool, or None.
    Returns:
        the handle, or None (no stream given, or the pool no longer has it).
    Thread rule: any thread.
    """
    if stream_id is None:
        return None
    stream = ctx.runtime.stream_pool.resolve(stream_id)
    return None if stream is None else stream.handle


def cuda_array_interface(ref: ExportedRef) -> dict[str, Any]:
    """The CUDA Array Interface (v3) of ``ref``: a 1-D ``uint8`` view with its last write's stream.

    Args:
        ref: the handle.
    Returns:
        the interface dict; ``stream`` is None when the data needs no ordering.
    Raises:
        AttributeError: not on the CUDA driver.
        GpuRefStale: the handle cannot be used.
    Thread rule: any thread.
    """
    require_cuda(ref, "__cuda_array_interface__")
    block = ref.access()
    handle = stream_handle(ref.context, ref.last_write_stream)
    return {
        "shape": (block.nbytes,),
        "typestr": "|u1",
        "data": (block.ptr, False),
        "version": 3,
        "strides": None,
        # CAI v3: the stream the data was last written on; None means "already
        # synchronized". A non-blocking stream has a handle above 2, as the interface asks.
        "stream": handle,
    }


def dlpack_device(ref: ExportedRef) -> tuple[int, int]:
    """``__dlpack_device__`` of ``ref``: ``(kDLCUDA, ordinal)``.

    Raises:
        AttributeError: not on the CUDA driver.
    Thread rule: any thread.
    """
    require_cuda(ref, "__dlpack_device__")
    return (2, ref.context.ordinal)  # kDLCUDA


def consumer_stream_handle(stream: Any) -> int | None:
    """The CUDA stream handle a DLPack consumer will use, per the DLPack/array-API rules for
    CUDA: ``None`` is the legacy default stream, ``-1`` asks for no synchronization (returns
    None), ``1`` legacy default, ``2`` per-thread default, any other int a stream handle; ``0``
    is ambiguous and refused.

    Raises:
        InvalidRequest: ``0``, or anything but an int or None.
    Thread rule: any thread.
    """
    if stream is None:
        return 1  # CU_STREAM_LEGACY
    if type(stream) is not int:
        raise InvalidRequest(f"__dlpack__(stream=...) takes an int or None on CUDA, got {stream!r}")
    if stream == -1:
        return None
    if stream == 0:
        raise InvalidRequest("__dlpack__(stream=0) is ambiguous on CUDA; pass 1 for the legacy default stream")
    return stream


def export_dlpack(ref: ExportedRef, stream: Any, kwargs: dict[str, Any]) -> Any:
    """``__dlpack__`` of ``ref``: a capsule of a 1-D ``uint8`` tensor over the allocation, kept
    alive by ``ref``; the consumer's ``stream`` is made to wait for the handle's last write.

    Args:
        ref: the handle.
        stream: the consumer's stream, per the DLPack rules (see ``consumer_stream_handle``).
        kwargs: the other ``__dlpack__`` keywords, passed on to cuda.core.
    Returns:
        the DLPack capsule.
    Raises:
        AttributeError: not on the CUDA driver.
        InvalidRequest: a bad ``stream``.
        GpuRefStale: the handle cannot be used.
    Thread rule: any thread.
    """
    require_cuda(ref, "__dlpack__")
    from cuda.core import Buffer
    from cuda.core.utils import StridedMemoryView

    ctx = ref.context
    block = ref.access()
    consumer = consumer_stream_handle(stream)
    producer = ref.last_write_stream
    if consumer is not None and producer is not None:
        producer_stream = ctx.runtime.stream_pool.resolve(producer)
        if producer_stream is not None and producer_stream.handle != consumer:
            # A CudaDriver method (require_cuda checked the kind); the Driver protocol does not have it.
            ctx.driver.order_foreign_stream(consumer, producer_stream)  # type: ignore[attr-defined]
    buffer = Buffer.from_handle(block.ptr, block.nbytes, owner=ref)
    view = StridedMemoryView.from_buffer(buffer, (block.nbytes,), dtype=_BYTES)
    return view.__dlpack__(**kwargs)


def foreign_stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` of another library's stream: an object with cuda.core's
    ``__cuda_stream__`` protocol, a PyTorch stream (``.cuda_stream``), a CuPy stream (``.ptr``),
    or the handle as an int (0 and 1 are the legacy default stream, 2 the per-thread one).

    Raises:
        InvalidRequest: none of these, or a negative handle.
    Thread rule: any thread.
    """
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        handle = protocol()[1]
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    elif hasattr(stream, "ptr") and not isinstance(stream, int):
        handle = stream.ptr
    else:
        handle = stream
    if type(handle) is not int or handle < 0:
        raise InvalidRequest(
            f"expected a CUDA stream (a handle as an int, or an object with __cuda_stream__, "
            f".cuda_stream or .ptr), got {stream!r}"
        )
    return handle


def import_foreign_write(ref: ExportedRef, stream: Any) -> None:
    """Declare that another library wrote ``ref``'s memory on its own stream (work already
    queued there). The device's default stream is made to wait for that stream and the write is
    recorded there like any library actor's, so every later consumer, on any stream, waits for
    it, and so does the memory's stream-ordered free.

    Args:
        ref: the handle written.
        stream: the writer's stream (see ``foreign_stream_handle``).
    Raises:
        AttributeError: not on the CUDA driver.
        InvalidRequest: ``stream`` is not a stream.
        GpuRefStale: the handle cannot be used.
    Thread rule: any thread.
    """
    require_cuda(ref, "record_foreign_write")
    ctx = ref.context
    handle = foreign_stream_handle(stream)
    block = ref.access()
    runtime = ctx.runtime
    sid = StreamId.DEFAULT
    ours = runtime.stream_pool.resolve(sid)
    assert ours is not None  # the pool makes it up front and keeps it while open
    block_id = BlockId.from_block(block)
    tracking = runtime.supports_block_use_tracking()
    if tracking:
        runtime.prepare_block_use(block_id, sid, Access.WRITE)
    # A CudaDriver method (require_cuda checked the kind); the Driver protocol does not have it.
    ctx.driver.wait_foreign_stream(ours, handle)  # type: ignore[attr-defined]
    if tracking:
        runtime.finish_block_use(block_id, sid, Access.WRITE)
    else:
        # An untracked stack: the write is complete before anyone sees it. No timeout: the
        # caller declared the foreign write already queued, so the wait ends with it.
        ours.synchronize()
    ref.record_write(sid)
