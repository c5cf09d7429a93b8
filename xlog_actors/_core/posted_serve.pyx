# cython: language_level=3, boundscheck=False, wraparound=False
"""A library actor's posted asks of its commonest messages served in one C call.

A pipeline's orchestrator sends every stage of every batch as a non-blocking ask that the library
actor serves in the orchestrator's thread while it is idle (``served_ref``). Through Python that
is about nine frames an ask before the enqueue itself: the ref's ``serve_posted``, the actor's
``posts_in_caller`` and ``_enqueue_only``, ``serve_in_caller`` with its lock and state checks,
``on_receive``, the message's handler, ``_compiled``. :class:`PostedServe` makes the same checks
and the same compiled call (``EnqueueCore``) in C for the message kinds its actor names: a copy in
from a pinned buffer, a copy back into one, a launch.

Anything else (another kind, an operand the compiled path does not take, an NVTX tracer on, an
actor not attached or not tracking) goes to the actor's Python path unchanged, which also raises
every precise error: this class decides nothing the Python path would decide otherwise.

Invariants, the same as ``served_ref``'s: a message is served here only holding the actor's
``exclusive`` lock, after the actor started and before it stopped, with no message queued or
being served; an error of the compiled call is raised as the actor's handler raises it
(``LibraryActor._compiled_failed``: a rebuild in the middle is a stale handle, a lost or poisoned
context is reported to the device's supervisor first).

Thread rule: any thread (the lock serializes the serving).
"""

__all__ = ["PostedServe"]


cdef class PostedServe:
    """``serve(message)``, as ``ServedRef.serve_posted`` (see the module docstring).

    Thread rule: any thread.
    """

    cdef object _actor
    cdef object _slow
    cdef object _not_served
    cdef object _ranges
    cdef type _to_device_t
    cdef type _to_host_t
    cdef type _launch_t
    cdef type _pinned_t
    cdef type _done_t

    def __init__(self, actor, slow, not_served, ranges, kinds, type pinned_type, type done_type,
                 type to_device_type, type to_host_type, type launch_type):
        """Args:
            actor: a weak reference to the ``LibraryActor``.
            slow: the Python path, ``ServedRef.serve_posted``'s: ``slow(message)`` returns the
                reply or ``not_served``.
            not_served: ``served_ref.NOT_SERVED``.
            ranges: the ``actors.ranges`` module (its ``RANGES`` is read at every call).
            kinds: the message types served here (those of the three below the actor handles
                on its compiled path).
            pinned_type: ``PinnedBuffer``; done_type: ``CopyDone``.
            to_device_type, to_host_type, launch_type: ``CopyToDevice``, ``CopyToHost``,
                ``Launch``.
        Thread rule: any thread.
        """
        self._actor = actor
        self._slow = slow
        self._not_served = not_served
        self._ranges = ranges
        self._pinned_t = pinned_type
        self._done_t = done_type
        self._to_device_t = to_device_type if to_device_type in kinds else None
        self._to_host_t = to_host_type if to_host_type in kinds else None
        self._launch_t = launch_type if launch_type in kinds else None

    def __call__(self, message):
        """Serve ``message`` in this thread when it may be: its reply, else ``not_served``.

        Raises:
            the handler's error, as the actor would answer it.
        Thread rule: any thread.
        """
        cdef type kind = type(message)
        actor = self._actor()
        if actor is None:
            return self._not_served
        if actor._core is None or self._ranges.RANGES is not None:
            return self._slow(message)
        if kind is self._to_device_t:
            if type(message.data) is not self._pinned_t:
                return self._slow(message)
        elif kind is self._to_host_t:
            nbytes = message.nbytes
            if type(nbytes) is not int or nbytes < 1 or message.out is None:
                return self._slow(message)
        elif kind is not self._launch_t:
            return self._slow(message)
        lock = actor._exclusive
        if not lock.acquire(False):
            return self._not_served
        try:
            if not actor._started or actor.actor_stopped.is_set() or actor.actor_inbox._unserved:
                return self._not_served
            core = actor._core  # read holding the lock: a rebuild's GenerationChanged drops it
            if core is None:
                return self._not_served  # detached: the next attach is the actor's, through the inbox
            try:
                if kind is self._to_device_t:
                    done = core.to_device(message.ref, message.data)
                    reply = None
                elif kind is self._to_host_t:
                    event = core.to_host(message.ref, message.out, nbytes)
                    done = event is not None
                    reply = self._done_t(message.out, nbytes, event) if done else None
                else:
                    done = core.launch(message)
                    reply = None
            except BaseException as exc:
                actor._compiled_failed(exc)
                raise
            if not done:
                return actor.on_receive(message)  # the Python path, still holding the lock
            return reply
        finally:
            lock.release()
