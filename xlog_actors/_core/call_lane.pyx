# cython: language_level=3
"""``CallLane``: fixed binary call slots in memory that two processes share, for an isolated
device's allocations.

Why: an ``Allocate`` asked of a device that lives in its own process crossed a pipe twice (a
pickle, a ``write``, a ``poll`` that sees it and a ``read`` each way) and woke the parent's
reply reader in between: about twice a bare pykka ask on the GPU machines. Here the asker writes
the request into a slot, the child's frame loop (spinning on the slots and its pipe, the GIL
released) serves it and writes the reply into the same slot, and the asker, spinning on it,
reads it: no system call, no pickle and no third thread on the path.

Layout (native 64-bit words): a header of 8 words (``sleeping``: the child is about to block in
``poll`` on its pipe and must be woken by a frame; ``dead``: the parent saw the child end), then
``SLOTS`` slots of ``SLOT_WORDS`` words each:

=========  ==========================================================================
word       meaning
=========  ==========================================================================
0          ``state``: ``IDLE`` → ``POSTED`` (parent) → ``CLAIMED`` (child) → ``DONE`` or
           ``PIPED`` (child); or ``POSTED`` → ``ABANDONED`` (parent) → ``IDLE`` (child)
1          ``claim``: a parent thread owns the slot (parent-side only)
2..9       request: rid, pipe_seq, nbytes, stream, free_generation, n_frees, tag length
16..23     reply: ptr, nbytes, align, alloc stream, block generation, block state index,
           handle generation
24..39     the tag's UTF-8 bytes (``MAX_TAG`` at most)
40..       the addresses of dropped handles to free first (``MAX_FREES`` at most)
=========  ==========================================================================

Invariants:

* A slot's request fields are written only by the parent thread that holds its ``claim`` and
  only while its ``state`` is ``IDLE``; its reply fields only by the child between ``CLAIMED``
  and ``DONE``. Every ``state`` store is a release and every load an acquire, so fields written
  before a state change are seen by whoever sees the change.
* **Order with the pipe.** A request carries ``pipe_seq``, the count of pipe frames the parent
  had sent when it posted; the child serves it only once it has read that many frames, and
  serves every servable request before it reads its next frame. So a request is served after
  everything its asker sent before it, and before anything it sent after it.
* **No lost wake-up.** The child stores ``sleeping`` and then looks at every slot before it
  blocks; the parent stores ``POSTED`` and then loads ``sleeping`` (both sequentially
  consistent): either the child sees the request or the parent sees it asleep and sends a frame.
* **Bounded waits.** An asker that sees no claim within its spin abandons the request (a
  compare-and-swap from ``POSTED``); the child then serves it as a pipe ask (its answer comes
  on the pipe), and puts the slot back to ``IDLE``. A claimed request is served at once by the
  child's frame loop, so an asker waits past its spin only for that; it stops waiting when the
  parent marks the child ``dead``.

Past 400 lines: both sides of the slot protocol stay in one module, so that each state change
and the load that pairs with it on the other side can be read together.

Thread rule: any thread of either process; the waits release the GIL. ``post``/``wait_reply``/
``reply``/``release`` belong to the thread that claimed the slot; ``wait``/``sleep``/``take``/
``done``/``piped`` to the child's frame loop.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.string cimport memcpy
from posix.time cimport nanosleep, timespec

from .doorbell cimport Doorbell, xlog_bell_ring
from .spin cimport POLLIN, now, poll, pollfd, sched_yield

cdef extern from *:
    """
    static inline unsigned long long xl_load(unsigned long long* p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void xl_store(unsigned long long* p, unsigned long long v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    static inline unsigned long long xl_load_sc(unsigned long long* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static inline void xl_store_sc(unsigned long long* p, unsigned long long v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
    static inline int xl_cas(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
        return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    static inline void xl_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    """
    unsigned long long xl_load(unsigned long long* p) nogil
    void xl_store(unsigned long long* p, unsigned long long v) nogil
    unsigned long long xl_load_sc(unsigned long long* p) nogil
    void xl_store_sc(unsigned long long* p, unsigned long long v) nogil
    int xl_cas(unsigned long long* p, unsigned long long expected, unsigned long long desired) nogil
    void xl_relax() nogil

ctypedef unsigned long long u64

cdef enum:
    _HEADER = 8
    _SLOTS = 8
    _SLOT_WORDS = 128
    _TAG_WORD = 24
    _MAX_TAG = 128
    _FREE_WORD = 40
    _MAX_FREES = _SLOT_WORDS - _FREE_WORD
    # Header words.
    _SLEEPING = 0
    _DEAD = 1
    # Slot words.
    _STATE = 0
    _CLAIM = 1
    _RID = 2
    _PIPE_SEQ = 3
    _NBYTES = 4
    _STREAM = 5
    _FREE_GEN = 6
    _N_FREES = 7
    _TAG_LEN = 8
    _REPLY = 16
    _SIZE = (_HEADER + _SLOTS * _SLOT_WORDS) * 8

# Slot states (see the module docstring), and what the waits return.
cdef enum:
    S_IDLE = 0
    S_POSTED = 1
    S_CLAIMED = 2
    S_DONE = 3
    S_PIPED = 4
    S_ABANDONED = 5
    S_DEAD = 6
    W_NOTHING = 0
    W_REQUEST = 1
    W_PIPE = 2

#: Slot states (see the module docstring).
IDLE = S_IDLE
POSTED = S_POSTED
CLAIMED = S_CLAIMED
DONE = S_DONE
PIPED = S_PIPED
ABANDONED = S_ABANDONED
#: What ``wait_reply`` returns when the parent marked the child dead.
DEAD = S_DEAD
#: What ``wait``/``sleep`` return: nothing came in time, a servable request is posted, or the
#: pipe must be read (a frame, its end, or a request that waits for earlier frames).
NOTHING = W_NOTHING
REQUEST = W_REQUEST
PIPE = W_PIPE

SLOTS = _SLOTS
SLOT_WORDS = _SLOT_WORDS
MAX_TAG = _MAX_TAG
MAX_FREES = _MAX_FREES
#: The bytes a lane needs.
SIZE = _SIZE


cdef class CallLane:
    """The call slots over a shared buffer of at least ``SIZE`` bytes; see the module docstring.

    Thread rule: see the module docstring.
    """

    cdef unsigned char[::1] _view
    cdef u64* _words

    def __cinit__(self, buffer) -> None:
        """Args:
            buffer: a writable buffer of at least ``SIZE`` bytes, 8-aligned (a shared mapping),
                zeroed by its creator; kept referenced while the lane lives.
        Raises:
            ValueError: the buffer is too small.
        """
        self._view = buffer
        if self._view.shape[0] < _SIZE:
            raise ValueError(f"a call lane needs {SIZE} bytes, got {self._view.shape[0]}")
        self._words = <u64*>&self._view[0]

    cdef inline u64* _slot(self, int slot) noexcept nogil:
        return self._words + _HEADER + slot * _SLOT_WORDS

    cdef int _check(self, int slot) except -1:
        if slot < 0 or slot >= _SLOTS:
            raise ValueError(f"slot {slot} out of range 0..{_SLOTS - 1}")
        return 0

    # -- the parent's side ----------------------------------------------------------------------
    def claim(self) -> int:
        """An idle slot, now owned by this thread, or -1 when every slot is taken."""
        cdef int i
        cdef u64* s
        for i in range(_SLOTS):
            s = self._slot(i)
            if xl_load(&s[_CLAIM]) == 0 and xl_cas(&s[_CLAIM], 0, 1):
                if xl_load(&s[_STATE]) == S_IDLE:
                    return i
                xl_store(&s[_CLAIM], 0)  # abandoned: the child has not put it back yet
        return -1

    def post(self, int slot, u64 rid, u64 pipe_seq, u64 nbytes, long long stream, bytes tag,
             u64 free_generation, list frees) -> bool:
        """Write the request into the claimed ``slot`` and post it.

        Args:
            slot: a slot this thread claimed.
            rid: the request id its answer is filed under when it comes on the pipe instead.
            pipe_seq: the count of pipe frames sent before it.
            nbytes, stream: the allocation.
            tag: its tag, UTF-8, at most ``MAX_TAG`` bytes.
            free_generation, frees: dropped handles' addresses (at most ``MAX_FREES``) to free
                first, of that child generation.
        Returns:
            Whether the child is asleep (the caller sends it a frame to wake it).
        Raises:
            ValueError: a bad slot, tag or free count; nothing was posted.
        """
        self._check(slot)
        cdef Py_ssize_t n = len(frees)
        cdef Py_ssize_t k
        if len(tag) > _MAX_TAG:
            raise ValueError(f"a tag of {len(tag)} bytes does not fit a call slot ({_MAX_TAG})")
        if n > _MAX_FREES:
            raise ValueError(f"{n} frees do not fit a call slot ({_MAX_FREES})")
        cdef u64* s = self._slot(slot)
        s[_RID] = rid
        s[_PIPE_SEQ] = pipe_seq
        s[_NBYTES] = nbytes
        s[_STREAM] = <u64>stream
        s[_FREE_GEN] = free_generation
        s[_N_FREES] = <u64>n
        s[_TAG_LEN] = <u64>len(tag)
        if len(tag):
            memcpy(<void*>&s[_TAG_WORD], <const char*>tag, len(tag))
        for k in range(n):
            s[_FREE_WORD + k] = <u64>frees[k]
        xl_store_sc(&s[_STATE], S_POSTED)
        return xl_load_sc(&self._words[_SLEEPING]) != 0

    def wait_reply(self, int slot, double spin) -> int:
        """Wait, the GIL released, until the child answered ``slot`` in it (``DONE``), said the
        answer comes on the pipe (``PIPED``), or the parent marked it dead (``DEAD``). A request
        still unclaimed after ``spin`` seconds is abandoned (``ABANDONED``: its answer comes on
        the pipe). A claimed one is waited for past ``spin``, sleeping 20 µs a turn.
        Returns:
            ``DONE``, ``PIPED``, ``ABANDONED`` or ``DEAD``.
        """
        self._check(slot)
        cdef u64* s = self._slot(slot)
        cdef u64* dead = &self._words[_DEAD]
        cdef u64 state
        cdef double deadline
        cdef unsigned int turn = 0
        cdef timespec nap
        nap.tv_sec = 0
        nap.tv_nsec = 20000
        with nogil:
            deadline = now() + spin
            while True:
                state = xl_load(&s[_STATE])
                if state == S_DONE or state == S_PIPED:
                    break
                if xl_load(dead) != 0:
                    state = S_DEAD
                    break
                turn += 1
                if turn & 63:
                    xl_relax()
                    continue
                if now() < deadline:
                    sched_yield()
                elif state == S_POSTED and xl_cas(&s[_STATE], S_POSTED, S_ABANDONED):
                    state = S_ABANDONED
                    break
                else:
                    nanosleep(&nap, NULL)  # claimed: the child's frame loop is serving it
        return state

    def reply(self, int slot) -> tuple:
        """The ``DONE`` reply of ``slot``: ``(ptr, nbytes, align, alloc_stream,
        block_generation, block_state_index, handle_generation)``; the slot is then idle and
        released."""
        self._check(slot)
        cdef u64* s = self._slot(slot)
        cdef u64* r = &s[_REPLY]
        value = (r[0], r[1], r[2], <long long>r[3], r[4], r[5], r[6])
        xl_store(&s[_STATE], S_IDLE)
        xl_store(&s[_CLAIM], 0)
        return value

    def release(self, int slot, bint idle) -> None:
        """Give ``slot`` back: ``idle`` once its answer is taken (``PIPED``, ``DONE``); else
        (``ABANDONED``, ``DEAD``) only the claim, the child puts it back to ``IDLE``."""
        self._check(slot)
        cdef u64* s = self._slot(slot)
        if idle:
            xl_store(&s[_STATE], S_IDLE)
        xl_store(&s[_CLAIM], 0)

    def mark_dead(self) -> None:
        """The child is gone: every waiter stops waiting."""
        xl_store_sc(&self._words[_DEAD], 1)

    @property
    def dead(self) -> bool:
        """Whether :meth:`mark_dead` was called."""
        return xl_load(&self._words[_DEAD]) != 0

    # -- the child's side -----------------------------------------------------------------------
    cdef int _scan(self, u64 received) noexcept nogil:
        cdef int i
        cdef int found = W_NOTHING
        cdef u64* s
        cdef u64 state
        for i in range(_SLOTS):
            s = self._slot(i)
            state = xl_load(&s[_STATE])
            if state == S_POSTED or state == S_ABANDONED:
                if s[_PIPE_SEQ] <= received:
                    return W_REQUEST
                found = W_PIPE  # it waits for frames that are in the pipe already
        return found

    def wait(self, int fd, double seconds, u64 received, Doorbell bell=None) -> int:
        """Spin, the GIL released, up to ``seconds`` for a servable request or a readable ``fd``.

        Args:
            fd: the pipe.
            seconds: the longest spin; 0 looks once.
            received: the count of pipe frames read so far.
            bell: rung once the GIL is released, before the first look (as
                ``fdwait.wait_readable``'s: the thread waiting on it takes the GIL at once).
        Returns:
            ``REQUEST``, ``PIPE`` or ``NOTHING``.
        """
        cdef pollfd p
        cdef int found
        cdef double deadline
        cdef unsigned int turn = 0
        cdef unsigned long long* count = NULL
        if bell is not None:
            count = &bell._count
        p.fd = fd
        p.events = POLLIN
        p.revents = 0
        with nogil:
            if count != NULL:
                xlog_bell_ring(count)
            deadline = now() + seconds
            while True:
                found = self._scan(received)
                if found != W_NOTHING:
                    break
                turn += 1
                if turn & 15:
                    xl_relax()
                    continue
                if poll(&p, 1, 0) != 0:
                    found = W_PIPE
                    break
                if now() >= deadline:
                    break
                sched_yield()
        return found

    def sleep(self, int fd, u64 received, Doorbell bell=None) -> int:
        """Block, the GIL released, until a request is posted or ``fd`` can be read: the
        ``sleeping`` mark tells posters to send a frame. ``bell``: as :meth:`wait`'s.
        Returns:
            ``REQUEST`` or ``PIPE``.
        """
        cdef pollfd p
        cdef int found
        cdef u64* sleeping = &self._words[_SLEEPING]
        cdef unsigned long long* count = NULL
        if bell is not None:
            count = &bell._count
        p.fd = fd
        p.events = POLLIN
        p.revents = 0
        with nogil:
            if count != NULL:
                xlog_bell_ring(count)
            xl_store_sc(sleeping, 1)
            found = self._scan(received)
            if found == W_NOTHING:
                poll(&p, 1, -1)
            xl_store_sc(sleeping, 0)
            if found == W_NOTHING:
                found = self._scan(received)  # woken: requests first, as ``wait`` looks at them
                if found == W_NOTHING:
                    found = W_PIPE
        return found

    def take(self, u64 received) -> tuple | None:
        """Claim the first servable request: ``(slot, rid, nbytes, stream, tag,
        free_generation, frees, abandoned)``, or None. An abandoned one (its asker stopped
        waiting) is put back to ``IDLE`` here and must be answered on the pipe."""
        cdef int i
        cdef u64* s
        cdef Py_ssize_t k, n
        cdef u64 state
        for i in range(_SLOTS):
            s = self._slot(i)
            state = xl_load(&s[_STATE])
            if (state != S_POSTED and state != S_ABANDONED) or s[_PIPE_SEQ] > received:
                continue
            n = <Py_ssize_t>s[_N_FREES]
            tag = PyBytes_FromStringAndSize(<const char*>&s[_TAG_WORD], <Py_ssize_t>s[_TAG_LEN])
            frees = [s[_FREE_WORD + k] for k in range(n)]
            value = (i, s[_RID], s[_NBYTES], <long long>s[_STREAM], tag, s[_FREE_GEN], frees)
            if state == S_POSTED and xl_cas(&s[_STATE], S_POSTED, S_CLAIMED):
                return value + (False,)
            # Abandoned (before the look or before the claim): the fields read are still its own.
            xl_store(&s[_STATE], S_IDLE)
            return value + (True,)
        return None

    def done(self, int slot, u64 ptr, u64 nbytes, u64 align, long long alloc_stream, u64 block_generation,
             u64 state_index, u64 generation) -> None:
        """Answer the claimed ``slot`` in it."""
        self._check(slot)
        cdef u64* s = self._slot(slot)
        cdef u64* r = &s[_REPLY]
        r[0] = ptr
        r[1] = nbytes
        r[2] = align
        r[3] = <u64>alloc_stream
        r[4] = block_generation
        r[5] = state_index
        r[6] = generation
        xl_store(&s[_STATE], S_DONE)

    def piped(self, int slot) -> None:
        """Tell the asker of the claimed ``slot`` that its answer comes on the pipe."""
        self._check(slot)
        xl_store(&self._slot(slot)[_STATE], S_PIPED)
