"""``KernelActor``: launches kernels on its own stream, tracked on their buffer arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..driver.kernel import Kernel
from ..driver.protocol import Driver, Stream
from ..errors import InvalidRequest
from ..memory.block import DeviceBlock
from .gpu_ref import GpuRef
from .library_actor import LibraryActor
from .library_messages import BufferArg, Launch

__all__ = ["KernelActor"]


class KernelActor(LibraryActor):
    """``KernelActor.start(device)``: launches kernels on its own stream of ``device`` (the
    ``ActorRef`` of a running ``DeviceActor``); replies to ``Launch`` once the kernel is enqueued.
    See :class:`LibraryActor` for what it does with a message it does not understand.

    Buffer arguments are ``In(ref)``, ``Out(ref)`` or ``InOut(ref)``; each is validated, waited
    for as its access needs, and recorded after the launch (writes also ``record_write`` on the
    handle). Scalars pass through. On the CUDA driver the kernel is compiled by NVRTC once per
    device context; on the host driver its host implementation runs on the stream.
    """

    expected_messages = "Launch"

    def _handler(self, message: Any) -> Callable[[Any], Any] | None:
        return self._launch if type(message) is Launch else None

    def _launch(self, msg: Launch) -> None:
        kernel = msg.kernel
        if not isinstance(kernel, Kernel):
            raise InvalidRequest(f"Launch.kernel must be a Kernel, got {type(kernel).__name__}")
        if not isinstance(msg.args, (list, tuple)):
            raise InvalidRequest(f"Launch.args must be a list or tuple, got {type(msg.args).__name__}")
        args = list(msg.args)
        if len(args) != len(kernel.params):
            raise InvalidRequest(
                f"Launch.args: kernel {kernel.name} takes {len(kernel.params)} arguments {kernel.params}, "
                f"got {len(args)}"
            )
        buffers: list[tuple[int, BufferArg]] = []
        for i, (arg, kind) in enumerate(zip(args, kernel.params, strict=False)):
            if isinstance(arg, GpuRef):
                raise InvalidRequest(
                    f"Launch.args[{i}] of kernel {kernel.name}: wrap a GpuRef as In(ref), Out(ref) or InOut(ref)"
                )
            if isinstance(arg, BufferArg):
                if kind != "ptr":
                    raise InvalidRequest(f"Launch.args[{i}] of kernel {kernel.name} is a {kind} scalar, got a buffer")
                if not isinstance(arg.ref, GpuRef):
                    raise InvalidRequest(
                        f"Launch.args[{i}] of kernel {kernel.name}: In/Out/InOut wrap a GpuRef, "
                        f"got {type(arg.ref).__name__}"
                    )
                buffers.append((i, arg))
            elif kind == "ptr":
                raise InvalidRequest(f"Launch.args[{i}] of kernel {kernel.name} is a buffer; pass In/Out/InOut(ref)")

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            values = list(args)
            for (i, _), block in zip(buffers, blocks, strict=False):
                values[i] = block.ptr
            driver.launch(kernel, msg.grid, msg.block, values, stream)

        self._run([(b.ref, b.access) for _, b in buffers], enqueue)
