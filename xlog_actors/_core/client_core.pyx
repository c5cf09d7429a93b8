# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled fast paths of ``DeviceClient``: allocate and free in the calling thread on the
device's current context, with no Python frame between the caller and the resource.

The fast path runs when the device has a current context (the lifecycle's ``context`` is open
and its state's token unchanged) and, for a free, the handle is a plain handle of that context
not yet released. Everything else (no running context, a handle of another generation or device,
a subclass of the handle type) goes to the Python subclass's slow paths, ``_allocate_slow`` and
``_free_slow``, which hold the rules for those cases. Errors met on the fast path follow the
same rules as the Python client: a lost or poisoned context is reported to the device's
supervisor and raised; an error met while a rebuild took the context away is retried through the
actor (an allocation) or dropped (a free: the memory went with the context).

Thread rule: any thread but the device actor's own; any number at once.
"""

cimport cython

from types import MemberDescriptorType

from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF

from .context_core cimport ContextCore, context_current, context_release
from .handles cimport HandleCore

from ..errors import ContextLost, ContextPoisoned, CorruptionDetected, OutOfMemory
from .blocks import AllocTag, StreamId

__all__ = ["ClientCore"]

cdef object _DEFAULT_STREAM = StreamId.DEFAULT
cdef object _UNTAGGED = AllocTag.UNTAGGED
cdef tuple _CONTEXT_FAILURES = (ContextLost, ContextPoisoned)


cdef extern from "Python.h":
    # A slot's member descriptor: where in its instances the slot's object pointer lives.
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef extern from *:
    """
    /* The context's compiled allocate and free called through its vtable with their result left
       to the caller: a new reference, or NULL with the error set. Cython's own call of a method
       that may raise sits in a try on the hot path, and the try's entry saves the thread's
       handled-exception state (about 30 instructions); this way the common path enters none and
       a failure goes to a cold function that re-raises the error inside its own try. */
    #define xa_context_alloc(c, n, s, t) ((c)->__pyx_vtab->_alloc((c), (n), (s), (t)))
    #define xa_context_free(c, b) ((c)->__pyx_vtab->_free((c), (b)))
    /* -1 with the error set left as it is: raises the pending error where it is called. */
    static inline int xa_raise_pending(void) { return -1; }
    """
    PyObject* xa_context_alloc(ContextCore c, object nbytes, object stream, object tag) noexcept
    PyObject* xa_context_free(ContextCore c, object block) noexcept
    int xa_raise_pending() except -1


cdef extern from *:
    """
    /* A METH_FASTCALL|METH_KEYWORDS method's C function. */
    typedef PyObject *(*xa_fastcall_kw)(PyObject *, PyObject *const *, Py_ssize_t, PyObject *);
    /* Cython's own C functions of ``allocate`` and ``free`` (they parse keywords, and raise
       the argument errors), which the fast entries call for every call they do not take. */
    static xa_fastcall_kw xa_allocate_full = NULL;
    static xa_fastcall_kw xa_free_full = NULL;
    /* The fast entries' method definitions: name and flags here, function and doc at install. */
    static PyMethodDef xa_allocate_def = {"allocate", NULL, METH_FASTCALL | METH_KEYWORDS, NULL};
    static PyMethodDef xa_free_def = {"free", NULL, METH_FASTCALL | METH_KEYWORDS, NULL};

    /* Make `fast` the C function of type `t`'s method `def->ml_name`, where that is a plain
       method descriptor of a METH_FASTCALL|METH_KEYWORDS function (Cython's): a new descriptor
       of `def`, with the old one's doc (its signature line included), replaces it in the type's
       dict, and `*full` keeps the old C function. 1 when done; 0 when the method is of another
       kind (left as it is); -1 with an error set. Once, when the module loads. */
    static int xa_install_fast(PyTypeObject *t, PyMethodDef *def, xa_fastcall_kw fast, xa_fastcall_kw *full) {
        PyObject *old, *descr;
        PyMethodDef *was;
        old = PyDict_GetItemString(t->tp_dict, def->ml_name);  /* borrowed */
        if (old == NULL || Py_TYPE(old) != &PyMethodDescr_Type) return 0;
        was = ((PyMethodDescrObject *)old)->d_method;
        if (was->ml_flags != (METH_FASTCALL | METH_KEYWORDS)) return 0;
        *full = (xa_fastcall_kw)(void (*)(void))was->ml_meth;
        def->ml_meth = (PyCFunction)(void (*)(void))fast;
        def->ml_doc = was->ml_doc;
        descr = PyDescr_NewMethod(t, def);
        if (descr == NULL) return -1;
        if (PyDict_SetItemString(t->tp_dict, def->ml_name, descr) < 0) {
            Py_DECREF(descr);
            return -1;
        }
        Py_DECREF(descr);
        PyType_Modified(t);
        return 1;
    }
    #define xa_call_full(f, self, args, nargs, kwnames) ((f)((self), (args), (nargs), (kwnames)))
    """
    ctypedef object (*xa_fastcall_kw)(object, PyObject* const*, Py_ssize_t, PyObject*)
    xa_fastcall_kw xa_allocate_full
    xa_fastcall_kw xa_free_full
    ctypedef struct PyMethodDef:
        pass
    PyMethodDef xa_allocate_def
    PyMethodDef xa_free_def
    int xa_install_fast(PyTypeObject* t, PyMethodDef* d, xa_fastcall_kw fast, xa_fastcall_kw* full) except -1
    object xa_call_full(xa_fastcall_kw f, object client, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames)


cdef class ClientCore:
    """State and hot paths of a ``DeviceClient`` (see the module docstring).

    Thread rule: any thread but the device actor's own.
    """

    cdef readonly object _cell
    cdef object _lifecycle
    cdef Py_ssize_t _context_offset  # of the lifecycle's ``_context`` slot; 0: read ``context``
    cdef type _handle_type
    cdef type _context_type  # the last context's type found to be a ContextCore: a pointer compare

    def __init__(self, cell, handle_type):
        """Args:
            cell: what the client shares with its device actor (``lifecycle``,
                ``report_failure``, ...).
            handle_type: the handle class the device hands out (``GpuRef``).
        Thread rule: any thread.
        """
        self._cell = cell
        self._lifecycle = cell.lifecycle
        # ``DeviceLifecycle.context`` is a property returning its ``_context`` slot: read the
        # slot itself, at the offset its member descriptor gives, instead of calling the
        # property's Python function (about 450 instructions per read) or looking the slot up
        # (about 140). The lifecycle object never changes, so neither does its type's layout.
        # A lifecycle of another shape is read through ``context``.
        descriptor = getattr(type(self._lifecycle), "_context", None)
        self._context_offset = 0
        if type(descriptor) is MemberDescriptorType:
            self._context_offset = (<PyMemberDescrObject*><PyObject*>descriptor).d_member.offset
        self._handle_type = handle_type

    cdef inline object _running_context(self):
        cdef PyObject* found
        if self._context_offset:
            found = (<PyObject**>((<char*><PyObject*>self._lifecycle) + self._context_offset))[0]
            return None if found == NULL else <object>found  # NULL: the slot was never set
        return self._lifecycle.context

    @cython.binding(False)
    def allocate(self, nbytes, stream=_DEFAULT_STREAM, tag=_UNTAGGED):
        """Allocate one block, as ``Allocate`` does, in the calling thread.

        Args:
            nbytes: a positive int.
            stream: the stream the allocation is ordered on.
            tag: what the allocation is for (statistics group by it).
        Returns:
            a ``GpuRef`` of the device's current generation.
        Raises:
            InvalidRequest, OutOfMemory, StreamMisuse, ContextPoisoned, DeviceUnavailable: as
            ``Allocate`` (a lost or poisoned context is also reported to the device's supervisor).
        Thread rule: any thread but the device actor's own.
        """
        return self._allocate(nbytes, stream, tag)

    cdef inline object _allocate(self, object nbytes, object stream, object tag):
        # ``allocate``'s body, also called by its fast entry (see the end of the module).
        cdef ContextCore core
        cdef PyObject* made
        ctx = self._running_context()
        if self._is_core(ctx):
            core = <ContextCore>ctx
            if context_current(core):
                made = xa_context_alloc(core, nbytes, stream, tag)
                if made == NULL:
                    return self._alloc_failed(core, nbytes, stream, tag)
                ref = <object>made
                Py_DECREF(ref)  # the new reference ``made`` came with: ``ref`` now holds it
                if context_current(core):
                    return ref
        return self._allocate_slow(nbytes, stream, tag)

    cdef object _alloc_failed(self, ContextCore core, object nbytes, object stream, object tag):
        # The allocation's error rules (see the module docstring), with the context's error set.
        try:
            xa_raise_pending()
        except _CONTEXT_FAILURES as exc:
            self._cell.report_failure(exc, core.generation)
            raise
        except BaseException as exc:
            if context_current(core):
                if isinstance(exc, OutOfMemory):
                    raise core._out_of_memory(exc) from None  # the stack's figures added
                raise
        return self._allocate_slow(nbytes, stream, tag)

    cdef inline bint _is_core(self, object ctx) except -1:
        # ``isinstance(ctx, ContextCore)``, remembered by type: a device's contexts are all of one
        # class, so after the first a pointer compare says it (the check walked the MRO).
        if type(ctx) is self._context_type:
            return True
        if isinstance(ctx, ContextCore):
            self._context_type = type(ctx)
            return True
        return False

    @cython.binding(False)
    def free(self, ref):
        """Free ``ref`` now, in this thread. Idempotent, like the ``Free`` message.

        Args:
            ref: a ``GpuRef`` of this device (an older generation's is a no-op).
        Raises:
            InvalidRequest: not a ``GpuRef``, or a handle of another device actor.
            CorruptionDetected: a guard found its canaries overwritten (the block is freed anyway).
            ContextLost, ContextPoisoned: met while freeing (reported to the supervisor too).
        Thread rule: any thread but the device actor's own.
        """
        return self._free(ref)

    cdef inline object _free(self, object ref):
        # ``free``'s body, also called by its fast entry (see the end of the module).
        cdef ContextCore core
        cdef HandleCore handle
        cdef PyObject* done
        cdef int freed
        if type(ref) is not self._handle_type:
            return self._free_slow(ref)
        handle = <HandleCore>ref
        ctx = self._running_context()
        if ctx is None or handle._context is not ctx or not self._is_core(ctx):
            return self._free_slow(ref)
        core = <ContextCore>ctx
        if not context_current(core):
            return self._free_slow(ref)
        if handle._released:
            return None  # freed already: idempotent
        handle._released = True  # claimed: of racing frees of one handle exactly one gets here
        # The block borrowed: the handle holds it (only its drop or its making write the field).
        freed = context_release(core, <PyObject*>handle._block)
        if freed == -2:
            done = xa_context_free(core, handle._block)
            if done == NULL:
                return self._free_failed(core, handle)
            Py_DECREF(<object>done)
        elif freed < 0:
            return self._free_failed(core, handle)
        return None

    cdef object _free_failed(self, ContextCore core, HandleCore handle):
        # The free's error rules (see the module docstring), with the context's error set.
        try:
            xa_raise_pending()
        except CorruptionDetected:
            raise  # the guard freed the block before it reported: the handle stays released
        except BaseException as exc:
            is_context_failure = isinstance(exc, _CONTEXT_FAILURES)
            if not context_current(core) and not is_context_failure:
                return None  # a rebuild took the context, and the memory, away under this call
            handle._released = False
            if is_context_failure:
                self._cell.report_failure(exc, core.generation)
            raise
        return None


# -- the fast entries of allocate and free ------------------------------------------------------
#
# Cython's C function of a method with keyword arguments parses every call in full: it lays out
# an array of the keyword names, takes a reference to each argument and gives it back at the end
# (about 40 instructions of an allocate, 20 of a free). The fast entries below take a call with
# positional arguments only, the client's every call in practice, straight to the method's body,
# the arguments borrowed from the caller as any C function's are; any other call (keywords, a
# wrong count) goes to Cython's own function, unchanged: its parsing, its errors. They are made
# the type's ``allocate`` and ``free`` once, when the module loads (a method descriptor of a
# static method definition, in the type's dict, with Cython's doc: ``help()`` reads the same).

cdef object _allocate_entry(object client, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames):
    cdef PyObject* nbytes
    cdef PyObject* stream
    cdef PyObject* tag
    if kwnames != NULL or nargs < 1 or nargs > 3:
        return xa_call_full(xa_allocate_full, client, args, nargs, kwnames)
    nbytes = args[0]
    stream = args[1] if nargs > 1 else <PyObject*>_DEFAULT_STREAM
    tag = args[2] if nargs > 2 else <PyObject*>_UNTAGGED
    return (<ClientCore>client)._allocate(<object>nbytes, <object>stream, <object>tag)


cdef object _free_entry(object client, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames):
    cdef PyObject* ref
    if kwnames != NULL or nargs != 1:
        return xa_call_full(xa_free_full, client, args, nargs, kwnames)
    ref = args[0]
    return (<ClientCore>client)._free(<object>ref)


_FAST_ENTRIES = (  # the entries installed: 2
    xa_install_fast(<PyTypeObject*>ClientCore, &xa_allocate_def, <xa_fastcall_kw>_allocate_entry, &xa_allocate_full)
    + xa_install_fast(<PyTypeObject*>ClientCore, &xa_free_def, <xa_fastcall_kw>_free_entry, &xa_free_full)
)
