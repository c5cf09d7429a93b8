"""``CudaGraph``: a list of steps (:mod:`..graph`) recorded as a ``CUgraphExec`` of explicit nodes.

Why explicit nodes and not stream capture: each step's node handle is known when it is added, so
a replaced step is one ``cuGraphExec*NodeSetParams`` on that node, with no search of the graph
for which captured node was which. Each node depends on the one before it in its lane: a chain per
lane, which is the order the lane's steps would have on one stream, and no edge between lanes, so
the lanes of one launch may run at the same time. cuda.core's graph builder captures streams and updates
whole graphs (``cuGraphExecUpdate``), not single nodes, so the nodes are made through
``cuda.bindings`` here.

A host copy of at most ``KERNEL_COPY_MAX`` bytes is a copy-kernel node rather than a memcpy
node (:mod:`.graph_copies` says why: the launch costs the CPU about a third as much per node):
the step is the same ``HostToDevice``/``DeviceToHost`` to every caller, only its node differs.

The hot calls keep the GIL (see :mod:`.held`): ``cuGraphLaunch`` only enqueues, and a memcpy
node's update takes the node's ``CUDA_MEMCPY3D`` by address, kept per node and changed in place
(its host or device address), so an update builds no new struct; a copy kernel's update writes
the new address into the node's own argument slot (``CopyArgs``) and sets the kernel node's
parameters the same way. The rest (recording, kernel and memset updates, destruction) goes
through cuda.bindings.

Lifetime: a graph belongs to its device's epoch. A launch takes the launch stream's gate and
checks, under it, that the stream and the graph are of the current epoch, so a rebuild either
waits for the launch to be enqueued (and then synchronizes the context before it frees anything)
or the launch is refused. ``close`` destroys the exec and the graph while the context they were
made in still exists (the same incarnation); after a reset from outside the handles would dangle,
so they are left to the driver (a few KiB). The host views of the current steps are held by the
graph; a view replaced by ``update`` is handed to the last launch stream to keep until the
launches before the replacement ran.

Why one module, longer than 400 lines: recording, the update paths (a whole step, a host side, a
host side handed back, the compiled core's rebinding by address) and close all act on the same
node records, whose invariants are only checkable read together.

Thread rule: any thread; one lock per graph serializes launch, update and close.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ...errors import DriverError, InvalidRequest, XlogError
from ..graph import (
    DeviceToDevice,
    DeviceToHost,
    GraphStep,
    HostToDevice,
    KernelStep,
    Memset,
    check_steps,
    host_step,
    same_shape,
)
from .call import SUCCESS, cu
from .graph_copies import KERNEL_COPY_MAX, CopyArgs, copy_grid
from .held import as_result
from .memory import _address

if TYPE_CHECKING:
    from .context import CudaDevice
    from .streams import CudaStream

__all__ = ["CudaGraph"]

_HOST = None if cu is None else cu.CUmemorytype.CU_MEMORYTYPE_HOST
_DEVICE = None if cu is None else cu.CUmemorytype.CU_MEMORYTYPE_DEVICE


#: The call that sets a host copy node's parameters: [a copy kernel's, a memcpy node's].
_SET_CALL = ("cuGraphExecKernelNodeSetParams(xlog_graph_copy)", "cuGraphExecMemcpyNodeSetParams")

#: Where ``srcHost`` and ``dstHost`` lie in a ``CUDA_MEMCPY3D`` (cuda.h's layout, stable since
#: CUDA 3.2: four size_t, the memory type and its padding, then the host pointer; the destination
#: half repeats the source's eleven fields after them). Checked against the struct per node.
_SRC_HOST_AT, _DST_HOST_AT = 40, 128


def _dst_src(addresses: tuple[int, int, int, int]) -> tuple[int, int]:
    """A copy's (dst, src) from its (srcHost, srcDevice, dstHost, dstDevice): the side it has of
    each, what a copy kernel takes."""
    return addresses[3] or addresses[2], addresses[0] or addresses[1]


def _kernel_node(fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], params: int) -> Any:
    """A kernel node's parameters: ``fn`` on ``grid`` x ``block``, no shared memory, its
    arguments' pointer array at ``params``."""
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = fn
    p.gridDimX, p.gridDimY, p.gridDimZ = grid
    p.blockDimX, p.blockDimY, p.blockDimZ = block
    p.sharedMemBytes = 0
    p.kernelParams = params
    return p


class _Node:
    """One step's node, its parameters as the driver last took them (and, for a copy, the
    addresses in them as ints), and what they keep alive.

    ``step`` is the step as recorded or last updated; a host copy's current host view is
    ``keep`` (a rebinding changes only it, see ``CudaGraph.swap_host``). ``host`` is the
    ``CUDA_MEMCPY3D``'s host pointer field of a host copy, as a ``c_uint64`` over the struct's
    own memory (None where the layout check failed: the cuda.bindings setters are used then)."""

    __slots__ = ("addresses", "args", "host", "host_at", "keep", "node", "node_h", "params", "params_h", "src",
                 "step")

    def __init__(self, step: GraphStep, node: Any, params: Any, keep: object, args: CopyArgs | None = None) -> None:
        self.step, self.node, self.params, self.keep = step, node, params, keep
        self.node_h = int(node)
        #: a host copy made a copy-kernel node: its argument memory (None: a memcpy node or
        #: another step); its ``params`` are then the kernel node's
        self.args = args
        #: a copy from the host (its source is the host side)
        self.src = isinstance(step, HostToDevice)
        self.host: ctypes.c_uint64 | None = None
        #: the host field's address (0: none), for the compiled core's rebinding
        self.host_at = 0
        if args is not None:
            self.params_h = params.getPtr()
            dst, src = int(args.slots[0]), int(args.slots[1])
            self.addresses = (src, 0, 0, dst) if self.src else (0, src, dst, 0)
            self.host_at = args.at(1 if self.src else 0)
            self.host = ctypes.c_uint64.from_address(self.host_at)
            return
        self.params_h = params.getPtr() if isinstance(params, cu.CUDA_MEMCPY3D) else 0
        #: (srcHost, srcDevice, dstHost, dstDevice) of a copy node
        self.addresses = (
            (int(params.srcHost), int(params.srcDevice), int(params.dstHost), int(params.dstDevice))
            if self.params_h else (0, 0, 0, 0)
        )
        if isinstance(step, (HostToDevice, DeviceToHost)):
            at, want = (_SRC_HOST_AT, self.addresses[0]) if self.src else (_DST_HOST_AT, self.addresses[2])
            cell = ctypes.c_uint64.from_address(self.params_h + at)
            if want and cell.value == want:
                self.host, self.host_at = cell, self.params_h + at

    def current(self) -> GraphStep:
        """The step with its current host view."""
        step, keep = self.step, self.keep
        if isinstance(step, HostToDevice) and step.src is not keep:
            return HostToDevice(step.dst, cast(memoryview, keep))
        if isinstance(step, DeviceToHost) and step.dst is not keep:
            return DeviceToHost(cast(memoryview, keep), step.src)
        return step


class CudaGraph:
    """A recorded graph of one :class:`~.context.CudaDevice` (see the module docstring and
    :class:`~xlog_actors.driver.graph.Graph` for the contract).

    Thread rule: any thread; ``_lock`` serializes launch, update and close.
    """

    def __init__(self, dev: CudaDevice, steps: Sequence[GraphStep], functions: Sequence[Any],
                 pack: Any, is_pinned: Any, lanes: tuple[int, ...] | None = None, copy_fn: Any = None) -> None:
        """Record ``steps`` (checked) on ``dev``, current in the calling thread.

        Args:
            dev: the device, entered by the caller.
            steps: the checked steps.
            lanes: the checked lane lengths; each lane's first node depends on nothing, the
                others on the node before them. None: one lane.
            functions: each ``KernelStep``'s ``CUfunction`` (in order of the kernel steps).
            pack: ``(kernel, args) -> (slots, params)``, the driver's argument packer.
            is_pinned: ``(address, nbytes) -> bool``, the driver's pinned-memory test.
            copy_fn: the copy kernel's ``CUfunction`` (:mod:`.graph_copies`): host copies of at
                most ``KERNEL_COPY_MAX`` bytes become its nodes. None: every copy a memcpy node.
        Raises:
            InvalidRequest: a host view outside pinned memory.
            DriverError, ContextPoisoned: a node the driver refuses.
        """
        self._dev = dev
        self._epoch = dev.epoch
        self._incarnation = dev.incarnation
        self._pack = pack
        self._is_pinned = is_pinned
        self._lock = threading.Lock()
        self._closed = False
        self._last_stream: CudaStream | None = None
        # Views replaced since the last launch: launches before the replacement may still use
        # them, so the next launch hands them to its stream to keep until it ran (one record for
        # all, instead of one per update).
        self._retired: list[object] = []
        # Host views already found pinned, by identity (each held here, so its memory stays put
        # and pinned while it is a key): a rebound view is then checked once, not per update.
        self._pinned_views: dict[int, tuple[memoryview, int]] = {}
        self._functions = list(functions)
        self._copy_fn = copy_fn
        self._lanes = lanes if lanes is not None else (len(steps),)
        self._nodes: list[_Node] = []
        err, self._graph = cu.cuGraphCreate(0)
        if err != SUCCESS:
            dev.fail(err, "cuGraphCreate")
        self._exec: Any = None
        try:
            fn_at = 0
            prev: list[Any] = []
            starts, at = set(), 0
            for n in self._lanes:
                starts.add(at)
                at += n
            for i, step in enumerate(steps):
                if i in starts:
                    prev = []  # a lane's first node: no order with the lanes before it
                fn = None
                if isinstance(step, KernelStep):
                    fn = self._functions[fn_at]
                    fn_at += 1
                node = self._add(i, step, prev, fn)
                self._nodes.append(node)
                prev = [node.node]
            err, self._exec = cu.cuGraphInstantiate(self._graph, 0)
            if err != SUCCESS:
                self._exec = None
                dev.fail(err, "cuGraphInstantiate")
        except BaseException:
            self._destroy()
            raise
        self._exec_h = int(self._exec)
        self._ctx_h = int(dev.ctx)
        # The epoch's token, as a stream's ``_live``: the compiled core's launch (``CudaOps``)
        # takes its one-call path only while it is the device's current one.
        self._live = dev.epoch_token

    # -- nodes ------------------------------------------------------------------------------------
    def _copy_params(self, i: int, step: HostToDevice | DeviceToHost | DeviceToDevice) -> tuple[Any, object]:
        p = cu.CUDA_MEMCPY3D()
        p.Height = 1
        p.Depth = 1
        p.WidthInBytes = step.nbytes
        addresses, keep = self._sides(i, step)
        p.srcMemoryType = _HOST if addresses[0] else _DEVICE
        p.dstMemoryType = _HOST if addresses[2] else _DEVICE
        p.srcHost, p.srcDevice, p.dstHost, p.dstDevice = addresses
        return p, keep

    def _sides(
        self, i: int, step: HostToDevice | DeviceToHost | DeviceToDevice
    ) -> tuple[tuple[int, int, int, int], object]:
        """``step``'s (srcHost, srcDevice, dstHost, dstDevice), 0 for the sides it has not, and its
        host view (None for a device copy), the view checked to be pinned (``InvalidRequest``)."""
        if isinstance(step, HostToDevice):
            host = _address(step.src)
            self._check_pinned(i, step.src, host)
            return (host, 0, 0, step.dst), step.src
        if isinstance(step, DeviceToHost):
            host = _address(step.dst)
            self._check_pinned(i, step.dst, host)
            return (0, step.src, host, 0), step.dst
        return (0, step.src, 0, step.dst), None

    def _check_pinned(self, i: int, view: memoryview, host: int) -> None:
        """``view`` (at ``host``) lies in pinned memory; else ``InvalidRequest``."""
        known = self._pinned_views.get(id(view))
        if known is not None and known[0] is view:
            return
        if not self._is_pinned(host, len(view)):
            raise InvalidRequest(f"graph step {i}: the host view is not of pinned memory (alloc_pinned)")
        if len(self._pinned_views) >= 256:  # bounded: a graph bound to ever new views
            self._pinned_views.clear()
        self._pinned_views[id(view)] = (view, host)

    def _kernel_params(self, step: KernelStep, fn: Any) -> tuple[Any, object]:
        slots, address = self._pack(step.kernel, step.args)
        return _kernel_node(fn, step.grid, step.block, address), slots

    @staticmethod
    def _memset_params(step: Memset) -> Any:
        p = cu.CUDA_MEMSET_NODE_PARAMS()
        p.dst = step.dst
        p.value = step.byte
        p.elementSize = 1
        p.width = step.nbytes
        p.height = 1
        p.pitch = 0
        return p

    def _add(self, i: int, step: GraphStep, prev: list[Any], fn: Any) -> _Node:
        dev, graph = self._dev, self._graph
        if isinstance(step, KernelStep):
            params, keep = self._kernel_params(step, fn)
            err, node = cu.cuGraphAddKernelNode(graph, prev, len(prev), params)
            what = f"cuGraphAddKernelNode({step.kernel.name})"
        elif isinstance(step, Memset):
            params, keep = self._memset_params(step), None
            err, node = cu.cuGraphAddMemsetNode(graph, prev, len(prev), params, dev.ctx)
            what = f"cuGraphAddMemsetNode({step.nbytes} bytes at {step.dst:#x})"
        elif (isinstance(step, (HostToDevice, DeviceToHost)) and self._copy_fn is not None
              and step.nbytes <= KERNEL_COPY_MAX):
            return self._add_kernel_copy(i, step, prev)
        else:
            params, keep = self._copy_params(i, step)
            err, node = cu.cuGraphAddMemcpyNode(graph, prev, len(prev), params, dev.ctx)
            what = f"cuGraphAddMemcpyNode({type(step).__name__}, {step.nbytes} bytes)"
        if err != SUCCESS:
            dev.fail(err, f"graph step {i}: {what}")
        return _Node(step, node, params, keep)

    def _add_kernel_copy(self, i: int, step: HostToDevice | DeviceToHost, prev: list[Any]) -> _Node:
        """A small host copy as a copy-kernel node (:mod:`.graph_copies`): the host side by its
        address, which the device reaches through the pinned memory's mapping."""
        addresses, view = self._sides(i, step)
        args = CopyArgs(*_dst_src(addresses), step.nbytes)
        p = _kernel_node(self._copy_fn, *copy_grid(step.nbytes), args.params)
        err, node = cu.cuGraphAddKernelNode(self._graph, prev, len(prev), p)
        if err != SUCCESS:
            self._dev.fail(err, f"graph step {i}: cuGraphAddKernelNode(xlog_graph_copy, {step.nbytes} bytes)")
        return _Node(step, node, p, view, args)

    def _set_node(self, node: _Node) -> int:
        """Set ``node``'s kept parameters on the exec, the GIL kept: a held call's code."""
        held = self._dev.held
        if node.args is not None:
            return int(held.graph_kernel_set(self._exec_h, node.node_h, node.params_h))
        return int(held.graph_memcpy_set(self._exec_h, node.node_h, node.params_h, self._ctx_h))

    # -- the protocol -----------------------------------------------------------------------------
    @property
    def ordinal(self) -> int:
        """The device the graph was recorded on. Thread rule: any thread."""
        return self._dev.ordinal

    @property
    def steps(self) -> tuple[GraphStep, ...]:
        """The steps the next launch runs. Thread rule: any thread."""
        return tuple(n.current() for n in self._nodes)

    @property
    def lanes(self) -> tuple[int, ...]:
        """Each lane's number of steps (see ``Graph.lanes``). Thread rule: any thread."""
        return self._lanes

    def _check_open(self) -> CudaDevice:
        dev = self._dev
        if self._closed or self._exec is None:
            raise DriverError(f"device {dev.ordinal}: the graph was closed", code="CUDA_ERROR_INVALID_HANDLE")
        if self._epoch != dev.epoch:
            if dev.poisoned is not None:
                raise dev.poisoned_error()
            raise DriverError(
                f"device {dev.ordinal}: the graph belongs to a destroyed context (context rebuilt)",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        return dev

    def launch(self, s: CudaStream) -> None:
        """``cuGraphLaunch`` on ``s`` (a stream of this graph's device, resolved by the driver).
        See :meth:`~xlog_actors.driver.graph.Graph.launch`."""
        if s._dev is not self._dev:
            raise InvalidRequest(f"{s!r} is not a stream of the graph's device {self._dev.ordinal}")
        with self._lock:
            gate = s._gate
            gate.acquire()
            try:
                dev = s._enter()
                self._check_open()
                # Only enqueues: the GIL is kept (see .held).
                err = dev.held.graph_launch(self._exec_h, s._handle)
                if not err and self._retired:
                    # An event after this launch comes after every earlier launch of the graph
                    # too (launches of one exec run in order, whatever their streams): the views
                    # a rebinding retired are kept until it fires. Under the gate, as every use
                    # of the stream's handle.
                    retired, self._retired = self._retired, []
                    s._keep_until_done(retired)
            finally:
                gate.release()
            if err:
                dev.fail(as_result(err), f"cuGraphLaunch(stream {s._id})")
            self._last_stream = s

    def update(self, index: int, step: GraphStep, *, checked: bool = False) -> None:
        """Replace step ``index`` with ``step`` (see :meth:`~xlog_actors.driver.graph.Graph.update`);
        ``checked``: the caller made ``step`` itself from checked parts, so ``check_steps`` is
        skipped (the shape and the pinned memory are still checked)."""
        with self._lock:
            dev = self._check_open()
            if type(index) is not int or not 0 <= index < len(self._nodes):
                raise InvalidRequest(f"graph step index {index!r} out of range 0..{len(self._nodes) - 1}")
            if not checked:
                check_steps([step])
            node = self._nodes[index]
            why = same_shape(node.step, step)
            if why is not None:
                raise InvalidRequest(f"graph step {index}: {why}")
            dev.enter()
            if isinstance(step, (HostToDevice, DeviceToHost, DeviceToDevice)):
                self._retire(self._update_copy(index, node, step, dev))
            elif isinstance(step, KernelStep):
                fn = node.params.func
                params, keep = self._kernel_params(step, fn)
                (err,) = cu.cuGraphExecKernelNodeSetParams(self._exec, node.node, params)
                if err != SUCCESS:
                    dev.fail(err, f"graph step {index}: cuGraphExecKernelNodeSetParams({step.kernel.name})")
                node.params, node.keep = params, keep
            else:
                assert isinstance(step, Memset)
                params = self._memset_params(step)
                (err,) = cu.cuGraphExecMemsetNodeSetParams(self._exec, node.node, params, dev.ctx)
                if err != SUCCESS:
                    dev.fail(err, f"graph step {index}: cuGraphExecMemsetNodeSetParams")
                node.params = params
            node.step = step

    def update_host(self, index: int, view: memoryview) -> None:
        """Replace the host side of copy step ``index`` with ``view`` (see
        :meth:`~xlog_actors.driver.graph.Graph.update_host`): one ``cuGraphExecMemcpyNodeSetParams``,
        the GIL kept, and nothing at all when ``view`` is the one the step has."""
        with self._lock:
            dev = self._check_open()
            node = self._nodes[index] if type(index) is int and 0 <= index < len(self._nodes) else None
            if node is not None and node.keep is view:
                return
            step = host_step([n.step for n in self._nodes], index, view)
            assert node is not None
            dev.enter()
            self._retire(self._update_copy(index, node, step, dev))
            node.step = step

    def swap_host(self, index: int, view: memoryview) -> object | None:
        """As :meth:`update_host`, but the replaced view is returned, for the caller to keep
        until the launches before this call ran (see
        :meth:`~xlog_actors.driver.graph.Graph.swap_host`)."""
        with self._lock:
            dev = self._check_open()
            node = self._nodes[index] if type(index) is int and 0 <= index < len(self._nodes) else None
            if node is not None and node.keep is view:
                return None
            by_address = self._by_address(index, view)
            if by_address is not None:
                # Only the address changes: written into the kept struct's own memory, then one
                # node update.
                node, address = by_address
                assert node.host is not None
                dev.enter()
                old = node.host.value
                node.host.value = address
                err = self._set_node(node)
                if err:
                    node.host.value = old
                    dev.fail(as_result(err), f"graph step {index}: {_SET_CALL[node.args is None]}")
                a = node.addresses
                node.addresses = (address, 0, 0, a[3]) if node.src else (0, a[1], address, 0)
                replaced, node.keep = node.keep, view
                return replaced
            step = host_step([n.step for n in self._nodes], index, view)
            assert node is not None
            dev.enter()
            replaced = self._update_copy(index, node, step, dev)
            node.step = step
            return replaced

    def fast_host(self, index: int, view: memoryview) -> tuple[Any, int] | None:
        """Copy step ``index``'s node and ``view``'s address, when ``view`` may be bound to it by
        address alone (see :meth:`~xlog_actors.driver.graph.Graph.fast_host`): a view this
        graph already checked (swapped in or recorded before), of the step's length, writable
        for a copy into it, and a node whose host field was located. Else None."""
        with self._lock:
            return self._by_address(index, view)

    def _by_address(self, index: int, view: memoryview) -> tuple[_Node, int] | None:
        """Step ``index``'s node and ``view``'s address when ``view`` may be bound to it by
        address alone (see :meth:`fast_host`); else None. Call under ``_lock``."""
        node = self._nodes[index] if type(index) is int and 0 <= index < len(self._nodes) else None
        known = self._pinned_views.get(id(view))
        if (node is None or not node.host_at or known is None or known[0] is not view
                or len(view) != cast(HostToDevice | DeviceToHost, node.step).nbytes
                or (not node.src and view.readonly)):
            return None
        return node, known[1]

    def _retire(self, replaced: object | None) -> None:
        """Keep a replaced view until the next launch hands it to its stream."""
        if replaced is not None and self._last_stream is not None:
            self._retired.append(replaced)  # launches before the update may still use it

    def _update_copy(self, index: int, node: _Node, step: HostToDevice | DeviceToHost | DeviceToDevice,
                     dev: CudaDevice) -> object | None:
        """A copy node's update: the kept ``CUDA_MEMCPY3D`` changed in place, then set on the
        exec by address, the GIL kept; changed back if the driver refuses it. Returns the host
        view it replaced, which launches before it may still use (None when there is none)."""
        p = node.params
        old = node.addresses
        new, keep = self._sides(index, step)
        if new == old:
            node.keep = keep
            return None
        args = node.args
        if args is not None:
            args.set(*_dst_src(new))
        else:
            p.srcHost, p.srcDevice, p.dstHost, p.dstDevice = new
        err = self._set_node(node)
        if err:
            if args is not None:
                args.set(*_dst_src(old))
            else:
                p.srcHost, p.srcDevice, p.dstHost, p.dstDevice = old
            dev.fail(as_result(err), f"graph step {index}: {_SET_CALL[args is None]}")
        node.addresses = new
        replaced, node.keep = node.keep, keep
        return replaced if replaced is not keep else None

    def close(self, keep: Sequence[object] = ()) -> None:
        """Destroy the exec and the graph (see the module docstring); ``keep``: more objects to
        keep until the launches already enqueued ran. Idempotent; never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self._last_stream
            kept = [n.keep for n in self._nodes if n.keep is not None and not isinstance(n.keep, ctypes.Array)]
            kept.extend(self._retired)
            kept.extend(keep)
            keep = kept
            self._retired = []
            if last is not None and keep:
                with last._gate, contextlib.suppress(XlogError):
                    last._enter()  # a stream gone with its context: its work ran or was dropped
                    last._keep_until_done(keep)
            self._destroy()

    def _destroy(self) -> None:
        dev = self._dev
        if dev.incarnation != self._incarnation or dev.ctx is None or not dev.primary_active():
            return  # the context they were made in is gone: the handles dangle (module docstring)
        with contextlib.suppress(Exception):  # best effort
            if self._exec is not None:
                cu.cuGraphExecDestroy(self._exec)
            cu.cuGraphDestroy(self._graph)
        self._exec = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # finalizers must not raise
            if not self._closed:
                self._closed = True
                self._destroy()
