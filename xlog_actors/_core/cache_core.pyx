# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled body of ``BlockCacheResource``: freed blocks kept per (stream, size class) and
handed out again with no driver call.

The cache sits right on the stream-ordered resource (``AsyncCore``), under its lock: a kept block
stays an entry of the upstream's live table (the upstream still holds it from the driver), and
handing it out again rewrites that entry (a new generation, the new tag and, across streams, the
new stream), so the upstream's tracking hooks, its ABA guard and the device context see one block
whatever layer they ask.

* **Sizes.** A request is rounded up to its class (512-byte steps up to 4 KiB, then four classes
  per power of two, at most 25% more: the allocator bridge's rule), and a miss asks the upstream
  for the class's size. A request above ``MAX_CACHED`` bytes is neither rounded nor kept.
* **Free** (``deallocate``): the block's stream is made to wait for every use the upstream
  tracked on another stream (as the upstream's own free does), those uses are forgotten (their
  events go back to the pool), and the block is kept in its stream's list of its class, its
  upstream entry marked kept (generation 0, which no allocation is ever given), so a second free
  or a use of the old handle is refused as a use after free.
* **Same stream**: an allocation takes the newest block kept on its stream, at once: the stream's
  own order puts the new user's work after every use of the old one.
* **Another stream**: an allocation that finds nothing on its stream takes the oldest block of its
  class kept on another stream only once that stream's *fence* (an event recorded there after the
  block was kept) has been seen complete, by a query (never a wait). The fence is recorded lazily,
  when such an allocation first looks (one event per stream covers every block kept there before
  it), and is not moved while it is pending; until it completes the allocation goes upstream.
* **Trim**: every kept block given back to the upstream (a stream-ordered free on its stream). On
  an allocation the upstream refuses (``OutOfMemory``) the cache is trimmed, the upstream's queued
  frees reaped, and the allocation tried once more. ``trim()`` does it on demand, ``release()``
  also stops keeping blocks, and ``drop()`` forgets them without freeing (their context was
  rebuilt: the memory went with it).
* **Counts.** ``bytes_outstanding()`` is what the user holds (at the sizes asked) plus the
  upstream's queued frees: kept blocks do not count, so a budget above the cache counts what its
  user holds. ``statistics()`` gives the kept bytes and blocks, hits (across streams too), misses,
  fences and trims: C counters, made Python ints only when read.

**A hit's cost.** A hit and its free make no driver call, so they cost only this module's own
work, and that work is kept to C operations on objects that live as long as the block stays with
the cache: each block the cache holds from its upstream has one ``_Slot`` (its upstream entry, its
class, the size asked, kept or handed out, its place in its stream's list) for its whole stay, in
one address table, so a hit and a free add and remove nothing there; a stream's lists are found by
identity with the stream id last asked for, and they remember their stream, found in the pool's
dict, with the pool's version (``StreamsVersion``, changed when a stream leaves the pool): while
it is unchanged, a hit and a free on the stream look nothing up (``_remember``); and the
``DeviceBlock`` a slot handed out last is handed out again, rewritten, when the slot holds the
only reference to it (nobody can see it change; any other holder gets a new block). Its
``Generation`` too, when the block is its only holder: the process's next generation number is written into that object under the lock
(``renew_generation``), so a hit makes no Python object at all (making one and freeing the old
one was a third of a hit). The number is new all the same, so the old one stays refused.

The module is past 400 lines because the hit, the miss, the free, the trims and the figures all
move the same kept blocks and upstream entries under one lock, by one rule: apart, each part would
have to export the cache's internals to the others.

Thread rule: every method may be called from any thread at any time. One lock, the upstream's,
guards the cache's lists and counters and the upstream's entries together; the upstream's own
allocate, free and reap run outside it, and so does recording into a history. A hit, and the free
of a block used on its own stream only, run no Python code and allocate nothing while they hold
it, so with the GIL no thread waits on it there: one lock per stream would save nothing. (A free
that queues waits for uses on other streams calls the driver under it, as the upstream's does.)
"""

cimport cython
from cpython.dict cimport PyDict_GetItem, PyDict_GetItemWithError, PyDict_SetDefault
from cpython.list cimport PyList_GET_ITEM
from cpython.tuple cimport PyTuple_GET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from .async_core cimport AsyncCore, StreamsVersion, _Entry
from .blocks cimport (BlockId, DeviceBlock, GenerationSource, generation_of, generation_source, new_block,
                      next_generation, renew_generation)
from .history_ring cimport HISTORY_ALLOC, HISTORY_CACHE_HIT, HISTORY_FREE, HISTORY_TRIM
from .lock cimport lock_acquire, lock_release
from .ptr_table cimport PtrTable, key_of
from .pyint cimport xa_only_ref, xa_small_positive
from .resource_core cimport ResourceCore, block_clock
from .size_class cimport class_index, class_size

from ..driver.checks import check_device, check_nbytes, unknown_block, unknown_stream
from ..driver.limits import ALIGNMENT
from ..errors import DriverError, InvalidRequest, OutOfMemory
from .blocks import AllocTag, BlockState, Generation, LiveBlock, StreamId

__all__ = ["MAX_CACHED", "CacheCore", "size_class"]

#: The largest request the cache rounds and keeps (256 TiB); larger ones pass through.
MAX_CACHED = 1 << 48

cdef long long _MAX_CACHED = MAX_CACHED
cdef Py_ssize_t _CLASSES = 152  # class indices of sizes up to MAX_CACHED
cdef object _LIVE = BlockState.LIVE
cdef object _ALIGNMENT = ALIGNMENT
cdef object _DEFAULT_STREAM = StreamId.DEFAULT
cdef object _UNTAGGED = AllocTag.UNTAGGED
# The generation of a kept block's upstream entry: generations start at 1, so no handle, the
# freed one included, matches it.
cdef object _KEPT = Generation(0)
cdef GenerationSource* _GENERATIONS = generation_source()


cdef inline int _room(PtrTable t) except -1:
    # Grow ``t`` now if one more entry would make it grow, so the insert after cannot fail.
    if (t._used + 1) * 2 > t._mask + 1:
        t._grow()
    return 0


def size_class(nbytes):
    """The size a cache asks its upstream for when ``nbytes`` are asked (the allocator bridge's
    rule): rounded up to 512 bytes up to 4 KiB, then to a quarter of the largest power of two not
    above it; above ``MAX_CACHED``, ``nbytes`` itself.

    Raises:
        InvalidRequest: ``nbytes`` is not a positive int.
    Thread rule: any thread.
    """
    nbytes = check_nbytes(nbytes)
    if nbytes > MAX_CACHED:
        return nbytes
    return class_size(<size_t>nbytes)


@cython.final
cdef class _Slot:
    """A block the cache holds from its upstream, from the miss that brought it to the free or
    trim that gives it back: handed out or kept (see the .pxd)."""


@cython.final
cdef class _Bin:
    """The kept blocks of one (stream, class), newest to oldest."""


@cython.final
cdef class _StreamBins:
    """The kept blocks of one stream, by class (a list per class, all made with it), and the
    stream's fence."""

    def __init__(self, sid):
        self.sid = sid
        self.bins = [_Bin.__new__(_Bin) for _ in range(_CLASSES)]


cdef inline void _unlink(_Bin b, _Slot s) noexcept:
    if s.newer is None:
        b.newest = s.older
    else:
        s.newer.older = s.older
    if s.older is None:
        b.oldest = s.newer
    else:
        s.older.newer = s.newer
    s.newer = None
    s.older = None


cdef inline void _push(_StreamBins sb, _Slot s) noexcept:
    # Under the lock: ``s`` becomes the newest kept block of its (stream, class).
    cdef _Bin b = <_Bin>PyList_GET_ITEM(sb.bins, s.idx)
    s.older = b.newest
    s.newer = None
    if b.newest is None:
        b.oldest = s
    else:
        b.newest.newer = s
    b.newest = s


cdef inline uint64_t _pool_version(CacheCore core) noexcept:
    # The pool's version (never 0), or 0 for a pool without one: nothing is remembered then.
    cdef StreamsVersion version = core._up._streams_version
    return 0 if version is None else version.value


cdef object _pool_stream(CacheCore core, object sid):
    # ``up._stream_of(sid)`` (None: not a stream of the pool), the pool's dict read in C.
    cdef PyObject* found
    streams = core._up._streams
    if type(streams) is not dict:
        return core._up._stream_of(sid)
    found = PyDict_GetItemWithError(<dict>streams, sid)
    if found == NULL:
        return None
    return <object>found


cdef inline void _remember(_StreamBins sb, object home, uint64_t version) noexcept:
    # ``home``, the stream of ``sb`` just found in the pool's dict at ``version`` (read before the
    # look-up), kept borrowed in ``sb``: while the pool's version is still ``version`` the dict
    # holds it, and a hit or a free on the stream looks nothing up (a hash and a probe were about
    # 110 instructions each). Two C writes with no Python code between: atomic with the GIL.
    sb.home = <PyObject*>home
    sb.pool_version = version


cdef PyObject* _find_bins(CacheCore core, object sid, uint64_t version) except NULL:
    # The lists of stream ``sid`` once the pool has it (else StreamMisuse), with the stream
    # remembered in them; borrowed: ``_by_stream`` holds every stream's lists for the cache's life.
    cdef _StreamBins sb
    home = _pool_stream(core, sid)
    if home is None:
        raise unknown_stream("BlockCacheResource.allocate", core._ordinal, sid)
    sb = core._bins_for(sid)
    if version != 0:
        _remember(sb, home, version)
    return <PyObject*>sb


cdef int _forget_uses(CacheCore core, _StreamBins sb, _Entry entry, uint64_t version) except -1:
    # Under the lock, before ``entry``'s block is kept on its stream (``sb``'s): the stream found
    # in the pool (else StreamMisuse), made to wait for every use elsewhere as the upstream's free
    # would, and those uses forgotten (their events back to the pool). A failed wait leaves
    # everything as it was (waits queued are harmless).
    sid = entry.stream
    if version != 0 and sb.pool_version == version:
        home = <object>sb.home
    else:
        home = _pool_stream(core, sid)
        if home is None:
            raise unknown_stream("BlockCacheResource.deallocate", core._ordinal, sid)
        if version != 0:
            _remember(sb, home, version)
    if entry.lw_event is not None and entry.lw_stream != sid:
        core._up._ops.wait(home, entry.lw_event)
    if entry.reads:
        for rsid, event in entry.reads.items():
            if rsid != sid:
                core._up._ops.wait(home, event)
    if entry.lw_event is not None:
        core._up._events.release(entry.lw_event)
        entry.lw_event = None
        entry.lw_stream = None
    if entry.reads:
        for event in entry.reads.values():
            core._up._events.release(event)
        entry.reads = None
    return 0


cdef class CacheCore(ResourceCore):
    """The state and hot paths of ``BlockCacheResource`` (see the module docstring).

    Thread rule: every method may be called from any thread at any time.
    """

    def __init__(self, upstream, limit=None):
        """Keep freed blocks of ``upstream`` (a stream-ordered resource) for reuse.

        Args:
            upstream: an ``AsyncCudaResource``.
            limit: the most bytes kept idle (a free past it goes upstream), or None for no limit.
        Raises:
            InvalidRequest: ``upstream`` is no stream-ordered resource, or ``limit`` is neither
                None nor a positive int.
        Thread rule: any thread.
        """
        if not isinstance(upstream, AsyncCore):
            raise InvalidRequest(
                "a block cache sits right on the stream-ordered resource ('async+cache'); "
                f"got {type(upstream).__name__}"
            )
        if limit is not None and (type(limit) is not int or limit <= 0):
            raise InvalidRequest(f"a block cache's limit is None or a positive int, got {limit!r}")
        ResourceCore.__init__(self, upstream.driver, upstream.device_ordinal)
        self._upstream = upstream
        self._up = <AsyncCore>upstream
        self._lk = &self._up._lock
        self._held = PtrTable()
        self._by_stream = {}
        self._last = None
        self._enabled = True
        self._limit = -1 if limit is None else min(limit, MAX_CACHED)

    cdef _StreamBins _bins_for(self, object sid):
        # The lists of stream ``sid``, made on first use. No lock: ``_by_stream`` only grows, by
        # setdefault (atomic with the GIL), so every caller gets the one object a stream has.
        cdef _StreamBins sb = self._last
        cdef PyObject* found
        if sb is not None and sb.sid is sid:
            return sb
        found = PyDict_GetItem(self._by_stream, sid)
        if found == NULL:
            found = PyDict_SetDefault(self._by_stream, sid, _StreamBins(sid))
        sb = <_StreamBins>found
        self._last = sb  # one field: a reader sees the old lists or the new, both right for their id
        return sb

    # -- allocation -------------------------------------------------------------------------
    @cython.binding(False)
    def allocate(self, nbytes, stream=_DEFAULT_STREAM, tag=_UNTAGGED):
        """Allocate ``nbytes`` ordered on ``stream``: a kept block of the size's class when there
        is one (see the module docstring), else the upstream's.

        Args:
            nbytes: a positive ``int``.
            stream: a stream of the upstream's pool.
            tag: what the allocation is for.
        Returns:
            A live block of ``nbytes`` with a new generation.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``.
            StreamMisuse: ``stream`` is not a stream of the pool.
            OutOfMemory: the upstream refused, also after the cache was trimmed (``requested`` is
                ``nbytes``).
            DriverError: the upstream or a fence's record or query failed; nothing changed.
        Thread rule: any thread.
        """
        return self._alloc_c(nbytes, stream, tag)

    cdef object _alloc_c(self, object nbytes, object stream, object tag):
        # The hit reads the lists, bins, slot, entry and block it works on borrowed (PyObject*):
        # each is held by the cache for its life (``_by_stream``, the lists, ``_held``, the slot)
        # and nothing on the way runs Python code, so taking and giving a reference to each (most
        # of what a hit cost after its look-ups) bought nothing.
        cdef PyObject* size = <PyObject*>nbytes  # the size asked, as an int
        cdef PyObject* sb
        cdef PyObject* b
        cdef PyObject* s
        cdef PyObject* entry
        cdef PyObject* block
        cdef _Slot held
        cdef long long n = 0
        cdef int overflow = 0
        cdef size_t cls
        cdef Py_ssize_t idx
        cdef uint64_t version
        cdef bint reused
        if type(nbytes) is not int or not xa_small_positive(size, &n):
            if type(nbytes) is int:
                n = PyLong_AsLongLongAndOverflow(nbytes, &overflow)
            if type(nbytes) is not int or (overflow == 0 and n <= 0) or overflow < 0:
                checked = check_nbytes(nbytes)  # raises; a positive int of another type comes back as one
                size = <PyObject*>checked
                n = PyLong_AsLongLongAndOverflow(checked, &overflow)
        if overflow or n > _MAX_CACHED or not self._enabled:
            return self._miss(<object>size, -1, 0, stream, tag, None, None)
        cls = class_size(<size_t>n)
        idx = class_index(cls)
        # The stream's lists last used, when they are ``stream``'s and the pool's version has not
        # changed since the stream was found in it; else the pool is asked (``_find_bins``).
        version = _pool_version(self)
        sb = <PyObject*>self._last
        if (version == 0 or sb == <PyObject*>None or (<_StreamBins>sb).sid is not stream
                or (<_StreamBins>sb).pool_version != version):
            sb = _find_bins(self, stream, version)
        lock_acquire(self._lk)
        b = PyList_GET_ITEM((<_StreamBins>sb).bins, idx)
        s = <PyObject*>(<_Bin>b).newest
        if s == <PyObject*>None:
            lock_release(self._lk)
            return self._miss(<object>size, idx, cls, stream, tag, <_StreamBins>sb, next_generation())
        _unlink(<_Bin>b, <_Slot>s)  # ``_held`` still holds the slot
        entry = <PyObject*>(<_Slot>s).entry
        # The block this slot handed out last, and its generation, renewed in place when the
        # slot's references are their only ones (nobody can see them change): a new number, no
        # object made. Else the entry stays kept (no handle matches it) until the new
        # generation, made outside the lock, is set below.
        block = <PyObject*>(<_Slot>s).block
        reused = (xa_only_ref(block)
                  and renew_generation(_GENERATIONS, <PyObject*>(<DeviceBlock>block).generation))
        if reused:
            (<_Entry>entry).generation = (<DeviceBlock>block).generation
        else:
            (<_Entry>entry).generation = _KEPT
        (<_Entry>entry).tag = tag
        (<_Entry>entry).created = block_clock()
        (<_Slot>s).kept = False
        (<_Slot>s).asked = <size_t>n
        self._cached_bytes -= <long long>cls
        self._cached_blocks -= 1
        self._slack += <long long>(cls - <size_t>n)
        self._hits += 1
        if reused:
            out = <object>block  # held from here: a field's old value, let go, may run Python code
            lock_release(self._lk)
            (<DeviceBlock>block).alloc_stream = stream
            (<DeviceBlock>block).nbytes = <object>size
            (<DeviceBlock>block).tag = tag
            if self._history is not None:
                _note(self, out, HISTORY_CACHE_HIT)
            return out
        held = <_Slot>s  # held from here: making the generation may run Python code
        lock_release(self._lk)
        generation = next_generation()
        lock_acquire(self._lk)
        held.entry.generation = generation
        lock_release(self._lk)
        new = _hand_out(self, held, <object>size, stream, tag, generation)
        if self._history is not None:
            _note(self, new, HISTORY_CACHE_HIT)
        return new

    cdef object _miss(self, object nbytes, Py_ssize_t idx, size_t cls, object stream, object tag,
                      _StreamBins sb, object generation):
        # Nothing kept on this stream: a block kept on another one whose fence is complete, else
        # the upstream (trimmed and tried once more if it refuses). ``idx`` -1: not cached at all
        # (``sb`` and ``generation`` are None then).
        cdef _Slot s = None
        cdef _Entry entry
        cdef PyObject* found
        if idx >= 0:
            lock_acquire(self._lk)
            try:
                s = self._take_across(stream, idx)
                if s is None:
                    self._misses += 1
                else:
                    entry = s.entry
                    entry.generation = generation
                    entry.tag = tag
                    entry.stream = stream  # its free, and the lazy fence of its uses, go there now
                    entry.created = block_clock()
                    s.kept = False
                    s.asked = <size_t>nbytes
                    s.bins = sb
                    self._cached_bytes -= <long long>cls
                    self._cached_blocks -= 1
                    self._slack += <long long>(cls - <size_t>nbytes)
                    self._hits += 1
                    self._cross_hits += 1
            finally:
                lock_release(self._lk)
            if s is not None:
                block = _hand_out(self, s, nbytes, stream, tag, generation)
                if self._history is not None:
                    _note(self, block, HISTORY_CACHE_HIT)
                return block
            size = cls
        else:
            size = nbytes
        try:
            up = self._up._alloc_c(size, stream, tag)
        except OutOfMemory as exc:
            if self._trim_all(True) == 0:
                exc.requested = nbytes
                raise
            self._up.reap_pending()
            try:
                up = self._up._alloc_c(size, stream, tag)
            except OutOfMemory as again:
                again.requested = nbytes
                raise
        # The block's slot, made outside the lock (the upstream made its entry and its key).
        s = _Slot.__new__(_Slot)
        s.ptr = (<DeviceBlock>up).ptr
        key_of(s.ptr, &s.key)
        s.idx = idx
        s.asked = <size_t>nbytes
        s.bins = sb
        block = new_block(s.ptr, self._ordinal, stream, nbytes, _ALIGNMENT, tag, (<DeviceBlock>up).generation, _LIVE)
        s.block = block
        lock_acquire(self._lk)
        try:
            _room(self._held)
        except BaseException:
            lock_release(self._lk)
            self._up._dealloc_c(up)
            raise
        found = self._up._live.find(s.key)  # nobody else holds the block yet: still there
        if found == NULL:
            lock_release(self._lk)
            raise DriverError(f"BlockCacheResource on device {self._ordinal}: the upstream lost the block it "
                              f"just handed out ({s.ptr:#x})")
        s.entry = <_Entry>found
        s.cls = <size_t>s.entry.nbytes
        self._held.insert(s.key, s)
        if idx >= 0:
            self._slack += <long long>(cls - <size_t>nbytes)
        lock_release(self._lk)
        if self._history is not None:
            _note(self, block, HISTORY_ALLOC)
        return block

    cdef _Slot _take_across(self, object stream, Py_ssize_t idx):
        # Under the lock: the oldest block of class ``idx`` kept on another stream whose fence
        # covers it and was seen complete; fences recorded where none covers a candidate.
        cdef _StreamBins sb
        cdef _Bin b
        cdef _Slot s
        for sb in list(self._by_stream.values()):
            if sb.sid == stream:
                continue
            b = <_Bin>PyList_GET_ITEM(sb.bins, idx)
            if b.oldest is None:
                continue
            s = b.oldest
            if sb.fence is not None and sb.fence_seq >= s.seq:
                if not sb.fence_done:
                    sb.fence_done = sb.fence.query()
                if sb.fence_done:
                    _unlink(b, s)
                    return s
                continue  # pending: never pushed further out
            if sb.fence is None or sb.fence_done or sb.fence.query():
                home = self._up._stream_of(sb.sid)
                if home is None:
                    continue  # the stream was closed; its blocks go back at the next trim
                if sb.fence is None:
                    sb.fence = self._up._events.take()
                self._up._ops.record(sb.fence, home)
                sb.fence_seq = sb.seq
                sb.fence_done = False
                self._fences += 1
        return None

    # -- free -------------------------------------------------------------------------------
    @cython.binding(False)
    def deallocate(self, block):
        """Keep ``block`` for reuse on its stream (after the stream was made to wait for its
        uses on other streams); past the limit, after ``release()`` or above ``MAX_CACHED``, free
        it upstream.

        Args:
            block: a live block of this cache.
        Raises:
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: no block with this ``(ptr, generation)`` is live (freed already, kept,
                or never allocated here).
            StreamMisuse: the block's stream was closed.
            DriverError: a wait could not be queued (or the upstream's free failed); the block
                stays live and nothing is counted.
        Thread rule: any thread.
        """
        self._release(block, True)  # ``_dealloc_c``'s body, without its call

    cdef object _dealloc_c(self, object block):
        self._release(block, True)

    cdef int _release(self, object block, bint strict) except -1:
        # The free of ``block``: 1 once done. A block that is not live here (another device's,
        # never the cache's, kept already, another generation) raises with ``strict``, else
        # gives 0 and changes nothing: the device context's free of a block that may have gone
        # already, which the cache's table answers for it (see ``live_count``). The slot, its
        # entry and its stream's lists are read borrowed (PyObject*) under the lock: ``_held``
        # holds the slot, the slot its entry, ``_by_stream`` the lists, and only the lock's
        # holder takes a slot out of ``_held``.
        cdef _Slot s
        cdef PyObject* sp
        cdef PyObject* entry
        cdef PyObject* sb
        cdef PyObject* found
        cdef uint64_t key
        cdef uint64_t version
        cdef bint kept = False
        cdef PyObject* ptr
        cdef PyObject* generation
        cdef PyObject* ordinal
        if type(block) is DeviceBlock:
            # Borrowed from the block, which the caller holds: the cache rewrites a block's
            # fields only while it holds the block's one reference (``_alloc_c``).
            ptr = <PyObject*>(<DeviceBlock>block).ptr
            generation = <PyObject*>(<DeviceBlock>block).generation
            ordinal = <PyObject*>(<DeviceBlock>block).device_ordinal
        else:
            fields = (block.ptr, generation_of(block), block.device_ordinal)  # made: held here
            ptr = PyTuple_GET_ITEM(fields, 0)
            generation = PyTuple_GET_ITEM(fields, 1)
            ordinal = PyTuple_GET_ITEM(fields, 2)
        if ordinal != <PyObject*>self._ordinal and <object>ordinal != self._ordinal:
            if not strict:
                return 0
            check_device("BlockCacheResource.deallocate", self._ordinal, block)
        if not key_of(<object>ptr, &key):
            if not strict:
                return 0
            raise unknown_block("BlockCacheResource.deallocate", self._ordinal, block, None)
        lock_acquire(self._lk)
        try:
            found = self._held.find(key)
            if found == NULL or (<_Slot>found).kept:  # never the cache's, or kept already
                if not strict:
                    return 0
                raise unknown_block("BlockCacheResource.deallocate", self._ordinal, block, None)
            sp = found
            entry = <PyObject*>(<_Slot>sp).entry
            if (<PyObject*>(<_Entry>entry).generation != generation
                    and (<_Entry>entry).generation != <object>generation):
                if not strict:
                    return 0
                raise unknown_block("BlockCacheResource.deallocate", self._ordinal, block,
                                    int((<_Entry>entry).generation))
            if self._enabled and (<_Slot>sp).idx >= 0 and (
                    self._limit < 0 or self._cached_bytes + <long long>(<_Slot>sp).cls <= self._limit):
                # The stream's check and the waits for uses elsewhere only when the pool's version
                # changed since the stream was found in it, or the block was used since it was
                # handed out (see ``_forget_uses``); the usual free does neither.
                sb = <PyObject*>(<_Slot>sp).bins
                version = _pool_version(self)
                if (version == 0 or (<_StreamBins>sb).pool_version != version
                        or (<_Entry>entry).lw_event is not None or (<_Entry>entry).reads is not None):
                    _forget_uses(self, <_StreamBins>sb, <_Entry>entry, version)
                (<_Entry>entry).generation = _KEPT  # the old handle is stale from here on
                (<_StreamBins>sb).seq += 1
                (<_Slot>sp).seq = (<_StreamBins>sb).seq
                (<_Slot>sp).kept = True
                _push(<_StreamBins>sb, <_Slot>sp)
                self._cached_bytes += <long long>(<_Slot>sp).cls
                self._cached_blocks += 1
                self._slack -= <long long>((<_Slot>sp).cls - (<_Slot>sp).asked)  # no longer the user's
                kept = True
            else:
                s = <_Slot>sp  # held: out of ``_held`` from here
                self._held.remove_if(key, s)  # on its way upstream (put back if the upstream refuses)
                self._slack -= <long long>(s.cls - s.asked)  # no longer the user's
        finally:
            lock_release(self._lk)
        if not kept:
            try:
                self._up._dealloc_c(block)
            except BaseException:
                lock_acquire(self._lk)
                try:
                    self._held.insert(key, s)  # its place was just freed: no growth
                    self._slack += <long long>(s.cls - s.asked)
                finally:
                    lock_release(self._lk)
                raise
        if self._history is not None:
            _note(self, block, HISTORY_FREE)
        return 1

    # -- what is handed out -----------------------------------------------------------------
    cdef Py_ssize_t _live_count(self) noexcept:
        # Under no lock: two C fields read with the GIL held, no Python code between them.
        return self._held._used - <Py_ssize_t>self._cached_blocks

    cdef list _live_list(self):
        # A snapshot read with the GIL held and no lock: the table's reads are single C
        # operations, and the lock is not reentrant (a collection while building the list may
        # run a finalizer that frees through this cache).
        cdef _Slot s
        cdef list out = []
        for held in self._held.values():
            s = <_Slot>held
            if not s.kept:
                out.append(s.block)
        return out

    def live_count(self):
        """The number of blocks handed out and not yet freed (kept blocks are not counted).

        Thread rule: any thread.
        """
        return self._live_count()

    def live_list(self):
        """The blocks handed out and not yet freed, as a new list (in no particular order): for
        each, the block object the cache handed out last.

        Thread rule: any thread.
        """
        return self._live_list()

    # -- trimming ---------------------------------------------------------------------------
    cdef list _detach_all(self):
        # Under the lock: every kept slot, out of its list (still kept: no free takes it); the
        # fences back to the pool.
        cdef _StreamBins sb
        cdef _Bin b
        cdef _Slot s
        cdef Py_ssize_t i
        out = []
        for sb in self._by_stream.values():
            for i in range(_CLASSES):
                b = <_Bin>PyList_GET_ITEM(sb.bins, i)
                while b.newest is not None:
                    s = b.newest
                    _unlink(b, s)
                    out.append(s)
            if sb.fence is not None:
                self._up._events._free.append(sb.fence)
                sb.fence = None
                sb.fence_done = False
        self._cached_bytes = 0
        self._cached_blocks = 0
        return out

    cdef long long _trim_all(self, bint quiet) except -1:
        cdef _Slot s
        cdef _Entry entry
        cdef long long freed = 0, count = 0
        lock_acquire(self._lk)
        slots = self._detach_all()
        for s in slots:  # a block whose stream was closed is idle: its free goes on the default one
            if self._up._stream_of(s.entry.stream) is None:
                s.entry.stream = _DEFAULT_STREAM
        lock_release(self._lk)
        error = None
        gone = []
        for s in slots:
            entry = s.entry
            block = new_block(s.ptr, self._ordinal, entry.stream, entry.nbytes, _ALIGNMENT, entry.tag,
                              entry.generation, _LIVE)
            try:
                self._up._dealloc_c(block)
            except BaseException as exc:  # kept again; the first error is raised after the rest
                self._keep_again(s)
                if error is None:
                    error = exc
                continue
            gone.append(s)
            freed += entry.nbytes
            count += 1
            if self._history is not None:
                _note(self, block, HISTORY_TRIM)
        lock_acquire(self._lk)
        for s in gone:  # only its own entry: the upstream may have handed the address out again
            self._held.remove_if(s.key, s)
        if count:
            self._trims += 1
            self._trimmed_blocks += count
            self._trimmed_bytes += freed
        lock_release(self._lk)
        if error is not None and not quiet:
            raise error
        return freed

    cdef int _keep_again(self, _Slot s) except -1:
        # A kept block whose free upstream failed, back into its stream's list.
        cdef _StreamBins sb = self._bins_for(s.entry.stream)  # outside the lock: it may make them
        lock_acquire(self._lk)
        s.bins = sb
        sb.seq += 1
        s.seq = sb.seq
        _push(sb, s)
        self._cached_bytes += <long long>s.cls
        self._cached_blocks += 1
        lock_release(self._lk)
        return 0

    def trim(self):
        """Give every kept block back to the upstream (stream-ordered frees on their streams).

        Returns:
            The bytes given back.
        Raises:
            DriverError: a free failed; that block is kept again, the others were given back.
        Thread rule: any thread.
        """
        return self._trim_all(False)

    def release(self):
        """Stop keeping blocks (frees go upstream from now on) and trim.

        Returns:
            The bytes given back.
        Raises:
            DriverError: as :meth:`trim`.
        Thread rule: any thread.
        """
        self._enabled = False
        return self._trim_all(False)

    def drop(self):
        """Forget every kept block without freeing it, for a context that was rebuilt (its
        memory went with it): out of the cache and out of the upstream's live table.

        Returns:
            The bytes forgotten.
        Thread rule: any thread.
        """
        cdef _Slot s
        cdef long long dropped = 0
        lock_acquire(self._lk)
        try:
            for s in self._detach_all():
                self._held.remove_if(s.key, s)
                if self._up._live.remove_if(s.key, s.entry):
                    self._up._live_bytes -= s.entry.nbytes
                    dropped += s.entry.nbytes
            self._dropped_bytes += dropped
        finally:
            lock_release(self._lk)
        return dropped

    # -- figures ----------------------------------------------------------------------------
    @property
    def enabled(self):
        """False once ``release()`` ran. Thread rule: any thread."""
        return self._enabled

    @property
    def limit(self):
        """The most bytes kept idle, or None. Thread rule: any thread."""
        return None if self._limit < 0 else self._limit

    def bytes_outstanding(self):
        """What the user holds, at the sizes asked, plus the upstream's queued frees; kept
        blocks are not counted.

        Returns:
            The count, taken under the lock.
        Thread rule: any thread.
        """
        lock_acquire(self._lk)
        total = self._up._live_bytes + self._up._pending_bytes - self._cached_bytes - self._slack
        lock_release(self._lk)
        return total

    def cached_bytes(self):
        """Bytes kept idle for reuse (at their class sizes). Thread rule: any thread."""
        return self._cached_bytes

    def cache_statistics(self):
        """The cache's figures, of one instant.

        Returns:
            A dict: ``cached_bytes``, ``cached_blocks``, ``hits``, ``cross_stream_hits``,
            ``misses``, ``fences``, ``trims``, ``trimmed_blocks``, ``trimmed_bytes``,
            ``dropped_bytes``, ``limit`` (None: no limit) and ``enabled``.
        Thread rule: any thread.
        """
        lock_acquire(self._lk)
        out = {"cached_bytes": self._cached_bytes, "cached_blocks": self._cached_blocks, "hits": self._hits,
               "cross_stream_hits": self._cross_hits, "misses": self._misses, "fences": self._fences,
               "trims": self._trims, "trimmed_blocks": self._trimmed_blocks, "trimmed_bytes": self._trimmed_bytes,
               "dropped_bytes": self._dropped_bytes}
        lock_release(self._lk)
        out["limit"] = self.limit
        out["enabled"] = self._enabled
        return out

    def live_blocks(self):
        """The blocks handed out and not yet freed, with their ages (the upstream's list without
        the kept blocks, each at the size asked).

        Returns:
            One ``LiveBlock`` per block, in allocation order.
        Thread rule: any thread.
        """
        cdef uint64_t key
        cdef PyObject* found
        listed = self._upstream.live_blocks()
        pairs = []
        lock_acquire(self._lk)
        for b in listed:
            if key_of(b.ptr, &key):
                found = self._held.find(key)
                if found != NULL and not (<_Slot>found).kept:
                    pairs.append((b, (<_Slot>found).asked))
        lock_release(self._lk)
        return [LiveBlock(b.ptr, asked, b.tag, b.stream, b.age_s) for b, asked in pairs]

    def kept_blocks(self):
        """The kept blocks, as ``(ptr, class size, stream)`` tuples (diagnostic).

        Thread rule: any thread.
        """
        cdef _Slot s
        out = []
        lock_acquire(self._lk)
        try:
            for s in self._kept():
                out.append((s.ptr, s.cls, s.entry.stream))
        finally:
            lock_release(self._lk)
        return out

    cdef list _kept(self):
        cdef _StreamBins sb
        cdef _Slot s
        out = []
        for sb in self._by_stream.values():
            for b in sb.bins:
                s = (<_Bin>b).newest
                while s is not None:
                    out.append(s)
                    s = s.older
        return out

    def held_size(self, ptr):
        """The size asked for the block handed out at ``ptr`` and not yet freed, or None
        (diagnostic).

        Thread rule: any thread.
        """
        cdef uint64_t key
        cdef PyObject* found
        if not key_of(ptr, &key):
            return None
        found = self._held.find(key)
        if found == NULL or (<_Slot>found).kept:
            return None
        return (<_Slot>found).asked


cdef inline DeviceBlock _hand_out(CacheCore core, _Slot s, object nbytes, object stream, object tag,
                              object generation):
    # The block of slot ``s``, just handed out (so only this thread touches ``s.block``): the
    # one it handed out last, rewritten, when the slot's reference is its only one, else new.
    cdef DeviceBlock block
    if xa_only_ref(<PyObject*>s.block):  # None has more references than one
        block = s.block
        block.alloc_stream = stream
        block.nbytes = nbytes
        block.tag = tag
        block.generation = generation
        return block
    block = new_block(s.ptr, core._ordinal, stream, nbytes, _ALIGNMENT, tag, generation, _LIVE)
    s.block = block
    return block


cdef int _note(CacheCore core, object block, int action) except -1:
    # Into the history set on the cache: a HistoryRing in C, another history through its methods.
    if core._ring is not None:
        core._ring.record(block, action)
    elif action == HISTORY_ALLOC or action == HISTORY_CACHE_HIT:
        core._history.record_alloc(block)
    elif action == HISTORY_FREE:
        core._history.record_free(block)
    return 0
