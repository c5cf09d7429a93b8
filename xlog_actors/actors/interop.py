"""Zero-copy export of a ``GpuRef`` to other CUDA libraries (CuPy, PyTorch, Numba): DLPack.

cuda.core builds the DLPack capsule: a ``Buffer`` over the allocation, kept alive by the
``GpuRef`` as its owner, viewed through a ``StridedMemoryView`` as a 1-D ``uint8`` tensor. The
view is needed for the dtype: a bare ``Buffer`` exports ``int8`` (PyTorch showed it on the H200),
while ``__cuda_array_interface__`` says ``|u1``; both protocols must agree. cuda.core does not
order the consumer's stream, so the ordering the DLPack protocol asks of the producer is done
here: the consumer's stream is made to wait for the handle's last write before the capsule is
handed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidRequest
from ..memory.block import Access, BlockId, StreamId

if TYPE_CHECKING:
    from .device_context import DeviceContext
    from .gpu_ref import GpuRef

__all__ = ["consumer_stream_handle", "export_dlpack", "foreign_stream_handle", "import_foreign_write"]

_BYTES = np.dtype(np.uint8)


def consumer_stream_handle(stream: Any) -> int | None:
    """The CUDA stream handle a DLPack consumer will use, per the DLPack/array-API rules for
    CUDA: ``None`` is the legacy default stream, ``-1`` asks for no synchronization (returns
    None), ``1`` legacy default, ``2`` per-thread default, any other int a stream handle; ``0``
    is ambiguous and refused."""
    if stream is None:
        return 1  # CU_STREAM_LEGACY
    if type(stream) is not int:
        raise InvalidRequest(f"__dlpack__(stream=...) takes an int or None on CUDA, got {stream!r}")
    if stream == -1:
        return None
    if stream == 0:
        raise InvalidRequest("__dlpack__(stream=0) is ambiguous on CUDA; pass 1 for the legacy default stream")
    return stream


def export_dlpack(ref: GpuRef, ctx: DeviceContext, stream: Any, kwargs: dict[str, Any]) -> Any:
    from cuda.core import Buffer
    from cuda.core.utils import StridedMemoryView

    block = ref.access()
    consumer = consumer_stream_handle(stream)
    producer = ref.last_write_stream
    if consumer is not None and producer is not None:
        producer_stream = ctx.runtime.stream_pool.resolve(producer)
        if producer_stream is not None and producer_stream.handle != consumer:
            ctx.driver.order_foreign_stream(consumer, producer_stream)  # type: ignore[attr-defined]
    buffer = Buffer.from_handle(block.ptr, block.nbytes, owner=ref)
    view = StridedMemoryView.from_buffer(buffer, (block.nbytes,), dtype=_BYTES)
    return view.__dlpack__(**kwargs)


def foreign_stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` of another library's stream: an object with cuda.core's
    ``__cuda_stream__`` protocol, a PyTorch stream (``.cuda_stream``), a CuPy stream (``.ptr``),
    or the handle as an int (0 and 1 are the legacy default stream, 2 the per-thread one)."""
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


def import_foreign_write(ref: GpuRef, ctx: DeviceContext, stream: Any) -> None:
    """Declare that another library wrote ``ref``'s memory on its own stream (work already
    queued there). The device's default stream is made to wait for that stream and the write is
    recorded there like any library actor's, so every later consumer, on any stream, waits for
    it, and so does the memory's stream-ordered free."""
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
    ctx.driver.wait_foreign_stream(ours, handle)  # type: ignore[attr-defined]
    if tracking:
        runtime.finish_block_use(block_id, sid, Access.WRITE)
    else:
        ours.synchronize()  # an untracked stack: the write is complete before anyone sees it
    ref.record_write(sid)
