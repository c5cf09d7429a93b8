# The value types the compiled resources build and read at C speed; see blocks.pyx.

cdef class _Frozen:
    pass

cdef class DeviceBlock(_Frozen):
    cdef readonly object ptr
    cdef readonly object device_ordinal
    cdef readonly object alloc_stream
    cdef readonly object nbytes
    cdef readonly object align
    cdef readonly object tag
    cdef readonly object generation
    cdef readonly object state

cdef class BlockId(_Frozen):
    cdef readonly object ptr
    cdef readonly object generation
    cdef readonly object device_ordinal

cdef DeviceBlock new_block(object ptr, object device_ordinal, object alloc_stream, object nbytes,
                           object align, object tag, object generation, object state)
cdef object next_generation()
