"""``KernelActor``: launches kernels on its own stream, tracked on their buffer arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..driver.checks import check_launch, checked_dims
from ..driver.kernel import Kernel
from ..driver.protocol import Driver, Stream
from ..errors import InvalidRequest
from ..memory.block import Access, DeviceBlock
from .gpu_ref import GpuRef
from .library_actor import LibraryActor
from .library_messages import BufferArg, Launch, Launches

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

    expected_messages = "Launch or Launches"
    caller_served = (Launch, Launches)
    posted_compiled = (Launch,)

    def _handler(self, message: Any) -> Callable[[Any], Any] | None:
        kind = type(message)
        if kind is Launch:
            return self._launch
        return self._launches if kind is Launches else None

    def _enqueue_only(self, message: Any) -> bool:
        return type(message) in (Launch, Launches)  # a launch only enqueues

    def _launch(self, msg: Launch) -> None:
        core = self._core
        if core is not None and self._compiled(core.launch, msg):
            return
        self._launch_all([_checked_fast(msg)])
        # Launched through the driver, which judged the dimensions and loaded the kernel: the
        # next launch of the same kernel and dimensions may take the compiled path.
        dims = checked_dims(msg.grid, msg.block)
        core = self._core
        if dims is not None and core is not None:
            core.learn(msg.kernel, msg.grid, msg.block, dims)

    def _launches(self, msg: Launches) -> None:
        launches = msg.launches
        if not isinstance(launches, (list, tuple)) or not launches:
            raise InvalidRequest(f"Launches.launches must be a non-empty list or tuple of Launch, got {launches!r}")
        checked = []
        for i, launch in enumerate(launches):
            if type(launch) is not Launch:
                raise InvalidRequest(f"Launches.launches[{i}] must be a Launch, got {type(launch).__name__}")
            checked.append(_checked(launch, f"Launches.launches[{i}]"))
        self._launch_all(checked)

    def _launch_all(self, launches: list[_Checked]) -> None:
        """Enqueue ``launches`` in order in one tracked run. Several launches are all judged
        first, so a refused one enqueues nothing (the driver judges each again as it launches
        it); a lone launch is judged by the driver only."""
        uses: list[tuple[GpuRef, Access]] = [(b.ref, b.access) for launch in launches for _, b in launch.buffers]

        def enqueue(driver: Driver, stream: Stream, blocks: list[DeviceBlock]) -> None:
            resolved = []
            at = 0
            for launch in launches:
                values = list(launch.args)
                for i, _ in launch.buffers:
                    values[i] = blocks[at].ptr
                    at += 1
                if len(launches) > 1:
                    # Judged before any is enqueued; a lone launch is judged by the driver alone.
                    check_launch(launch.msg.kernel, launch.msg.grid, launch.msg.block, values)
                resolved.append(values)
            for launch, values in zip(launches, resolved, strict=True):
                driver.launch(launch.msg.kernel, launch.msg.grid, launch.msg.block, values, stream)

        self._run(uses, enqueue)


class _Checked:
    """A ``Launch`` whose fields passed the checks: its arguments and its buffer arguments."""

    __slots__ = ("args", "buffers", "msg")

    def __init__(self, msg: Launch, args: list[Any], buffers: list[tuple[int, BufferArg]]) -> None:
        self.msg, self.args, self.buffers = msg, args, buffers


#: (kernel, the argument types) -> the positions of the buffer arguments, for argument lists that
#: passed :func:`_checked`: what it judges depends on nothing else but the buffers' handles being
#: ``GpuRef``s, which :func:`_checked_fast` checks on every hit. Holds no argument (no handle is
#: kept alive by it); bounded.
_SHAPES: dict[tuple[Kernel, tuple[type, ...]], tuple[int, ...]] = {}


def _checked_fast(msg: Launch) -> _Checked:
    """``_checked(msg, "Launch")``, answered from :data:`_SHAPES` for an argument list of a shape
    already judged (a pipeline sends the same launch every batch)."""
    args = msg.args
    kernel = msg.kernel
    if isinstance(args, (list, tuple)) and isinstance(kernel, Kernel):
        key = (kernel, tuple(map(type, args)))
        at = _SHAPES.get(key)
        if at is not None:
            buffers = [(i, args[i]) for i in at]
            if all(isinstance(b.ref, GpuRef) for _, b in buffers):
                return _Checked(msg, list(args), buffers)
        checked = _checked(msg, "Launch")
        if len(_SHAPES) < 1024:
            _SHAPES[key] = tuple(i for i, _ in checked.buffers)
        return checked
    return _checked(msg, "Launch")


def _checked(msg: Launch, what: str) -> _Checked:
    """``msg``'s fields checked (``what`` names it in errors): a ``Kernel``, one argument per
    parameter, every ``ptr`` parameter an ``In``/``Out``/``InOut`` of a ``GpuRef``."""
    kernel = msg.kernel
    if not isinstance(kernel, Kernel):
        raise InvalidRequest(f"{what}.kernel must be a Kernel, got {type(kernel).__name__}")
    if not isinstance(msg.args, (list, tuple)):
        raise InvalidRequest(f"{what}.args must be a list or tuple, got {type(msg.args).__name__}")
    args = list(msg.args)
    if len(args) != len(kernel.params):
        raise InvalidRequest(
            f"{what}.args: kernel {kernel.name} takes {len(kernel.params)} arguments {kernel.params}, got {len(args)}"
        )
    buffers: list[tuple[int, BufferArg]] = []
    for i, (arg, kind) in enumerate(zip(args, kernel.params, strict=False)):
        if isinstance(arg, GpuRef):
            raise InvalidRequest(
                f"{what}.args[{i}] of kernel {kernel.name}: wrap a GpuRef as In(ref), Out(ref) or InOut(ref)"
            )
        if isinstance(arg, BufferArg):
            if kind != "ptr":
                raise InvalidRequest(f"{what}.args[{i}] of kernel {kernel.name} is a {kind} scalar, got a buffer")
            if not isinstance(arg.ref, GpuRef):
                raise InvalidRequest(
                    f"{what}.args[{i}] of kernel {kernel.name}: In/Out/InOut wrap a GpuRef, "
                    f"got {type(arg.ref).__name__}"
                )
            buffers.append((i, arg))
        elif kind == "ptr":
            raise InvalidRequest(f"{what}.args[{i}] of kernel {kernel.name} is a buffer; pass In/Out/InOut(ref)")
    return _Checked(msg, args, buffers)
