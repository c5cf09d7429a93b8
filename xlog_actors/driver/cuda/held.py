"""Driver calls that keep the GIL: ``ctypes`` prototypes of the ``PYFUNCTYPE`` kind over the
entry points ``cuGetProcAddress`` resolved (:func:`.call.resolve_entry_points`).

Why: cuda.bindings lets the GIL go around every driver call. With several threads busy (the
library actors of a pipeline, their orchestrator), each let-go hands the GIL to another thread
and the caller then waits to get it back: measured on an H200, the demo's threads spent about
1 ms of CPU per 16 MiB batch against 0.6 ms of wall time, most of it in these hand-offs (see
``docs/performance.md``). The calls here only enqueue work or read a flag and return in about
a microsecond, so holding the GIL across them is cheaper than the hand-off. The compiled core
keeps the GIL across its own driver calls for the same reason.

Only for calls that cannot block: never a synchronize, and a host copy only when its host memory
is page-locked (from pageable memory CUDA stages the bytes before it returns, which for a large
copy takes milliseconds). Return values are raw ``CUresult`` ints (0 is success).

Thread rule: any thread; the prototypes hold no state.
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

from .call import SUCCESS, cu

__all__ = ["HELD_ENTRY_POINTS", "HeldCalls", "as_result"]

#: The entry points :class:`HeldCalls` calls (resolved at CUDA 12.0's ABI: the _v2 copies).
HELD_ENTRY_POINTS: Final = (
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventCreate",
    "cuLaunchKernel",
    "cuStreamWaitEvent",
    "cuDevicePrimaryCtxGetState",
    "cuGraphLaunch",
    "cuGraphExecMemcpyNodeSetParams",
    "cuGraphExecKernelNodeSetParams",
    "cuMemsetD8Async",
)

def as_result(code: int) -> Any:
    """A held call's code as the ``CUresult`` the driver's error mapping (``CudaDevice.fail``)
    takes: ``SUCCESS`` itself for 0, the enum member otherwise. Thread rule: any thread."""
    return cu.CUresult(code) if code else SUCCESS


_INT = ctypes.c_int
_U64 = ctypes.c_uint64
_PTR = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_UINT = ctypes.c_uint


class HeldCalls:
    """The GIL-keeping driver calls of one driver (see the module docstring). Handles are ints.

    Thread rule: any thread.
    """

    __slots__ = (
        "_primary_state",
        "event_create",
        "event_query",
        "event_record",
        "graph_kernel_set",
        "graph_launch",
        "graph_memcpy_set",
        "launch",
        "memcpy_dtod",
        "memcpy_dtoh",
        "memcpy_htod",
        "memset_d8",
        "stream_wait",
    )

    def __init__(self, entry_points: dict[str, int]) -> None:
        """Args:
            entry_points: name -> address, holding every name of :data:`HELD_ENTRY_POINTS`.
        Raises:
            KeyError: one is missing.
        Thread rule: any thread.
        """
        f = ctypes.PYFUNCTYPE
        #: (dst device ptr, src host address, bytes, stream) -> CUresult
        self.memcpy_htod = f(_INT, _U64, _PTR, _SIZE, _PTR)(entry_points["cuMemcpyHtoDAsync"])
        #: (dst host address, src device ptr, bytes, stream) -> CUresult
        self.memcpy_dtoh = f(_INT, _PTR, _U64, _SIZE, _PTR)(entry_points["cuMemcpyDtoHAsync"])
        #: (dst device ptr, src device ptr, bytes, stream) -> CUresult
        self.memcpy_dtod = f(_INT, _U64, _U64, _SIZE, _PTR)(entry_points["cuMemcpyDtoDAsync"])
        #: (event, stream) -> CUresult
        self.event_record = f(_INT, _PTR, _PTR)(entry_points["cuEventRecord"])
        #: (event) -> CUresult (CUDA_ERROR_NOT_READY while pending)
        self.event_query = f(_INT, _PTR)(entry_points["cuEventQuery"])
        #: (CUevent* out, flags) -> CUresult
        self.event_create = f(_INT, ctypes.POINTER(_PTR), _UINT)(entry_points["cuEventCreate"])
        #: (stream, event, flags) -> CUresult
        self.stream_wait = f(_INT, _PTR, _PTR, _UINT)(entry_points["cuStreamWaitEvent"])
        self._primary_state = f(_INT, _INT, ctypes.POINTER(_UINT), ctypes.POINTER(_INT))(
            entry_points["cuDevicePrimaryCtxGetState"]
        )
        #: (function, grid x y z, block x y z, shared bytes, stream, void** params, extra) -> CUresult
        self.launch = f(_INT, _PTR, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _PTR, _PTR, _PTR)(
            entry_points["cuLaunchKernel"]
        )

        #: (dst device ptr, byte, count, stream) -> CUresult
        self.memset_d8 = f(_INT, _U64, ctypes.c_ubyte, _SIZE, _PTR)(entry_points["cuMemsetD8Async"])
        #: (graph exec, stream) -> CUresult: one replay, enqueued
        self.graph_launch = f(_INT, _PTR, _PTR)(entry_points["cuGraphLaunch"])
        #: (graph exec, node, const CUDA_MEMCPY3D*, context) -> CUresult: a copy node's new
        #: addresses for later launches (the struct is read before the call returns)
        self.graph_memcpy_set = f(_INT, _PTR, _PTR, _PTR, _PTR)(entry_points["cuGraphExecMemcpyNodeSetParams"])
        #: (graph exec, node, const CUDA_KERNEL_NODE_PARAMS*) -> CUresult: a kernel node's new
        #: arguments for later launches (copied before the call returns; the _v2 struct, as the
        #: CUDA 12.0 ABI resolves it and cuda.bindings lays it out)
        self.graph_kernel_set = f(_INT, _PTR, _PTR, _PTR)(entry_points["cuGraphExecKernelNodeSetParams"])

    def new_event(self, flags: int) -> tuple[int, int]:
        """``cuEventCreate``: ``(CUresult, event handle)`` (the handle is 0 on failure)."""
        out = _PTR()
        code = self.event_create(ctypes.byref(out), flags)
        return code, out.value or 0

    def primary_active(self, cudev: int) -> tuple[int, bool]:
        """``cuDevicePrimaryCtxGetState`` on device handle ``cudev``: ``(CUresult, active)``."""
        flags, active = _UINT(), _INT()
        code = self._primary_state(cudev, ctypes.byref(flags), ctypes.byref(active))
        return code, bool(active.value)
