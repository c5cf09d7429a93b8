# The driver calls the compiled resources make; see ops.pyx.

ctypedef int CUresult
ctypedef void* CUstream
ctypedef void* CUevent
ctypedef void* CUmemoryPool
ctypedef unsigned long long CUdeviceptr

ctypedef CUresult (*AllocFromPoolAsync_t)(CUdeviceptr*, size_t, CUmemoryPool, CUstream) noexcept nogil
ctypedef CUresult (*FreeAsync_t)(CUdeviceptr, CUstream) noexcept nogil
ctypedef CUresult (*EventRecord_t)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*StreamWaitEvent_t)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*MemAlloc_t)(CUdeviceptr*, size_t) noexcept nogil
ctypedef CUresult (*MemFree_t)(CUdeviceptr) noexcept nogil
ctypedef CUresult (*GraphLaunch_t)(void*, CUstream) noexcept nogil
ctypedef CUresult (*EventQuery_t)(CUevent) noexcept nogil
ctypedef CUresult (*GraphMemcpySet_t)(void*, void*, const void*, void*) noexcept nogil
ctypedef CUresult (*GraphKernelSet_t)(void*, void*, const void*) noexcept nogil
ctypedef CUresult (*PrimaryCtxGetState_t)(int, unsigned int*, int*) noexcept nogil
ctypedef CUresult (*MemsetD8Async_t)(CUdeviceptr, unsigned char, size_t, CUstream) noexcept nogil
ctypedef CUresult (*MemcpyHtoDAsync_t)(CUdeviceptr, const void*, size_t, CUstream) noexcept nogil
ctypedef CUresult (*MemcpyDtoHAsync_t)(void*, CUdeviceptr, size_t, CUstream) noexcept nogil
ctypedef CUresult (*LaunchKernel_t)(void*, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                    unsigned int, unsigned int, CUstream, void**, void**) noexcept nogil


cdef class DriverOps:
    cdef readonly object driver
    cdef readonly object ordinal
    cdef object alloc_async(self, object nbytes, object stream)
    cdef free_async(self, object ptr, object stream)
    cdef record(self, object event, object stream)
    cdef wait(self, object stream, object event)
    cdef object alloc(self, object nbytes)
    cdef free(self, object ptr)
    cdef object create_event(self)
    cdef graph_launch(self, object graph, object stream)
    cdef bint query(self, object event) except -1
    cdef bint graph_host_set(self, object graph, object node, unsigned long long address) except -1
    cdef memset_d8(self, object ptr, int byte, object nbytes, object stream)
    cdef bint copy_htod(self, object ptr, object buf, unsigned long long address, object nbytes,
                        object stream) except -1
    cdef bint copy_dtoh(self, object buf, unsigned long long address, object ptr, object nbytes,
                        object stream) except -1
    cdef bint launch(self, object kernel, const unsigned int* dims, void** params, object stream) except -1


cdef class CudaOps(DriverOps):
    cdef object _dev
    cdef object _tls
    cdef bint _tls_plain
    cdef object _tls_dict
    cdef unsigned long long _tls_thread
    cdef object _token_writes_keep
    cdef long long* _token_writes
    cdef unsigned long long _tok_thread
    cdef long long _tok_writes
    cdef object _tok_value
    cdef object _last_stream
    cdef CUstream _last_handle
    cdef object _stream_type
    cdef object _event_type
    cdef object _cuda_result
    cdef object _version_keep
    cdef long long* _version
    cdef long long _seen
    cdef object _ok_stream
    cdef long long _ok_stream_seen
    cdef object _live_token
    cdef object _token
    cdef bint _live
    cdef object _pool_obj
    cdef CUmemoryPool _pool
    cdef set _pool_live
    cdef set _direct_live
    cdef AllocFromPoolAsync_t _alloc_from_pool
    cdef FreeAsync_t _free_async
    cdef EventRecord_t _event_record
    cdef StreamWaitEvent_t _stream_wait_event
    cdef MemAlloc_t _mem_alloc
    cdef MemFree_t _mem_free
    cdef GraphLaunch_t _graph_launch
    cdef EventQuery_t _event_query
    cdef GraphMemcpySet_t _graph_memcpy_set
    cdef GraphKernelSet_t _graph_kernel_set
    cdef PrimaryCtxGetState_t _primary_state
    cdef MemsetD8Async_t _memset_d8
    cdef MemcpyHtoDAsync_t _memcpy_htod
    cdef MemcpyDtoHAsync_t _memcpy_dtoh
    cdef LaunchKernel_t _launch_kernel
    cdef dict _functions
    cdef object _functions_token
    cdef int _cudev
    cdef bint _current(self)
    cdef object _thread_token(self)
    cdef bint _stream_ok(self, object s)
    cdef bint _enqueue_ok(self, object ptr, object nbytes, object stream)
    cdef CUstream _handle_of(self, object s) except? NULL


cpdef DriverOps ops_for(object driver, object ordinal)
