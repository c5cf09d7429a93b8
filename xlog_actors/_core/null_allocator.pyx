# cython: language_level=3, boundscheck=False, wraparound=False
"""The cheapest allocator PyTorch's ``CUDAPluggableAllocator`` can load: the ceiling that the
bench's training-loop rows measure the device's allocator bridge against. Not a resource of the
runtime: it has no lock, no streams, no budget and no report, and it never gives memory back.

Two C functions are exported from this shared library, as the bridge's are:

* ``xlog_actors_null_alloc(ssize_t size, int device, void* stream) -> void*``: the last block
  freed in the size's class, else a new one from the driver entry point given to
  :func:`configure` (NULL if that fails, or if none was given). A size of 0 returns NULL.
* ``xlog_actors_null_free(void* ptr, ssize_t size, int device, void* stream)``: keeps the block
  for its class (the size is the one asked for it, as torch passes it back); past
  :data:`DEPTH` kept blocks of a class, gives it to the free entry point.

A class is the bridge's: 512-byte steps up to 4 KiB, then four classes per power of two. A kept
block is handed out again at once, with no event and no stream check: correct only where every
use is on one stream, in order (the training loop's one stream). Device and stream are ignored.

Invariants: a block is either handed out or in exactly one class's stack; a stack holds at most
:data:`DEPTH` blocks; the counters only grow.

Thread rule: one thread calls the exported functions (nothing is locked); :func:`configure` and
:func:`stats` from the same thread, or while no allocation is in flight.
"""

from libc.stdint cimport uint64_t, uintptr_t

from .size_class cimport class_index, class_size

__all__ = ["ALLOC_SYMBOL", "DEPTH", "FREE_SYMBOL", "configure", "library_path", "stats"]

#: The exported symbols, for ``CUDAPluggableAllocator(library_path(), ALLOC_SYMBOL, FREE_SYMBOL)``.
ALLOC_SYMBOL = "xlog_actors_null_alloc"
FREE_SYMBOL = "xlog_actors_null_free"

cdef enum:
    _DEPTH = 16
    _CLASSES = 4 * 64 + 8  # four per power of two, plus the 512-byte steps below 4 KiB

#: The most blocks kept per size class.
DEPTH = _DEPTH

ctypedef int (*_alloc_fn)(uint64_t* ptr, size_t size) noexcept nogil
ctypedef int (*_free_fn)(uint64_t ptr) noexcept nogil

cdef void* _stacks[_CLASSES][_DEPTH]
cdef int _depth[_CLASSES]
cdef _alloc_fn _alloc = NULL
cdef _free_fn _free = NULL
cdef uint64_t _hits = 0
cdef uint64_t _misses = 0


cdef public void* xlog_actors_null_alloc(Py_ssize_t size, int device, void* stream) noexcept nogil:
    global _hits, _misses
    cdef size_t cls_size
    cdef Py_ssize_t cls
    cdef uint64_t ptr = 0
    if size <= 0:
        return NULL
    cls_size = class_size(<size_t>size)
    cls = class_index(cls_size)
    if 0 <= cls < _CLASSES and _depth[cls] > 0:
        _hits += 1
        _depth[cls] -= 1
        return _stacks[cls][_depth[cls]]
    _misses += 1
    if _alloc == NULL or _alloc(&ptr, cls_size) != 0:
        return NULL
    return <void*><uintptr_t>ptr


cdef public void xlog_actors_null_free(void* ptr, Py_ssize_t size, int device, void* stream) noexcept nogil:
    cdef Py_ssize_t cls
    if ptr == NULL or size <= 0:
        return
    cls = class_index(class_size(<size_t>size))
    if 0 <= cls < _CLASSES and _depth[cls] < _DEPTH:
        _stacks[cls][_depth[cls]] = ptr
        _depth[cls] += 1
    elif _free != NULL:
        _free(<uint64_t><uintptr_t>ptr)


def configure(size_t alloc_address, size_t free_address):
    """Set the driver entry points a miss and an overflowing free call: ``cuMemAlloc_v2``'s and
    ``cuMemFree_v2``'s addresses (or any C functions with their signatures).

    Args:
        alloc_address: ``int (*)(CUdeviceptr* ptr, size_t bytes)``, 0 for none (a miss then
            returns NULL).
        free_address: ``int (*)(CUdeviceptr ptr)``, 0 for none (an overflowing free is dropped).
    Thread rule: see the module's.
    """
    global _alloc, _free
    _alloc = <_alloc_fn><void*>alloc_address
    _free = <_free_fn><void*>free_address


def stats():
    """``{"hits": ..., "misses": ..., "kept_blocks": ...}`` since the library was loaded.

    Thread rule: see the module's.
    """
    cdef int kept = 0
    for i in range(_CLASSES):
        kept += _depth[i]
    return {"hits": _hits, "misses": _misses, "kept_blocks": kept}


def library_path():
    """The path of this shared library, the one to hand to ``CUDAPluggableAllocator``.

    Thread rule: any thread.
    """
    return __file__
