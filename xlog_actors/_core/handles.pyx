# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled state of a ``GpuRef``: its fields, its validation fast path and its release flag.

``GpuRef`` (:mod:`xlog_actors.actors.gpu_ref`) is a Python subclass that adds the facts, the
lifetime hooks and the interop exports; this base holds what every ``access()`` and every
allocation touches, so that a validation is a few C field loads (the state's
:class:`TokenCell`, the token, the released flag, the weak reference) with no Python attribute
lookup, and a handle is built without a Python constructor and dropped without a Python
finalizer (see "the handle's life" below). A handle keeps its state's cell strongly and the state
weakly: the cell is a few bytes, and the state's death still shows.

Invariants: every field but ``_token``, ``_last_write`` and ``_released`` is fixed at
construction. ``_token`` is the device state's token the handle was last validated against; it
is refreshed (never invalidated) by the subclass's ``_stale`` when the token moved for a reason
that leaves the handle valid. ``_released`` only flips through ``_mark_released`` (False -> True,
exactly once per successful free) and back through ``_unmark_released`` after a failed free. A
handle dropped unreleased hands its block to its context's ``reclaim`` (on whatever thread drops
it, a collector's included), in a reference cycle too.

Thread rule: any thread. ``_mark_released`` reads and writes the flag with the GIL held and no
Python code in between, so of many threads releasing one handle exactly one wins, without a lock.

The module runs past 400 lines because a handle's making and its drop (the pool, the deallocator,
the collector's hand-over) rely on the fields and invariants above, and are read beside them.
"""

cimport cython
from cpython.exc cimport PyErr_Fetch, PyErr_Occurred, PyErr_Restore
from cpython.object cimport PyObject, PyTypeObject, destructor
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.type cimport PyType_IsSubtype
from cpython.weakref cimport PyWeakref_GetObject

from .blocks import StreamId

__all__ = ["HandleCore", "TokenCell", "fail_a_make", "make_handle"]


cdef class TokenCell:
    """The device state's current token, in a C field: what every ``access()`` compares its
    handle's token with. The state owns one cell for its whole life and puts a new token in it on
    every status change (rebuild, shutdown, poisoning); handles keep the cell itself, so the check
    is two C field loads instead of an attribute lookup on the state.

    Thread rule: any thread; the state writes ``token`` under its lock, readers load it once.
    """

    def __init__(self, token=None):
        """Args:
            token: the first token (a fresh object when None).
        """
        self.token = object() if token is None else token


# A cell no handle's token ever matches: the one handles take when their state is already gone.
cdef TokenCell _DEAD_CELL = TokenCell()


@cython.no_gc_clear  # a handle in a cycle keeps its fields until its drop hands its free over
cdef class HandleCore:
    """Fields and hot paths of a ``GpuRef`` (see the module docstring). Not made directly:
    :func:`make_handle` builds instances of a subclass.

    Thread rule: any thread.
    """

    # A plain method descriptor, not a Cython function object: a call (bound or not) then reaches
    # the C function in one step, about 200 of the 480 instructions a call from a loop cost.
    # (Measured for this class's methods with arguments, they lost more than they gained, so only
    # this one; the client's and the cache's allocate and free gained, measured the same way.)
    @cython.binding(False)
    def access(self):
        """Validate the handle: the device state still exists, accepts operations, is not
        poisoned, its generation is unchanged and the handle was not released.

        Returns:
            the block, safe to use until the device's next status change.
        Raises:
            GpuRefStale: with the first reason that applies (built by the subclass's ``_stale``).
        Thread rule: any thread.
        """
        # The fast path: the state's cell (a C field) holds the current token, and the weak
        # reference is read in C without a call; no Python attribute lookup.
        if self._cell.token is self._token and not self._released \
                and <object>PyWeakref_GetObject(self._state) is not None:
            return self._block
        error = self._stale(<object>PyWeakref_GetObject(self._state))
        if error is None:
            return self.access()
        raise error

    def _refresh_token(self, token):
        """Adopt ``token`` as the one last validated against (the subclass's ``_stale`` calls it
        when the token moved for a reason that leaves the handle valid)."""
        self._token = token

    def record_write(self, stream_id):
        """Record that work on ``stream_id`` wrote this memory (library actors call it after
        enqueueing).

        Args:
            stream_id: the writing stream's id.
        Thread rule: any thread; the last call wins.
        """
        self._last_write = StreamId(stream_id)

    def _mark_released(self):
        """True for the one caller that flips the handle to released (see the module docstring)."""
        if self._released:
            return False
        self._released = True
        return True

    def _unmark_released(self):
        """Undo ``_mark_released`` after a free that failed: the handle stays usable."""
        self._released = False


# -- the handle's life: made from a pool, and its drop -------------------------------------------
#
# A handle is made and dropped once per allocation, so both are cut to C work. Its drop is
# ``_handle_dealloc``, installed as the handle type's ``tp_dealloc``: it hands the free of a
# handle that was not released to its context (``reclaim``, never a driver call, as the module
# docstring of ``context_core`` says) and puts the memory in a pool that the next handle is made
# from. It replaces, for the handle types the core makes (``_adopt``), CPython's generic
# deallocator of a Python subclass (``subtype_dealloc``) and the finalizer (``__del__``) that
# did the hand-over before, which together were about 480 instructions a drop; the allocator's
# malloc and free, about 230 more, are what the pool saves (it serves the first type adopted,
# ``GpuRef``; another adopted type gets the drop without the pool). A type is adopted only when it adds
# nothing to ``HandleCore``'s layout (no ``__dict__``, no slots: ``GpuRef`` has ``__slots__ =
# ()``) and has no finalizer of its own; any other subclass keeps the generic deallocator, which
# ends in ``HandleCore``'s own ``tp_dealloc``, ``_handle_dealloc`` too, so every handle's drop
# hands its free over.
#
# A handle in a garbage cycle is handed over by the collector, through ``tp_finalize``
# (``_handle_finalize``): the collector runs every finalizer of the cycle before it clears any of
# its members (PEP 442), so the context and the block the hand-over reads are still whole. Left
# to the drop, which comes after the clearing, it would find them cleared (a context's slots
# gone, a block's fields None) and the free would be lost: an isolated device would keep blocks
# whose handles are gone. A handle the collector handed over is marked released, so its drop
# hands nothing over again, and it never goes to the pool (the collector keeps its finalized mark
# in the object's header, where a handle made from it would inherit it). The drop of a handle whose
# last reference goes (the usual case) calls no finalizer: it hands over itself. ``HandleCore``
# is also ``no_gc_clear``, so a handle keeps its fields until its drop. The pool is a C array used
# with the GIL held and no Python code between its reads and writes; a build without a GIL has no
# pool.

cdef extern from *:
    """
    /* An instance of `cls`, a subclass of `base`, made by `base`'s own tp_new (the C allocator,
       which bypasses the subclass's refusing __new__): what `base.__new__(cls)` does, without
       looking `__new__` up and calling it through Python (about 800 instructions). The caller
       checked that `cls` is a subclass of `base`. */
    static PyObject *xa_new_as(PyObject *base, PyObject *cls, PyObject *no_args) {
        return ((PyTypeObject *)base)->tp_new((PyTypeObject *)cls, no_args, NULL);
    }

    #ifdef Py_GIL_DISABLED
    #define XA_POOL_SIZE 0
    #else
    #define XA_POOL_SIZE 64
    #endif
    /* Dropped handles' memory, each an untracked object of refcount 0 whose fields hold None
       but the few small ones ``_clear`` keeps, and the one type whose handles it serves (the
       first adopted: GpuRef). */
    static PyObject *xa_pool[XA_POOL_SIZE > 0 ? XA_POOL_SIZE : 1];
    static int xa_pooled = 0;
    static PyTypeObject *xa_pool_type = NULL;
    static Py_ssize_t xa_handle_size = 0;  /* HandleCore's tp_basicsize, set when the module loads */

    /* HandleCore's own finalizer (the collector's hand-over), set when the module loads. */
    static destructor xa_handle_finalize = NULL;

    /* True when instances of `t` are laid out as HandleCore's, with no finalizer but
       HandleCore's own: a type whose handles may come from a pool and go back to it. */
    static inline int xa_layout_plain(PyTypeObject *t) {
        return XA_POOL_SIZE > 0 && t->tp_basicsize == xa_handle_size && t->tp_itemsize == 0
               && t->tp_dictoffset == 0 && t->tp_finalize == xa_handle_finalize && t->tp_del == NULL;
    }
    static inline int xa_finalized(PyObject *o) { return PyObject_GC_IsFinalized(o); }
    static inline void xa_set_finalize(PyTypeObject *t, destructor f) { xa_handle_finalize = f; t->tp_finalize = f; }
    /* A subclass does not inherit tp_finalize from a static base (CPython 3.11 checks the
       finalize flag): give one with none the collector's hand-over. */
    static inline void xa_ensure_finalize(PyTypeObject *t) {
        if (t->tp_finalize == NULL) t->tp_finalize = xa_handle_finalize;
    }
    static inline int xa_poolable(PyTypeObject *t) { return t == xa_pool_type; }

    /* A pooled object made an instance of `t` (refcount 1, tracked by the collector, fields as
       ``_clear`` left them), or NULL when the pool is empty or `t` is not the pool's type. */
    static inline PyObject *xa_pool_take(PyTypeObject *t) {
        PyObject *o;
        if (xa_pooled == 0 || !xa_poolable(t)) return NULL;
        o = xa_pool[--xa_pooled];
        PyObject_Init(o, t);  /* the type, a reference to it when it is a heap type, refcount 1 */
        PyObject_GC_Track(o);
        return o;
    }

    /* Keep `o` (refcount 0, untracked, fields cleared by ``_clear``) for the next handle; 0 when
       the pool is full or its type is not poolable. */
    static inline int xa_pool_put(PyObject *o) {
        if (xa_pooled >= XA_POOL_SIZE || !xa_poolable(Py_TYPE(o))) return 0;
        xa_pool[xa_pooled++] = o;
        return 1;
    }

    static inline void xa_clear_weakrefs(PyObject *o) {
        PyTypeObject *t = Py_TYPE(o);
        if (t->tp_weaklistoffset > 0) {
            if (*(PyObject **)((char *)o + t->tp_weaklistoffset) != NULL) PyObject_ClearWeakRefs(o);
        } else if (t->tp_weaklistoffset != 0) {
            PyObject_ClearWeakRefs(o);
        }
    }

    static inline void xa_set_refcnt(PyObject *o, Py_ssize_t n) { Py_SET_REFCNT(o, n); }
    static inline Py_ssize_t xa_refcnt(PyObject *o) { return Py_REFCNT(o); }
    static inline PyTypeObject *xa_type(PyObject *o) { return Py_TYPE(o); }
    static inline void xa_gc_track(PyObject *o) { PyObject_GC_Track(o); }
    static inline void xa_gc_untrack(PyObject *o) { PyObject_GC_UnTrack(o); }
    static inline int xa_is_heap(PyTypeObject *t) { return (t->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0; }
    """
    PyObject* xa_new_as(object base, object cls, object no_args) except NULL
    int XA_POOL_SIZE
    Py_ssize_t xa_handle_size
    PyTypeObject* xa_pool_type
    bint xa_layout_plain(PyTypeObject* t) noexcept
    bint xa_poolable(PyTypeObject* t) noexcept
    PyObject* xa_pool_take(PyTypeObject* t) noexcept
    bint xa_pool_put(PyObject* o) noexcept
    void xa_clear_weakrefs(PyObject* o) noexcept
    void xa_set_refcnt(PyObject* o, Py_ssize_t n) noexcept
    Py_ssize_t xa_refcnt(PyObject* o) noexcept
    PyTypeObject* xa_type(PyObject* o) noexcept
    void xa_gc_track(PyObject* o) noexcept
    void xa_gc_untrack(PyObject* o) noexcept
    bint xa_is_heap(PyTypeObject* t) noexcept
    bint xa_finalized(PyObject* o) noexcept
    void xa_set_finalize(PyTypeObject* t, destructor f) noexcept
    void xa_ensure_finalize(PyTypeObject* t) noexcept


cdef tuple _NO_ARGS = ()
cdef destructor _core_dealloc = (<PyTypeObject*>HandleCore).tp_dealloc  # Cython's: clears the fields, frees
xa_handle_size = (<PyTypeObject*>HandleCore).tp_basicsize


cdef void _hand_over(PyObject* o) noexcept:
    # The drop's Python part, on a handle kept alive for it (refcount 1): a handle that was not
    # released hands its block to its context's reclaim queue.
    cdef HandleCore ref = <HandleCore>o
    if not ref._released and ref._context is not None:
        try:
            ref._context.reclaim(ref._block)
        except Exception:
            pass  # at interpreter exit pykka may be gone: nothing leaks then, the process ends


cdef void _clear(PyObject* o) noexcept:
    # The fields of a handle going to the pool that could keep a device's memory or its context
    # alive: None. The generation, the weak reference to the state, the token and the state's
    # cell stay: small objects that keep nothing else alive (the state is held weakly), and the
    # next handle, most often of the same context, then rewrites none of them.
    cdef HandleCore ref = <HandleCore>o
    ref._block = None
    ref._context = None
    ref._last_write = None
    ref._released = False


cdef void _handle_finalize(PyObject* o) noexcept:
    # tp_finalize: the collector's hand-over of a handle in a garbage cycle, before it clears any
    # member of the cycle (see the section's comment); the drop that follows hands nothing over.
    cdef PyObject* exc_type = NULL
    cdef PyObject* exc_value = NULL
    cdef PyObject* exc_tb = NULL
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb)
    _hand_over(o)
    (<HandleCore>o)._released = True
    PyErr_Restore(exc_type, exc_value, exc_tb)


cdef void _handle_dealloc(PyObject* o) noexcept:
    # tp_dealloc of HandleCore and of the types ``_adopt`` took: see the section's comment. A
    # subclass that keeps CPython's generic drop reaches it as its base's drop, after the generic
    # one ran the finalizer (which handed over) and before it lets the type go itself.
    cdef PyTypeObject* t = xa_type(o)
    cdef PyObject* exc_type = NULL
    cdef PyObject* exc_value = NULL
    cdef PyObject* exc_tb = NULL
    cdef bint saved = PyErr_Occurred() != NULL
    cdef bint own = t.tp_dealloc == _handle_dealloc  # not a generic drop's base call
    cdef bint poolable = xa_poolable(t) and not xa_finalized(o)
    xa_gc_untrack(o)
    xa_clear_weakrefs(o)  # before any Python code runs: nothing can reach the handle again
    xa_set_refcnt(o, 1)
    if saved:
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb)  # a drop may happen while an error is set
    if not (<HandleCore>o)._released:  # a freed handle (the usual drop) makes no call
        _hand_over(o)
    if xa_refcnt(o) == 1 and poolable:
        _clear(o)
    if saved:
        PyErr_Restore(exc_type, exc_value, exc_tb)
    if xa_refcnt(o) != 1:
        # Resurrected by the hand-over's Python code (it is never given the handle, so only
        # through a C extension): it lives on, with its own reference to its type.
        xa_set_refcnt(o, xa_refcnt(o) - 1)
        xa_gc_track(o)
        return
    xa_set_refcnt(o, 0)
    if not (poolable and xa_pool_put(o)):
        _core_dealloc(o)
    if own and xa_is_heap(t):
        Py_DECREF(<object>(<PyObject*>t))  # what the generic deallocator does for an instance of a heap type


(<PyTypeObject*>HandleCore).tp_dealloc = _handle_dealloc
xa_set_finalize(<PyTypeObject*>HandleCore, <destructor>_handle_finalize)
_probe = type("_Probe", (HandleCore,), {"__slots__": ()})  # a plain Python subclass: CPython's generic drop
cdef destructor _generic_dealloc = (<PyTypeObject*>_probe).tp_dealloc
del _probe


cdef int _adopt(type cls) except -1:
    # Make ``_handle_dealloc`` the drop of ``cls`` when it is a plain heap subclass of HandleCore
    # with the generic deallocator (a Python class that adds nothing: see the section's comment).
    global xa_pool_type
    cdef PyTypeObject* t = <PyTypeObject*>cls
    xa_ensure_finalize(t)  # the collector's hand-over, for every handle type (see the section's comment)
    if t.tp_dealloc == _generic_dealloc and xa_layout_plain(t):
        t.tp_dealloc = _handle_dealloc
        if xa_pool_type == NULL:
            Py_INCREF(cls)  # kept for the process: no other type may come to have its address
            xa_pool_type = t
    return 0


cdef HandleCore new_handle(type cls, object block, object context):
    state_ref = context.state_ref
    generation, token, cell = context.generation, context.token, cell_of(state_ref())
    return new_handle_with(<PyObject*>cls, block, context, <PyObject*>generation, <PyObject*>state_ref,
                           <PyObject*>token, <PyObject*>cell)


cdef TokenCell cell_of(object state):
    """The token cell of ``state`` (a ``DeviceState``), or a dead one when the state is gone."""
    return _DEAD_CELL if state is None else <TokenCell?>state.cell


cdef HandleCore new_handle_with(PyObject* cls, object block, object context, PyObject* generation,
                                PyObject* state_ref, PyObject* token, PyObject* cell):
    # The fields are borrowed: the caller's own references (a context's fields, fixed for its
    # life, or its locals), so its call takes and gives none (ten reference counts a handle).
    # From a pool nothing runs Python code before they are stored; a new object is allocated,
    # which may run a collection and so Python code, so they are held across it.
    cdef HandleCore ref
    cdef PyObject* found
    if <PyTypeObject*>cls != xa_pool_type:  # the pool's type: a subclass, adopted already
        if not PyType_IsSubtype(<type>cls, HandleCore):
            raise TypeError(f"make_handle: {(<object>cls).__name__} is not a subclass of HandleCore")
        if (<PyTypeObject*>cls).tp_dealloc != _handle_dealloc:
            _adopt(<type>cls)  # once per type; a type it does not take is checked again, each time
    found = xa_pool_take(<PyTypeObject*>cls)
    if found == NULL:
        return _new_handle(cls, block, context, generation, state_ref, token, cell)
    ref = <HandleCore>found
    Py_DECREF(ref)  # the new reference ``found`` came with: ``ref`` now holds it
    _fill(ref, block, context, generation, state_ref, token, cell)
    return ref


cdef HandleCore _new_handle(PyObject* cls, object block, object context, PyObject* generation,
                            PyObject* state_ref, PyObject* token, PyObject* cell):
    # ``new_handle_with`` with the pool empty: a new object, which may fail (no memory). The
    # block was allocated for this handle and only its context knows where it goes back, so a
    # context with an ``_unmade(block)`` method takes it back before the error goes on: the
    # failed allocation then leaves nothing allocated, tracked or counted. The allocation may run
    # a collection and so Python code, so the borrowed fields are held across it.
    cdef HandleCore ref
    cdef PyObject* found
    held = (<object>cls, <object>generation, <object>state_ref, <object>token, <object>cell)
    try:
        if _makes_to_pass >= 0:
            _a_make()
        found = xa_new_as(HandleCore, <object>cls, _NO_ARGS)
    except BaseException:
        unmade = getattr(context, "_unmade", None)
        if unmade is not None:
            unmade(block)
        raise
    ref = <HandleCore>found
    Py_DECREF(ref)  # the new reference ``found`` came with: ``ref`` now holds it
    _fill(ref, block, context, generation, state_ref, token, cell)
    del held
    return ref


cdef Py_ssize_t _makes_to_pass = -1


cdef int _a_make() except -1:
    global _makes_to_pass
    if _makes_to_pass == 0:
        _makes_to_pass = -1
        raise MemoryError("fault injection: no memory for a new handle (handles.fail_a_make)")
    _makes_to_pass -= 1
    return 0


def fail_a_make(Py_ssize_t after=0):
    """Fault injection for tests: of the handles made from now on that the pool cannot serve
    (a new object each), the one after ``after`` such makes raises ``MemoryError``, as when no
    memory is left for a new object (once: the makes after it succeed); ``after=-1`` disarms it.

    Args:
        after: how many such makes succeed first.
    Thread rule: any thread, with the GIL.
    """
    global _makes_to_pass
    _makes_to_pass = after


cdef inline void _fill(HandleCore ref, object block, object context, PyObject* generation,
                       PyObject* state_ref, PyObject* token, PyObject* cell) noexcept:
    # A new handle's fields. Made fresh or taken from the pool, it holds None in the block, the
    # context and the last write and is not released (see ``_clear``); a pooled one kept the
    # rest, written only where they differ.
    ref._block = block
    if <PyObject*>ref._generation != generation:
        ref._generation = <object>generation
    if <PyObject*>ref._state != state_ref:
        ref._state = <object>state_ref
    if <PyObject*>ref._token != token:
        ref._token = <object>token
    if <PyObject*>ref._cell != cell:
        ref._cell = <TokenCell>cell
    ref._context = context


def make_handle(cls, block, context):
    """A new handle of ``cls`` (a subclass of :class:`HandleCore`) for ``block``, made in
    ``context`` (whose ``generation``, ``state_ref`` and ``token`` it takes).

    Args:
        cls: the handle class.
        block: the allocation.
        context: the device context of the generation it belongs to.
    Returns:
        The handle, unreleased, with no recorded write.
    Thread rule: any thread.
    """
    return new_handle(cls, block, context)
