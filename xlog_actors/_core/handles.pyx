# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled state of a ``GpuRef``: its fields, its validation fast path and its release flag.

``GpuRef`` (:mod:`xlog_actors.actors.gpu_ref`) is a Python subclass that adds the facts, the
lifetime hooks and the interop exports; this base holds what every ``access()`` and every
allocation touches, so that a validation is a few C field loads (the state's
:class:`TokenCell`, the token, the released flag, the weak reference) with no Python attribute
lookup, and a handle is built without a Python constructor. A handle keeps its state's cell
strongly and the state weakly: the cell is a few bytes, and the state's death still shows.

Invariants: every field but ``_token``, ``_last_write`` and ``_released`` is fixed at
construction. ``_token`` is the device state's token the handle was last validated against; it
is refreshed (never invalidated) by the subclass's ``_stale`` when the token moved for a reason
that leaves the handle valid. ``_released`` only flips through ``_mark_released`` (False -> True,
exactly once per successful free) and back through ``_unmark_released`` after a failed free.

Thread rule: any thread. ``_mark_released`` reads and writes the flag with the GIL held and no
Python code in between, so of many threads releasing one handle exactly one wins, without a lock.
"""

cimport cython
from cpython.type cimport PyType_IsSubtype
from cpython.weakref cimport PyWeakref_GetObject

from .blocks import StreamId

__all__ = ["HandleCore", "TokenCell", "make_handle"]


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


cdef class HandleCore:
    """Fields and hot paths of a ``GpuRef`` (see the module docstring). Not made directly:
    :func:`make_handle` builds instances of a subclass.

    Thread rule: any thread.
    """

    # A plain method descriptor, not a Cython function object: a call (bound or not) then reaches
    # the C function in one step, about 200 of the 480 instructions a call from a loop cost.
    # (Methods with arguments lost more than they gained this way, so only this one.)
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

    def __del__(self):
        # The last reference went: hand the free to the device (its context queues it for the
        # actor; never a driver call here, on whatever thread the collector runs).
        if not self._released:
            try:
                self._context.reclaim(self._block)
            except Exception:
                pass  # at interpreter exit pykka may be gone: nothing leaks then, the process ends


cdef extern from *:
    """
    /* An instance of `cls`, a subclass of `base`, made by `base`'s own tp_new (the C allocator,
       which bypasses the subclass's refusing __new__): what `base.__new__(cls)` does, without
       looking `__new__` up and calling it through Python (about 800 instructions). The caller
       checked that `cls` is a subclass of `base`. */
    static PyObject *xa_new_as(PyObject *base, PyObject *cls, PyObject *no_args) {
        return ((PyTypeObject *)base)->tp_new((PyTypeObject *)cls, no_args, NULL);
    }
    """
    object xa_new_as(object base, object cls, object no_args)


cdef tuple _NO_ARGS = ()


cdef HandleCore new_handle(type cls, object block, object context):
    state_ref = context.state_ref
    return new_handle_with(cls, block, context, context.generation, state_ref, context.token, cell_of(state_ref()))


cdef TokenCell cell_of(object state):
    """The token cell of ``state`` (a ``DeviceState``), or a dead one when the state is gone."""
    return _DEAD_CELL if state is None else <TokenCell?>state.cell


cdef HandleCore new_handle_with(type cls, object block, object context, object generation, object state_ref,
                                object token, TokenCell cell):
    cdef HandleCore ref
    if not PyType_IsSubtype(cls, HandleCore):
        raise TypeError(f"make_handle: {cls.__name__} is not a subclass of HandleCore")
    ref = <HandleCore>xa_new_as(HandleCore, cls, _NO_ARGS)
    ref._block = block
    ref._generation = generation
    ref._state = state_ref
    ref._token = token
    ref._cell = cell
    ref._context = context
    ref._last_write = None
    ref._released = False
    return ref


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
