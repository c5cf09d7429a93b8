"""What every CUDA device guarantees and allows, as the constants both drivers and the memory layer use.

The launch limits are those of an H100 (compute capability 9.0), which every device of
compute capability 3.0 and later shares except for the shared-memory opt-in ceiling. The host
driver checks a launch against them so that what the host accepts is what a GPU accepts; the
memory layer takes :data:`ALIGNMENT` from here for both drivers, because it is a promise of the
CUDA allocators, not a detail of the host emulation.

Thread rule: constants only; any thread may read them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALIGNMENT",
    "MAX_BLOCK_DIMS",
    "MAX_GRID_DIMS",
    "MAX_SHARED_MEMORY_PER_BLOCK",
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "MAX_THREADS_PER_BLOCK",
]

#: The alignment in bytes of every pointer ``cuMemAlloc`` and ``cuMemAllocAsync`` hand out; the
#: host driver aligns its allocations the same way.
ALIGNMENT: Final = 256

#: Most threads in one block: the product of the three block dimensions.
MAX_THREADS_PER_BLOCK: Final = 1024

#: Largest block dimension along x, y and z.
MAX_BLOCK_DIMS: Final = (1024, 1024, 64)

#: Largest grid dimension along x, y and z.
MAX_GRID_DIMS: Final = ((1 << 31) - 1, 65535, 65535)

#: Static plus dynamic shared memory one block may use without opting in. Not checked at launch:
#: a launch here carries no dynamic shared memory, and NVRTC refuses a kernel whose static shared
#: memory exceeds it when compiling.
MAX_SHARED_MEMORY_PER_BLOCK: Final = 48 << 10

#: The same after ``cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)`` opts in
#: (227 KiB on an H100). Documented for kernels that will opt in; nothing here does yet.
MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: Final = 227 << 10
