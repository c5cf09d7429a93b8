"""Graphs: a fixed sequence of device steps recorded once and launched (replayed) many times.

A graph is what a driver makes of a list of steps (:data:`GraphStep`): copies between pinned host
memory and the device, device-to-device copies, fills and kernel launches, with raw pointers, as
the driver's other calls take them. Each launch runs the steps in their order, as if they had been
enqueued one by one on the launch stream: a step starts after the one before it ends, and the
launch as a whole is ordered on its stream like any other work (after what was enqueued before it,
before what is enqueued after it). Launches of one graph never overlap each other.

A graph may also be recorded as several *lanes*: consecutive runs of its steps (``lanes`` gives
their lengths), each a chain of its own, with no order between the lanes. On the device the lanes
of one launch may run at the same time (independent work, such as several batches of a pipeline
on different buffers, overlaps inside one launch); the launch as a whole is still ordered on its
stream. Running the steps in their listed order is one valid schedule of the lanes, which is what
the host driver does. The caller keeps the lanes independent: no lane may write memory another
lane reads or writes.

A step can be replaced between launches by one of the same shape (:func:`same_shape`): the same
kind, the same byte count, the same kernel and dimensions; its pointers and scalars may differ.
Launches already enqueued keep the steps they were launched with. What a step reads or writes on
the host must be page-locked (``Driver.alloc_pinned``), as for any asynchronous copy, and must stay
put until every launch that uses it ran: the graph keeps the views of its current steps
referenced, and a replaced view until the launches before the replacement ran.

On CUDA a graph is a ``CUgraphExec`` of explicit nodes, one per step, each depending on the one
before it in its lane (:mod:`.cuda.graph`); a launch is one ``cuGraphLaunch``, and a replaced step one
``cuGraphExec*NodeSetParams``. The host driver replays the steps through its own calls, in order
(:class:`SteppedGraph`), which is exactly the order a CUDA graph's chain of nodes gives. A graph
belongs to the context it was recorded in: after that context is rebuilt (or its driver closed),
``launch`` and ``update`` raise ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``), as a stream of it
does.

Thread rule: a graph may be launched from any thread; ``launch``, ``update`` and ``close`` of one
graph are serialized by its own lock.

Why one module, longer than 400 lines: the step types, their checks, the ``Graph`` protocol and
the host driver's reference graph are one contract, which each driver's graph is read against.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from ..errors import DriverError, InvalidRequest
from .kernel import Kernel


class _StepCalls(Protocol):
    """The driver calls :class:`SteppedGraph` replays its steps through: a subset of
    ``Driver``'s (named here so that this module does not import the protocol module, which
    imports it)."""

    def copy_to_device(self, ptr: int, data: Any, stream: Any) -> None:
        """As ``Driver.copy_to_device``."""

    def copy_to_host_into(self, ptr: int, out: Any, stream: Any) -> None:
        """As ``Driver.copy_to_host_into``."""

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """As ``Driver.copy_device_to_device``."""

    def fill(self, ptr: int, byte: int, nbytes: int, stream: Any) -> None:
        """As ``Driver.fill``."""

    def launch(self, kernel: Kernel, grid: Any, block: Any, args: Sequence[object], stream: Any) -> None:
        """As ``Driver.launch``."""

__all__ = [
    "DeviceToDevice",
    "DeviceToHost",
    "Graph",
    "GraphStep",
    "HostToDevice",
    "KernelStep",
    "Memset",
    "SteppedGraph",
    "check_lanes",
    "check_steps",
    "host_step",
    "same_shape",
]


@dataclass(frozen=True, slots=True)
class HostToDevice:
    """Copy all of ``src`` (a byte view of pinned host memory) to the device address ``dst``."""

    dst: int
    src: memoryview

    @property
    def nbytes(self) -> int:
        """The bytes copied: the view's length."""
        return len(self.src)


@dataclass(frozen=True, slots=True)
class DeviceToHost:
    """Copy ``len(dst)`` bytes from the device address ``src`` into ``dst`` (a writable byte
    view of pinned host memory)."""

    dst: memoryview
    src: int

    @property
    def nbytes(self) -> int:
        """The bytes copied: the view's length."""
        return len(self.dst)


@dataclass(frozen=True, slots=True)
class DeviceToDevice:
    """Copy ``nbytes`` from the device address ``src`` to ``dst`` (same device)."""

    dst: int
    src: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Memset:
    """Set ``nbytes`` bytes at the device address ``dst`` to ``byte`` (0..255)."""

    dst: int
    byte: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class KernelStep:
    """Launch ``kernel`` with resolved arguments (pointers as ints, scalars), as ``Driver.launch``
    takes them; ``grid`` and ``block`` are three positive ints each."""

    kernel: Kernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[object, ...]


GraphStep: TypeAlias = HostToDevice | DeviceToHost | DeviceToDevice | Memset | KernelStep
"""One step of a graph."""


def same_shape(old: GraphStep, new: GraphStep) -> str | None:
    """Why ``new`` cannot replace ``old`` in a recorded graph, or None when it can.

    Args:
        old: the recorded step.
        new: its replacement.
    Returns:
        None, or a sentence naming what differs (the kind, the byte count, the kernel or its
        dimensions).
    Thread rule: any thread.
    """
    if type(new) is not type(old):
        return f"a {type(new).__name__} cannot replace a {type(old).__name__}"
    if isinstance(old, KernelStep):
        assert isinstance(new, KernelStep)
        if new.kernel is not old.kernel:
            return f"kernel {new.kernel.name} cannot replace kernel {old.kernel.name}"
        if new.grid != old.grid or new.block != old.block:
            return (f"dimensions grid={new.grid} block={new.block} differ from the recorded "
                    f"grid={old.grid} block={old.block}")
        if len(new.args) != len(old.args):
            return f"{len(new.args)} arguments differ from the recorded {len(old.args)}"
        return None
    assert not isinstance(old, KernelStep) and not isinstance(new, KernelStep)
    nbytes_new = new.nbytes
    nbytes_old = old.nbytes
    if nbytes_new != nbytes_old:
        return f"{nbytes_new} bytes differ from the recorded {nbytes_old}"
    return None


def host_step(steps: Sequence[GraphStep], index: int, view: memoryview) -> HostToDevice | DeviceToHost:
    """Step ``index`` of ``steps`` with its host side replaced by ``view``; else
    ``InvalidRequest`` (no such step, no host copy, a view of another length or shape, a
    read-only view to copy into).

    Args:
        steps: the graph's steps.
        index: the step.
        view: the new host side.
    Returns:
        the new step.
    Raises:
        InvalidRequest: as above.
    Thread rule: any thread.
    """
    if type(index) is not int or not 0 <= index < len(steps):
        raise InvalidRequest(f"graph step index {index!r} out of range 0..{len(steps) - 1}")
    old = steps[index]
    if not isinstance(old, (HostToDevice, DeviceToHost)):
        raise InvalidRequest(f"graph step {index} is a {type(old).__name__}, not a copy to or from the host")
    if type(view) is not memoryview or view.format != "B" or view.ndim != 1 or not view.c_contiguous:
        raise InvalidRequest(f"graph step {index}: the host side must be a 1-D byte memoryview, got {view!r}")
    if len(view) != old.nbytes:
        raise InvalidRequest(f"graph step {index}: {len(view)} bytes differ from the recorded {old.nbytes}")
    if isinstance(old, HostToDevice):
        return HostToDevice(old.dst, view)
    if view.readonly:
        raise InvalidRequest(f"graph step {index}: the host view to copy into is read-only")
    return DeviceToHost(view, old.src)


def check_lanes(lanes: Sequence[int] | None, nsteps: int) -> tuple[int, ...]:
    """The lane lengths of a graph of ``nsteps`` steps: ``lanes`` as a tuple, or one lane of
    every step when None.

    Args:
        lanes: each lane's number of steps, in order; they sum to ``nsteps``.
        nsteps: how many steps the graph has.
    Returns:
        the lengths, as a tuple of positive ints.
    Raises:
        InvalidRequest: ``lanes`` is not a non-empty list of positive ints summing to ``nsteps``.
    Thread rule: any thread.
    """
    if lanes is None:
        return (nsteps,)
    if (not isinstance(lanes, (list, tuple)) or not lanes
            or not all(type(n) is int and n > 0 for n in lanes) or sum(lanes) != nsteps):
        raise InvalidRequest(f"a graph's lanes must be positive step counts summing to its {nsteps} steps, "
                             f"got {lanes!r}")
    return tuple(lanes)


def check_steps(steps: Sequence[object]) -> tuple[GraphStep, ...]:
    """``steps`` as a tuple once each is a :data:`GraphStep` with sane fields; else
    ``InvalidRequest`` naming the first one at fault.

    Args:
        steps: the steps to record, at least one.
    Returns:
        the steps, as a tuple.
    Raises:
        InvalidRequest: no steps, a step of another type, a host view that is not a C-contiguous
            byte view (or a read-only one to copy into), a negative or zero byte count, a fill
            byte out of 0..255, dimensions that are not three positive ints.
    Thread rule: any thread.
    """
    if not isinstance(steps, (list, tuple)) or not steps:
        raise InvalidRequest(f"a graph needs a non-empty list of steps, got {steps!r}")
    out: list[GraphStep] = []
    for i, step in enumerate(steps):
        what = f"graph step {i}"
        if isinstance(step, (HostToDevice, DeviceToHost)):
            view = step.src if isinstance(step, HostToDevice) else step.dst
            if not isinstance(view, memoryview) or view.format != "B" or not view.c_contiguous or view.ndim != 1:
                raise InvalidRequest(f"{what}: the host side must be a 1-D byte memoryview, got {view!r}")
            if isinstance(step, DeviceToHost) and view.readonly:
                raise InvalidRequest(f"{what}: the host view to copy into is read-only")
            if len(view) == 0:
                raise InvalidRequest(f"{what}: copies no bytes")
        elif isinstance(step, (DeviceToDevice, Memset)):
            if type(step.nbytes) is not int or step.nbytes <= 0:
                raise InvalidRequest(f"{what}: nbytes must be a positive int, got {step.nbytes!r}")
            if isinstance(step, Memset) and (type(step.byte) is not int or not 0 <= step.byte <= 255):
                raise InvalidRequest(f"{what}: byte must be an int in 0..255, got {step.byte!r}")
        elif isinstance(step, KernelStep):
            for name, dims in (("grid", step.grid), ("block", step.block)):
                if (not isinstance(dims, tuple) or len(dims) != 3
                        or not all(type(d) is int and d > 0 for d in dims)):
                    raise InvalidRequest(f"{what}: {name} must be three positive ints, got {dims!r}")
        else:
            raise InvalidRequest(f"{what}: expected a graph step (HostToDevice, DeviceToHost, DeviceToDevice, "
                                 f"Memset or KernelStep), got {type(step).__name__}")
        out.append(step)
    return tuple(out)


@runtime_checkable
class Graph(Protocol):
    """A recorded graph of one device (see the module docstring)."""

    @property
    def ordinal(self) -> int:
        """The device the graph was recorded on. Thread rule: any thread."""
        ...

    @property
    def steps(self) -> tuple[GraphStep, ...]:
        """The steps the next launch runs. Thread rule: any thread."""
        ...

    @property
    def lanes(self) -> tuple[int, ...]:
        """Each lane's number of steps, in order (one lane of every step unless recorded with
        lanes). Thread rule: any thread."""
        ...

    def launch(self, stream: Any) -> None:
        """Enqueue one run of every step, in order, on ``stream`` (a stream of the graph's device).

        Raises:
            InvalidRequest: ``stream`` is not a stream of this driver and device.
            DriverError: the graph was closed, or its context rebuilt (``CUDA_ERROR_INVALID_HANDLE``);
                the stream's own errors.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        ...

    def update(self, index: int, step: GraphStep, *, checked: bool = False) -> None:
        """Replace step ``index`` for the launches after this call. ``checked``: the caller made
        ``step`` from parts it checked (:func:`check_steps` is skipped; the shape and, on CUDA,
        the pinned memory are still checked).

        Raises:
            InvalidRequest: ``index`` out of range, or ``step`` not of the recorded one's shape
                (:func:`same_shape`); nothing changes.
            DriverError: closed, or its context rebuilt.
        Thread rule: any thread.
        """
        ...

    def update_host(self, index: int, view: memoryview) -> None:
        """Replace the host side of copy step ``index`` (a ``HostToDevice``'s source or a
        ``DeviceToHost``'s destination) with ``view``, a byte view of pinned memory of the same
        length: the cheap update of a graph whose batches differ by their host buffers.

        Raises:
            InvalidRequest: step ``index`` is no host copy, ``view`` is no 1-D byte view of the
                step's length (writable, for a copy to the host), or not of pinned memory;
                nothing changes.
            DriverError: closed, or its context rebuilt.
        Thread rule: any thread.
        """
        ...

    def swap_host(self, index: int, view: memoryview) -> object | None:
        """As :meth:`update_host`, but the view it replaced is handed back instead of kept: the
        caller keeps it until the launches enqueued before this call ran (the graph's owner
        knows when, from the completions it records, and spares the graph an event of its own).

        Returns:
            the replaced host view, or None when ``view`` is the one the step has (or the
            graph's launches keep their views themselves).
        Raises:
            as :meth:`update_host`.
        Thread rule: any thread.
        """
        ...

    def fast_host(self, index: int, view: memoryview) -> tuple[Any, int] | None:
        """What the compiled replay (``ReplayCore.bind_host``) needs to bind ``view`` to copy
        step ``index`` without a Python call: the step's node and ``view``'s address, when the
        graph checked ``view`` for that step before (it was swapped in or recorded); None when
        it did not, or when the graph has no such path (the host driver's). The caller keeps the
        answer only as long as it keeps ``view``.
        Thread rule: any thread.
        """
        ...

    def close(self, keep: Sequence[object] = ()) -> None:
        """Release the graph (launches already enqueued still run). Idempotent; never raises.

        Args:
            keep: objects (host views handed back by :meth:`swap_host`) to keep until the
                launches already enqueued ran.
        Thread rule: any thread."""
        ...


class SteppedGraph:
    """A graph that replays its steps through its driver's own calls, one by one, on the launch
    stream: the host driver's graph (its calls are the lowest layer there), and the reference
    behaviour every driver's graph has.

    Host views stay referenced by the driver's copies themselves until they ran, so a replaced
    view needs no keeping here.

    Thread rule: any thread; one lock serializes launch, update and close.
    """

    def __init__(self, driver: _StepCalls, ordinal: int, steps: Sequence[GraphStep], epoch: Callable[[], int],
                 pinned: Callable[[memoryview], bool] | None = None, lanes: tuple[int, ...] | None = None) -> None:
        """Args:
            driver: the driver whose calls replay the steps.
            ordinal: the device.
            steps: checked steps (:func:`check_steps`), replayed in this order whatever the
                lanes (one valid schedule of them).
            lanes: checked lane lengths (:func:`check_lanes`); None for one lane.
            epoch: reads the device context's epoch now; a launch or update runs only while it
                reads what it read at recording.
            pinned: whether a host view lies in the driver's pinned memory (None: not checked).
        Thread rule: any thread.
        """
        self._pinned = pinned
        self._driver = driver
        self._ordinal = ordinal
        self._steps = list(steps)
        self._lanes = lanes if lanes is not None else (len(self._steps),)
        self._epoch_now = epoch
        self._epoch = epoch()
        self._closed = False
        self._lock = threading.Lock()

    @property
    def ordinal(self) -> int:
        """The device the graph was recorded on. Thread rule: any thread."""
        return self._ordinal

    @property
    def steps(self) -> tuple[GraphStep, ...]:
        """The steps the next launch runs. Thread rule: any thread."""
        return tuple(self._steps)

    @property
    def lanes(self) -> tuple[int, ...]:
        """Each lane's number of steps (see :class:`Graph`). Thread rule: any thread."""
        return self._lanes

    def _check_open(self) -> None:
        if self._closed:
            raise DriverError(f"device {self._ordinal}: the graph was closed", code="CUDA_ERROR_INVALID_HANDLE")
        if self._epoch_now() != self._epoch:
            raise DriverError(
                f"device {self._ordinal}: the graph belongs to a destroyed context (context rebuilt)",
                code="CUDA_ERROR_INVALID_HANDLE",
            )

    def launch(self, stream: Any) -> None:
        """Enqueue every step on ``stream`` (a stream of the driver) in order (see
        :meth:`Graph.launch`)."""
        driver = self._driver
        with self._lock:
            self._check_open()
            for step in self._steps:
                if isinstance(step, HostToDevice):
                    driver.copy_to_device(step.dst, step.src, stream)
                elif isinstance(step, KernelStep):
                    driver.launch(step.kernel, step.grid, step.block, step.args, stream)
                elif isinstance(step, DeviceToHost):
                    driver.copy_to_host_into(step.src, step.dst, stream)
                elif isinstance(step, DeviceToDevice):
                    driver.copy_device_to_device(step.dst, step.src, step.nbytes, stream)
                else:
                    driver.fill(step.dst, step.byte, step.nbytes, stream)

    def update(self, index: int, step: GraphStep, *, checked: bool = False) -> None:
        """Replace step ``index`` (see :meth:`Graph.update`)."""
        with self._lock:
            self._check_open()
            if type(index) is not int or not 0 <= index < len(self._steps):
                raise InvalidRequest(f"graph step index {index!r} out of range 0..{len(self._steps) - 1}")
            if not checked:
                check_steps([step])
            why = same_shape(self._steps[index], step)
            if why is not None:
                raise InvalidRequest(f"graph step {index}: {why}")
            self._steps[index] = step

    def update_host(self, index: int, view: memoryview) -> None:
        """Replace the host side of copy step ``index`` (see :meth:`Graph.update_host`)."""
        with self._lock:
            self._check_open()
            step = host_step(self._steps, index, view)
            if self._pinned is not None and not self._pinned(view):
                raise InvalidRequest(f"graph step {index}: the host view is not of pinned memory (alloc_pinned)")
            self._steps[index] = step

    def fast_host(self, index: int, view: memoryview) -> tuple[Any, int] | None:
        """None: the host driver's graph has no compiled rebinding."""
        return None

    def swap_host(self, index: int, view: memoryview) -> object | None:
        """As :meth:`update_host`; None (the driver's copies keep their views themselves)."""
        self.update_host(index, view)
        return None

    def close(self, keep: Sequence[object] = ()) -> None:
        """Forget the steps (``keep`` is not needed: see the class docstring). Idempotent;
        never raises."""
        with self._lock:
            self._closed = True
