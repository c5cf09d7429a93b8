# The compiled body of the block cache adaptor; see cache_core.pyx. Declared here so that the
# device context (context_core.pyx) calls its allocation and free in C.

from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from .async_core cimport AsyncCore, _Entry
from .blocks cimport DeviceBlock
from .ptr_table cimport PtrTable
from .resource_core cimport ResourceCore


cdef class _StreamBins


cdef class _Slot:
    cdef object ptr
    cdef uint64_t key
    cdef _Entry entry  # the upstream's entry of the block
    cdef size_t cls  # the block's size upstream (its class, for a cached size)
    cdef Py_ssize_t idx  # its class index; -1: not a cached size (its free goes upstream)
    cdef size_t asked  # while handed out: the size asked
    cdef bint kept  # in its stream's list (or being trimmed); else handed out
    cdef long long seq  # the home stream's put count when the block was kept
    cdef _StreamBins bins  # the lists of the stream it is handed out on (entry.stream's); None: idx -1
    cdef DeviceBlock block  # the block it handed out last (see _hand_out)
    cdef _Slot newer
    cdef _Slot older


cdef class _Bin:
    cdef _Slot newest
    cdef _Slot oldest


cdef class _StreamBins:
    cdef object sid
    cdef list bins  # class index -> _Bin
    cdef long long seq  # blocks kept on this stream, ever
    cdef object fence  # an event recorded on the stream, or None
    cdef long long fence_seq  # ``seq`` when ``fence`` was recorded
    cdef bint fence_done  # ``fence`` was seen complete
    cdef uint64_t pool_version  # the pool's version (StreamsVersion) when the stream was found in it; 0: none
    cdef PyObject* home  # the stream, borrowed from the pool's dict while the pool's version is pool_version


cdef class CacheCore(ResourceCore):
    cdef readonly object _upstream
    cdef AsyncCore _up
    cdef int* _lk  # the upstream's lock: the cache's state and the upstream's entries move together
    cdef PtrTable _held  # address -> _Slot, for every block the cache holds (handed out or kept)
    cdef dict _by_stream  # stream id -> _StreamBins; only grows
    cdef _StreamBins _last  # the lists last looked up (a look-up tries its id by identity first)
    cdef bint _enabled
    cdef long long _limit  # most bytes kept idle; -1: no limit
    cdef long long _cached_bytes
    cdef long long _cached_blocks
    cdef long long _slack  # sum of (class size - size asked) of the blocks handed out
    cdef long long _hits
    cdef long long _cross_hits
    cdef long long _misses
    cdef long long _fences
    cdef long long _trims
    cdef long long _trimmed_blocks
    cdef long long _trimmed_bytes
    cdef long long _dropped_bytes
    cdef _StreamBins _bins_for(self, object sid)
    cdef object _alloc_c(self, object nbytes, object stream, object tag)
    cdef object _dealloc_c(self, object block)
    cdef int _release(self, object block, bint strict) except -1
    cdef Py_ssize_t _live_count(self) noexcept
    cdef list _live_list(self)
    cdef object _miss(self, object nbytes, Py_ssize_t idx, size_t cls, object stream, object tag,
                      _StreamBins sb, object generation)
    cdef _Slot _take_across(self, object stream, Py_ssize_t idx)
    cdef list _detach_all(self)
    cdef long long _trim_all(self, bint quiet) except -1
    cdef int _keep_again(self, _Slot s) except -1
    cdef list _kept(self)
