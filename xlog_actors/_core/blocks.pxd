# The value types the compiled resources build and read at C speed; see blocks.pyx.

from cpython.object cimport PyObject

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
cdef bint renew_generation(PyObject* generation) noexcept


# A block's or a block id's fields read in C (any other object's through Python): the resources
# take either, and their own subclasses or stand-ins too.
cdef inline object ptr_of(object block):
    if type(block) is DeviceBlock:
        return (<DeviceBlock>block).ptr
    if type(block) is BlockId:
        return (<BlockId>block).ptr
    return block.ptr


cdef inline object generation_of(object block):
    if type(block) is DeviceBlock:
        return (<DeviceBlock>block).generation
    if type(block) is BlockId:
        return (<BlockId>block).generation
    return block.generation


cdef inline object ordinal_of(object block):
    if type(block) is DeviceBlock:
        return (<DeviceBlock>block).device_ordinal
    if type(block) is BlockId:
        return (<BlockId>block).device_ordinal
    return block.device_ordinal
