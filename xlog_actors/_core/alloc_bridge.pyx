# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The C face of the device allocators that foreign libraries load by symbol (PyTorch's
``CUDAPluggableAllocator``): three C functions exported from this very shared library, each
taking the GIL and calling the Python allocator registered for the CUDA device it is given.

* ``xlog_actors_alloc(ssize_t size, int device, void* stream) -> void*``: the allocator's
  ``allocate(size, stream_handle)``; a refusal throws a C++ ``std::runtime_error`` carrying the
  refusal's message (our error and its memory report), after the GIL is given back. PyTorch
  turns that into a ``RuntimeError`` with the message: its pluggable allocator does not check
  for a null pointer (up to 2.9 at least; a null would become a tensor at address 0), and it
  raises ``torch.OutOfMemoryError`` only for its own ``c10::OutOfMemoryError``, which a library
  that does not link against c10 cannot throw. A size of 0 returns NULL, as torch expects.
* ``xlog_actors_alloc_or_null``: the same without the throw (NULL on refusal), for callers in C,
  where a C++ exception cannot be caught (ctypes).
* ``xlog_actors_free(void* ptr, ssize_t size, int device, void* stream)``: the allocator's
  ``free(ptr, size, stream_handle)``. A free cannot report: what it raises is logged and kept as
  the device's last error.

Every refusal or failure is kept, per device, as :func:`last_error` (the exception object,
report included), so it stays reachable whatever the caller did with the message.

The module is compiled as C++ (for the throw); the exported names are ``extern "C"``.

Invariants: the registry maps a CUDA device ordinal to one allocator object; it changes only
through :func:`register` and :func:`unregister`. After the interpreter began to exit (an
``atexit`` hook), or once it is finalized, the exported functions no longer take the GIL: an
allocation throws (or returns NULL), a free is dropped (the driver's close, or the process's
end, frees the memory).

Thread rule: any thread, with or without the GIL held (they take it with ``PyGILState_Ensure``);
the registry's functions from any Python thread.
"""

import atexit
import logging

from cpython.pystate cimport PyGILState_Ensure, PyGILState_Release, PyGILState_STATE
from libcpp.string cimport string

__all__ = [
    "ALLOC_OR_NULL_SYMBOL",
    "ALLOC_SYMBOL",
    "FREE_SYMBOL",
    "last_error",
    "library_path",
    "register",
    "registered",
    "unregister",
]

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef extern from *:
    """
    #include <stdexcept>
    #include <string>
    static void xlog_actors_throw(const std::string& message) {
        throw std::runtime_error(message);
    }
    """
    void _throw "xlog_actors_throw"(const string& message) nogil

#: The exported symbols, for ``CUDAPluggableAllocator(library_path(), ALLOC_SYMBOL, FREE_SYMBOL)``.
ALLOC_SYMBOL = "xlog_actors_alloc"
ALLOC_OR_NULL_SYMBOL = "xlog_actors_alloc_or_null"
FREE_SYMBOL = "xlog_actors_free"

logger = logging.getLogger("xlog_actors.interop")

cdef dict _allocators = {}
cdef dict _last_errors = {}
cdef bint _exiting = False
cdef const char* _EXITING = b"xlog_actors: the interpreter is exiting; no more device allocations"


def _at_exit():
    global _exiting
    _exiting = True


atexit.register(_at_exit)


def register(int device, allocator):
    """Route the exported functions' calls for CUDA device ``device`` to ``allocator``.

    Args:
        device: the CUDA device ordinal the foreign library names.
        allocator: an object with ``allocate(nbytes, stream_handle) -> int`` (the device pointer)
            and ``free(ptr, nbytes, stream_handle) -> None``.
    Raises:
        TypeError: ``allocator`` lacks one of the two methods.
        ValueError: ``device`` is negative, or another allocator is registered for it.
    Thread rule: any thread.
    """
    if device < 0:
        raise ValueError(f"device ordinal must be >= 0, got {device}")
    if not callable(getattr(allocator, "allocate", None)) or not callable(getattr(allocator, "free", None)):
        raise TypeError(f"an allocator needs allocate() and free() methods, got {type(allocator).__name__}")
    current = _allocators.setdefault(device, allocator)
    if current is not allocator:
        raise ValueError(f"CUDA device {device} already routes its allocations to {current!r}")
    _last_errors.pop(device, None)


def unregister(int device, allocator=None):
    """Stop routing CUDA device ``device``'s calls (later allocations there are refused).

    Args:
        device: the CUDA device ordinal.
        allocator: when given, unregister only if it is the one registered.
    Returns:
        whether an allocator was removed.
    Thread rule: any thread.
    """
    current = _allocators.get(device)
    if current is None or (allocator is not None and current is not allocator):
        return False
    del _allocators[device]
    return True


def registered(int device):
    """The allocator registered for CUDA device ``device``, or None. Thread rule: any thread."""
    return _allocators.get(device)


def last_error(int device):
    """The last refusal or failure met by the exported functions for ``device`` (the exception
    object, with its message and report), or None since the last :func:`register`.

    Thread rule: any thread.
    """
    return _last_errors.get(device)


def library_path():
    """The path of this shared library, the one to hand to ``CUDAPluggableAllocator``. It is
    already loaded (this module is), so a ``dlopen`` of it shares the registry above.

    Thread rule: any thread.
    """
    return __file__


cdef void* _allocate(Py_ssize_t size, int device, void* stream, string* message) noexcept with gil:
    allocator = _allocators.get(device)
    try:
        if allocator is None:
            raise LookupError(f"xlog_actors: no device routes CUDA device {device}'s allocations (not registered)")
        return <void*><size_t>allocator.allocate(size, <size_t>stream)
    except BaseException as exc:  # noqa: BLE001 - C has no exceptions: kept, and handed on as text
        _last_errors[device] = exc
        message[0] = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        return NULL


cdef void* _alloc_or_null(Py_ssize_t size, int device, void* stream, string* message) noexcept nogil:
    if size <= 0:
        return NULL  # torch asks for 0 bytes for an empty tensor, and takes NULL for it
    if _exiting or not Py_IsInitialized():
        message[0] = string(_EXITING)
        return NULL
    return _allocate(size, device, stream, message)


cdef public void* xlog_actors_alloc(Py_ssize_t size, int device, void* stream) noexcept nogil:
    cdef string message
    cdef void* ptr = _alloc_or_null(size, device, stream, &message)
    if ptr == NULL and size > 0:
        # The GIL is not held here: _allocate gave it back, so unwinding leaves it untouched.
        _throw(message)
    return ptr


cdef public void* xlog_actors_alloc_or_null(Py_ssize_t size, int device, void* stream) noexcept nogil:
    cdef string message
    return _alloc_or_null(size, device, stream, &message)


cdef void _free(void* ptr, Py_ssize_t size, int device, void* stream) noexcept with gil:
    allocator = _allocators.get(device)
    try:
        if allocator is None:
            raise LookupError(
                f"xlog_actors: no device routes CUDA device {device}'s frees (not registered): "
                f"{size} bytes at {<size_t>ptr:#x} are not freed"
            )
        allocator.free(<size_t>ptr, size, <size_t>stream)
    except BaseException as exc:  # noqa: BLE001 - a free cannot raise into C: logged and kept
        _last_errors[device] = exc
        logger.error("device allocator of CUDA device %d: free of %#x failed: %r", device, <size_t>ptr, exc)


cdef public void xlog_actors_free(void* ptr, Py_ssize_t size, int device, void* stream) noexcept nogil:
    if ptr == NULL or _exiting or not Py_IsInitialized():
        return  # nothing to free, or the process is going and its memory with it
    _free(ptr, size, device, stream)
