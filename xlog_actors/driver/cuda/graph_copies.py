"""A graph's small host copies as copy-kernel nodes instead of memcpy nodes.

Why: ``cuGraphLaunch`` costs the CPU about 1.5 µs for every memcpy node between pinned host
memory and the device, and 0.4 to 0.8 µs for a kernel node (measured on an H100: a graph of
four lanes of copy in, kernel, copy back launches in 15.9 µs of CPU with memcpy nodes, 7 µs with
copy kernels). For copies up to :data:`KERNEL_COPY_MAX` a kernel that reads or writes the pinned
memory through its device mapping also moves the bytes as fast as the copy engine or faster (64
KiB batches of that graph, two in flight: 16.3 GB/s against 8.6 GB/s). Above it the copy engines
win (1 MiB: 38 GB/s against 28), so larger copies stay memcpy nodes.

The driver's pinned memory is ``cuMemHostAlloc``'d, and under unified addressing a device
reaches such memory at its host address: the kernel's host argument is the view's address, and
binding another view is writing its address into the node's own argument slot, then one
``cuGraphExecKernelNodeSetParams``. A device without unified addressing keeps memcpy nodes.

The kernel copies 16 bytes a thread when both addresses are 16-byte aligned (any pinned
allocation's start is) and a byte a thread otherwise, so any view a host step may be bound to
later is copied correctly; the grid is sized for the aligned case and strides over the rest.

Thread rule: the constants and :func:`copy_grid` are immutable or pure; a :class:`CopyArgs` is
owned by its graph node and changed under the graph's lock.
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

from ...errors import DriverError
from ..kernel import Kernel

__all__ = ["COPY_KERNEL", "KERNEL_COPY_MAX", "CopyArgs", "copy_grid"]

#: The largest host copy a graph records as a copy kernel (bytes).
KERNEL_COPY_MAX: Final = 256 * 1024

_THREADS: Final = 256
_PER_BLOCK: Final = _THREADS * 16


def _device_only(*_args: object) -> None:
    raise DriverError("xlog_graph_copy runs on CUDA devices only (the host driver copies graph steps itself)")


#: ``xlog_graph_copy(dst, src, nbytes)``: ``nbytes`` bytes from ``src`` to ``dst``, either of them
#: pinned host memory reached through its device mapping.
COPY_KERNEL: Final = Kernel(
    name="xlog_graph_copy",
    source=r"""
extern "C" __global__ void xlog_graph_copy(unsigned char* dst, const unsigned char* src,
                                           unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long i;
    if (((((unsigned long long)dst) | ((unsigned long long)src)) & 15ULL) == 0ULL) {
        const unsigned long long n16 = n >> 4;
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        for (i = first; i < n16; i += stride) d[i] = s[i];
        for (i = (n16 << 4) + first; i < n; i += stride) dst[i] = src[i];
    } else {
        for (i = first; i < n; i += stride) dst[i] = src[i];
    }
}
""",
    params=("ptr", "ptr", "u64"),
    host=_device_only,
)


def copy_grid(nbytes: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The grid and block of a copy of ``nbytes``: one 16-byte word a thread, 256 threads a
    block, 1 to 1,024 blocks. Thread rule: any thread."""
    blocks = min(1024, max(1, -(-nbytes // _PER_BLOCK)))
    return (blocks, 1, 1), (_THREADS, 1, 1)


class CopyArgs:
    """A copy-kernel node's own argument memory: the three values (``dst``, ``src``, ``nbytes``)
    in 8-byte slots, then the pointers to them that the node's ``kernelParams`` names. Kept for
    the node's life: an update writes a new address into its slot and sets the node's parameters
    again (the driver copies the values when the call returns).

    Thread rule: owned by one node; changed under its graph's lock.
    """

    __slots__ = ("params", "slots")

    def __init__(self, dst: int, src: int, nbytes: int) -> None:
        self.slots: Any = (ctypes.c_uint64 * 6)(dst, src, nbytes)
        base = ctypes.addressof(self.slots)
        for k in range(3):
            self.slots[3 + k] = base + 8 * k
        #: the address of the pointer array, the node's ``kernelParams``
        self.params = base + 24

    def at(self, k: int) -> int:
        """The address of value slot ``k`` (0: dst, 1: src)."""
        return ctypes.addressof(self.slots) + 8 * k

    def set(self, dst: int, src: int) -> None:
        """Write new addresses into the value slots."""
        self.slots[0], self.slots[1] = dst, src
