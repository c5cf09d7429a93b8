"""The stages of a :class:`~.batch_graph.BatchGraph` as operands and as driver steps.

A stage is the library message that would do it (``CopyToDevice``, ``CopyToHost``,
``CopyDeviceToDevice``, ``Fill``, ``Launch``); its *operands* are the ``GpuRef``s and
``PinnedBuffer``s it names, in a fixed order, each with how the stage uses it. A graph is recorded
from the driver steps (:mod:`..driver.graph`) the stages make with their operands bound, and a
binding rebuilds the steps that name the operand it replaces. Checks here raise
``InvalidRequest`` naming the stage and field (or the binding), or ``GpuRefStale``.

Thread rule: pure functions and immutable records; any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from ..driver.graph import DeviceToDevice, DeviceToHost, GraphStep, HostToDevice, KernelStep, Memset
from ..errors import GpuRefStale, InvalidRequest
from ..memory.block import Access, DeviceBlock
from ..memory.pinned import PinnedBuffer
from .device_context import DeviceContext
from .gpu_ref import GpuRef
from .kernel_actor import _checked
from .library_messages import CopyDeviceToDevice, CopyToDevice, CopyToHost, Fill, Launch

__all__ = ["Operand", "Slot", "Stage", "Views", "check_operand", "host_bytes", "identity", "operands", "step", "view"]

Stage: TypeAlias = CopyToDevice | CopyToHost | CopyDeviceToDevice | Fill | Launch
"""A stage of a batch: the library message that would do it (see :meth:`BatchGraph.record`)."""

Operand: TypeAlias = GpuRef | PinnedBuffer

@dataclass(slots=True)
class Slot:
    """One operand of one stage: where it sits and what it was recorded as (what it is bound to
    now is in ``BatchGraph._bound``)."""

    stage: int
    recorded: Operand
    access: Access | None  # a GpuRef's access; None for a host buffer
    host_writes: bool = False  # a host buffer the stage copies into
    lane: int = 0  # the lane of the stage (set by the graph)

    @property
    def writes(self) -> bool:
        """Whether the stage writes the operand."""
        return self.access.writes if self.access is not None else self.host_writes


def identity(operand: Operand) -> int:
    """What two operands share when they name the same memory: a handle's block address, a
    pinned buffer's identity (two buffers never share memory).
    Thread rule: any thread.
    """
    if isinstance(operand, GpuRef):
        return operand.block.ptr
    return id(operand)


def operands(i: int, stage: object, ctx: DeviceContext) -> list[Slot]:
    """The operands of stage ``i`` in a fixed order, checked for type; else ``InvalidRequest``.
    Thread rule: any thread.
    """
    what = f"BatchGraph stage {i}"
    if isinstance(stage, CopyToDevice):
        _need(stage.ref, GpuRef, f"{what} (CopyToDevice.ref)")
        _need(stage.data, PinnedBuffer, f"{what} (CopyToDevice.data: pinned required, from AllocatePinned)")
        data = cast(PinnedBuffer, stage.data)
        if data.nbytes > stage.ref.nbytes:
            raise InvalidRequest(f"{what} (CopyToDevice.data): {data.nbytes} bytes do not fit in {stage.ref!r}")
        return [Slot(i, stage.ref, Access.WRITE), Slot(i, data, None)]
    if isinstance(stage, CopyToHost):
        _need(stage.ref, GpuRef, f"{what} (CopyToHost.ref)")
        _need(stage.out, PinnedBuffer, f"{what} (CopyToHost.out: pinned required, from AllocatePinned)")
        out = cast(PinnedBuffer, stage.out)
        nbytes = stage.ref.nbytes if stage.nbytes is None else stage.nbytes
        most = min(stage.ref.nbytes, out.nbytes)
        if type(nbytes) is not int or not 0 < nbytes <= most:
            raise InvalidRequest(f"{what} (CopyToHost.nbytes): expected an int in 1..{most}, got {stage.nbytes!r}")
        return [Slot(i, stage.ref, Access.READ), Slot(i, out, None, host_writes=True)]
    if isinstance(stage, CopyDeviceToDevice):
        _need(stage.src, GpuRef, f"{what} (CopyDeviceToDevice.src)")
        _need(stage.dst, GpuRef, f"{what} (CopyDeviceToDevice.dst)")
        if stage.src is stage.dst:
            raise InvalidRequest(f"{what} (CopyDeviceToDevice.dst): source and destination are the same handle")
        if stage.src.nbytes > stage.dst.nbytes:
            raise InvalidRequest(f"{what} (CopyDeviceToDevice.src): {stage.src!r} does not fit in {stage.dst!r}")
        return [Slot(i, stage.src, Access.READ), Slot(i, stage.dst, Access.WRITE)]
    if isinstance(stage, Fill):
        _need(stage.ref, GpuRef, f"{what} (Fill.ref)")
        if type(stage.byte) is not int or not 0 <= stage.byte <= 255:
            raise InvalidRequest(f"{what} (Fill.byte): expected an int in 0..255, got {stage.byte!r}")
        return [Slot(i, stage.ref, Access.WRITE)]
    if isinstance(stage, Launch):
        checked = _checked(stage, what)
        return [Slot(i, arg.ref, arg.access) for _, arg in checked.buffers]
    raise InvalidRequest(f"{what}: expected CopyToDevice, CopyToHost, CopyDeviceToDevice, Fill or Launch, "
                         f"got {type(stage).__name__}")


def _need(value: object, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise InvalidRequest(f"{what}: expected a {kind.__name__}, got {type(value).__name__}")


def check_operand(new: object, recorded: Operand, ctx: DeviceContext, stage: int | None) -> None:
    """``new`` may stand where ``recorded`` was recorded: same kind, device, generation, size.
    ``stage``: the stage being recorded, or None for a binding (named in the error).
    Thread rule: any thread.
    """
    if isinstance(recorded, GpuRef):
        if type(new) is not GpuRef and not isinstance(new, GpuRef):
            raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: expected a GpuRef, got {type(new).__name__}")
        block = new.access()  # stale or released: GpuRefStale
        if block.device_ordinal != ctx.ordinal:
            raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: {new!r} is of device {block.device_ordinal}, "
                                 f"the graph of device {ctx.ordinal}")
        if new.context is not ctx:
            raise GpuRefStale("context rebuilt", f"BatchGraph {_what(stage, recorded)}: {new!r} is of generation "
                              f"{new.generation}, the graph of generation {ctx.generation}")
        if new.nbytes != recorded.nbytes:
            raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: {new!r} holds {new.nbytes} bytes, the "
                                 f"recorded handle {recorded.nbytes}: a graph's operands keep their sizes")
        return
    if not isinstance(new, PinnedBuffer):
        raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: expected a PinnedBuffer, got {type(new).__name__}")
    if new.released:
        raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: {new!r} was released")
    if new.driver is not ctx.driver or new.device_ordinal != ctx.ordinal:
        raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: {new!r} is a pinned buffer of device "
                             f"{new.device_ordinal} of a {new.driver.kind} driver, the graph of device {ctx.ordinal} "
                             f"({ctx.driver.kind} driver)")
    if new.nbytes != recorded.nbytes:
        raise InvalidRequest(f"BatchGraph {_what(stage, recorded)}: {new!r} holds {new.nbytes} bytes, the recorded "
                             f"buffer {recorded.nbytes}: a graph's operands keep their sizes")


def _what(stage: int | None, recorded: Operand) -> str:
    """How an error names the operand: by its stage while recording, by its key in a binding."""
    return f"stage {stage}" if stage is not None else f"bind[{recorded!r}]"


Views: TypeAlias = dict[tuple[int, int], tuple[PinnedBuffer, memoryview]]


def view(buf: PinnedBuffer, nbytes: int, views: Views) -> memoryview:
    """The byte view of ``buf``'s first ``nbytes``, made once per buffer and length and kept
    (with the buffer) in ``views``: a step bound to the same buffer again gets the same view,
    which the driver's graph recognizes as no change.
    Thread rule: any thread.
    """
    key = (id(buf), nbytes)
    hit = views.get(key)
    if hit is not None and hit[0] is buf:
        return hit[1]
    view = buf.view()
    if nbytes != len(view):
        view = view[:nbytes]
    if len(views) > 256:  # a graph bound to ever new buffers: keep the cache bounded
        views.clear()
    views[key] = (buf, view)
    return view


def step(stage: Stage, bound: Mapping[int, Operand], views: Views) -> GraphStep:
    """The driver step of ``stage`` with its operands as ``bound`` maps them (by the recorded
    operand's id).
    Thread rule: any thread.
    """

    def ref(r: GpuRef) -> DeviceBlock:
        return cast(GpuRef, bound[id(r)]).block

    if isinstance(stage, CopyToDevice):
        data = cast(PinnedBuffer, bound[id(stage.data)])
        return HostToDevice(ref(stage.ref).ptr, view(data, data.nbytes, views))
    if isinstance(stage, CopyToHost):
        return DeviceToHost(view(cast(PinnedBuffer, bound[id(stage.out)]), host_bytes(stage), views),
                            ref(stage.ref).ptr)
    if isinstance(stage, CopyDeviceToDevice):
        return DeviceToDevice(ref(stage.dst).ptr, ref(stage.src).ptr, stage.src.nbytes)
    if isinstance(stage, Fill):
        block = ref(stage.ref)
        return Memset(block.ptr, stage.byte, block.nbytes)
    checked = _checked(stage, "BatchGraph stage")
    args = list(checked.args)
    for i, arg in checked.buffers:
        args[i] = ref(arg.ref).ptr
    return KernelStep(stage.kernel, _dims(stage.grid), _dims(stage.block), tuple(args))


def host_bytes(stage: CopyToHost) -> int:
    """The bytes a ``CopyToHost`` stage copies.
    Thread rule: any thread.
    """
    return stage.ref.nbytes if stage.nbytes is None else stage.nbytes


def _dims(d: Any) -> tuple[int, int, int]:
    """An int or up to three ints as three (missing ones 1); ``check_steps`` judges the values."""
    if isinstance(d, int):
        return (d, 1, 1)
    t = tuple(d)
    return cast(tuple[int, int, int], t + (1,) * (3 - len(t)))
