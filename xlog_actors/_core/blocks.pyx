# cython: language_level=3, boundscheck=False, wraparound=False
"""Value types of the allocator layer: stream and block identities, tags, generations, the block
a resource hands out and the live-block entry a resource lists.

Compiled because the allocation hot path builds one :class:`DeviceBlock` and one
:class:`Generation` per call: as a Cython class the block costs about a tenth of the frozen
dataclass's constructor. (A block cache's hit builds neither when nobody else holds the block it
handed out last: it renews that block's generation in place, ``renew_generation``.) The public
face is :mod:`xlog_actors.memory.block`, which re-exports these names; each behaves as a frozen,
slotted dataclass would (``dataclasses.fields``/``replace``, equality, hashing,
``FrozenInstanceError``), as docs/api.md ("Value types") documents them.

All of them are immutable and safe to share between threads.
"""

cimport cython
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject

import enum
import sys
from dataclasses import FrozenInstanceError
from typing import ClassVar

__all__ = [
    "Access",
    "AllocTag",
    "BlockId",
    "BlockState",
    "DeviceBlock",
    "Generation",
    "LiveBlock",
    "StreamId",
    "make_block",
]


class StreamId(int):
    """Names a stream of a :class:`~xlog_actors.memory.StreamPool`.

    ``StreamId.DEFAULT == StreamId(0)`` always resolves while the pool is open; other ids come
    from ``StreamPool.acquire()``. An ``int`` subclass, so it hashes and compares as its number.
    Immutable; any thread.
    """

    __slots__ = ()
    DEFAULT: ClassVar[StreamId]

    def __repr__(self) -> str:
        return f"StreamId({int(self)})"


StreamId.DEFAULT = StreamId(0)


class AllocTag(str):
    """Names what an allocation is for; statistics and reports group by it.

    ``AllocTag.UNTAGGED`` (``"untagged"``) is the tag of an allocation that gave none. A ``str``
    subclass, so it hashes and compares as its text. Immutable; any thread.
    """

    __slots__ = ()
    UNTAGGED: ClassVar[AllocTag]

    def __repr__(self) -> str:
        return f"AllocTag({str.__repr__(self)})"


AllocTag.UNTAGGED = AllocTag("untagged")


class Access(enum.Enum):
    """How a kernel or copy uses a block; decides which waits ``prepare_block_use`` queues and what
    ``finish_block_use`` records. Immutable; any thread."""

    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"

    @property
    def reads(self) -> bool:
        """True for ``READ`` and ``READ_WRITE``. Thread rule: any thread."""
        return self is not Access.WRITE

    @property
    def writes(self) -> bool:
        """True for ``WRITE`` and ``READ_WRITE``. Thread rule: any thread."""
        return self is not Access.READ


# The process-wide source of generation numbers (blocks.pxd): its count is incremented with the
# GIL held and no Python code in between, so it is atomic without a lock.
cdef GenerationSource _generations


class Generation(int):
    """Generation token of an allocation.

    ``Generation.next()`` is process-wide, thread-safe and strictly increasing, so an address that
    is freed and handed out again never carries the generation of its earlier life (the ABA
    guard). Immutable; any thread.
    """

    __slots__ = ()

    @staticmethod
    def next() -> Generation:
        """The next generation of the process, greater than every one handed out before.

        Returns:
            A new :class:`Generation`.
        Thread rule: any thread.
        """
        return next_generation()

    def __repr__(self) -> str:
        return f"Generation({int(self)})"


cdef object _Generation = Generation


cdef extern from *:
    """
    /* A new instance of `type`, an int subclass that adds no fields, equal to `value`, a
       positive exact int of `ndigits` digits: allocated by the type and given `value`'s body
       (size or tag, then digits) byte for byte. That body follows the object header in every
       CPython layout since 3.0 (ob_size then ob_digit; 3.12's lv_tag then ob_digit), and is
       tp_basicsize - sizeof(PyObject) + ndigits * tp_itemsize bytes long; the type call does
       the same copy after parsing its arguments and building a tuple (about 800 instructions
       against about 150). Checked against the type call when the module loads. */
    static PyObject *xa_int_like(PyObject *type_obj, PyObject *value, Py_ssize_t ndigits) {
        PyTypeObject *type = (PyTypeObject *)type_obj;
        PyObject *obj = type->tp_alloc(type, ndigits);
        if (obj == NULL) return NULL;
        memcpy((char *)obj + sizeof(PyObject), (char *)value + sizeof(PyObject),
               (size_t)(PyLong_Type.tp_basicsize - (Py_ssize_t)sizeof(PyObject)
                        + ndigits * PyLong_Type.tp_itemsize));
        return obj;
    }
    """
    object xa_int_like(object type, object value, Py_ssize_t ndigits)


cdef int _DIGIT_BITS = sys.int_info.bits_per_digit


cdef object _new_generation(unsigned long long n):
    cdef Py_ssize_t ndigits = 1
    while ndigits * _DIGIT_BITS < 64 and (n >> (ndigits * _DIGIT_BITS)) != 0:
        ndigits += 1
    return xa_int_like(_Generation, PyLong_FromUnsignedLongLong(n), ndigits)


cdef bint _copy_ok():
    # The copy is used only where it gives exactly what the type call gives, on this build.
    for n in (1, 255, 256, (1 << 30) - 1, 1 << 30, (1 << 60) + 12345, (1 << 64) - 1):
        made = _new_generation(n)
        want = _Generation(n)
        if type(made) is not _Generation or made != want or hash(made) != hash(want) or int(made) != n:
            return False
    return True


cdef bint _COPY_OK = _copy_ok()
_GENERATION_BY_COPY = _COPY_OK  # read by a test: the cheap construction is the one in use


cdef object next_generation():
    _generations.last += 1
    if _COPY_OK:
        return _new_generation(_generations.last)
    return _Generation(_generations.last)




cdef bint _set_ok():
    # The rewrite is used only where it gives exactly what the type call gives, on this build.
    for a, n in ((1, 2), (300, 255), (1 << 30, (1 << 31) - 1), ((1 << 60) + 1, (1 << 61) + 12345),
                 ((1 << 63), (1 << 64) - 1)):
        made = _Generation(a)
        if not xa_int_set(<PyObject*>made, n):
            return False
        want = _Generation(n)
        if made != want or hash(made) != hash(want) or int(made) != n or repr(made) != repr(want):
            return False
    made = _Generation(1)
    if xa_int_set(<PyObject*>made, 1 << 30) or made != 1:  # one digit more: refused, unchanged
        return False
    made = _Generation(1 << 30)
    if xa_int_set(<PyObject*>made, 5) or made != 1 << 30:  # one digit fewer: refused, unchanged
        return False
    return True


cdef bint _SET_OK = _set_ok()
_GENERATION_IN_PLACE = _SET_OK  # read by a test: a cache hit renews its block's generation in place


# Renewal in place (``renew_generation``, inlined where it is called) is switched on only here,
# once the rewrite was checked sound.
_generations.renewable = <PyObject*>_Generation if _SET_OK else NULL


cdef GenerationSource* generation_source() noexcept:
    return &_generations


class BlockState(enum.Enum):
    """Where a block is in its life: ``LIVE`` (handed out), ``RETIRED`` (its free is queued on a
    stream, not yet synchronized), ``FREED``. Immutable; any thread."""

    LIVE = "live"
    RETIRED = "retired"
    FREED = "freed"


cdef object _LIVE = BlockState.LIVE


# ``init=False`` and an ``__init__`` of our own: the field ``state`` has a default, and a default
# in the class body clashes with the field's declaration in blocks.pxd (Cython 3.3.0).
cdef class _Frozen:
    """The base of the frozen value types: assigning or deleting an attribute raises
    ``FrozenInstanceError``, as on a frozen dataclass (Cython's frozen flag raises a plain
    ``AttributeError``). Immutable; any thread."""

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")


@cython.dataclasses.dataclass(frozen=True, init=False)
cdef class DeviceBlock(_Frozen):
    """One allocation as a resource hands it out.

    Fields: ``ptr`` (device address), ``device_ordinal``, ``alloc_stream`` (the stream the
    allocation, and its free, are ordered on), ``nbytes`` (the size asked for), ``align`` (the
    alignment ``ptr`` is guaranteed), ``tag``, ``generation`` and ``state``.

    Immutable: deallocating does not change it; the resource's own map decides whether
    ``(ptr, generation)`` is still live. Any thread.
    """

    ptr: object
    device_ordinal: object
    alloc_stream: object
    nbytes: object
    align: object
    tag: object
    generation: object
    state: object
    __slots__ = ()

    def __init__(self, ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state=_LIVE):
        _fill(self, ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state)


cdef inline void _fill(DeviceBlock b, object ptr, object device_ordinal, object alloc_stream, object nbytes,
                       object align, object tag, object generation, object state) noexcept:
    # The one place a block's fields are written: its __init__ and new_block both call it.
    b.ptr = ptr
    b.device_ordinal = device_ordinal
    b.alloc_stream = alloc_stream
    b.nbytes = nbytes
    b.align = align
    b.tag = tag
    b.generation = generation
    b.state = state


cdef DeviceBlock new_block(object ptr, object device_ordinal, object alloc_stream, object nbytes,
                           object align, object tag, object generation, object state):
    cdef DeviceBlock b = DeviceBlock.__new__(DeviceBlock)
    _fill(b, ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state)
    return b


def make_block(ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state=_LIVE):
    """Build a :class:`DeviceBlock` without going through the dataclass ``__init__``.

    Args:
        ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state: the fields of
            :class:`DeviceBlock`, in its order.
    Returns:
        The new block, indistinguishable from ``DeviceBlock(...)``; nothing is checked.
    Thread rule: any thread.
    """
    return new_block(ptr, device_ordinal, alloc_stream, nbytes, align, tag, generation, state)


@cython.dataclasses.dataclass(frozen=True)
cdef class BlockId(_Frozen):
    """The identity of a block, enough to validate it against a resource's live map.
    Immutable; any thread."""

    ptr: object
    generation: object
    device_ordinal: object
    __slots__ = ()

    @staticmethod
    def from_block(block):
        """The identity of ``block``.

        Args:
            block: any block.
        Returns:
            ``BlockId(block.ptr, block.generation, block.device_ordinal)``.
        Thread rule: any thread.
        """
        cdef BlockId b = BlockId.__new__(BlockId)
        b.ptr = block.ptr
        b.generation = block.generation
        b.device_ordinal = block.device_ordinal
        return b


@cython.dataclasses.dataclass(frozen=True)
cdef class LiveBlock(_Frozen):
    """One live block as a resource lists it (``live_blocks()``) and a memory report shows it.

    The fields a report needs of a :class:`DeviceBlock` (``stream`` is its ``alloc_stream``),
    plus ``age_s``: seconds since the allocation, or None where the resource does not record
    allocation times. Immutable; any thread.
    """

    ptr: object
    nbytes: object
    tag: object
    stream: object
    age_s: object
    __slots__ = ()

    @staticmethod
    def of(block, age_s=None):
        """The entry of ``block``.

        Args:
            block: a live block.
            age_s: seconds since it was allocated, None where unknown.
        Returns:
            ``LiveBlock(block.ptr, block.nbytes, block.tag, block.alloc_stream, age_s)``.
        Thread rule: any thread.
        """
        return LiveBlock(block.ptr, block.nbytes, block.tag, block.alloc_stream, age_s)
