# The value types the compiled resources build and read at C speed; see blocks.pyx.

from cpython.object cimport PyObject

from .pyint cimport xa_int_set, xa_only_ref

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


cdef extern from *:
    """
    #define xa_type_is(o, t) ((PyObject *)Py_TYPE(o) == (t))
    """
    bint xa_type_is(PyObject* o, PyObject* t) noexcept


# The process's generation numbers, one struct that every module reaches through the pointer
# ``generation_source()`` gives, so that ``renew_generation`` is inlined where a hit calls it (a
# call's entry and exit were a third of its cost) and still counts with ``next_generation``.
cdef struct GenerationSource:
    unsigned long long last  # the last number handed out
    PyObject* renewable  # Generation, once its rewrite in place was checked sound; else NULL


cdef GenerationSource* generation_source() noexcept


cdef inline bint renew_generation(GenerationSource* src, PyObject* generation) noexcept:
    # The next generation of the process written into ``generation`` itself, when it is an
    # exact Generation whose one reference is the caller's and the next number has as many
    # digits as it; False (nothing changed, no number taken) otherwise. With the GIL held.
    if not xa_only_ref(generation) or not xa_type_is(generation, src.renewable):
        return False
    if not xa_int_set(generation, src.last + 1):
        return False
    src.last += 1
    return True


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
