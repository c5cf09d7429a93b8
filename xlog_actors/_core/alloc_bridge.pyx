# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The C face of the device allocators that foreign libraries load by symbol (PyTorch's
``CUDAPluggableAllocator``): three C functions exported from this very shared library, served
from the device's cache (below) or else taking the GIL and calling the Python allocator
registered for the CUDA device they are given.

* ``xlog_actors_alloc(ssize_t size, int device, void* stream) -> void*``: the allocator's
  ``allocate(size, stream_handle)``; a refusal throws a C++ ``std::runtime_error`` carrying the
  refusal's message (our error and its memory report), after the GIL is given back. PyTorch
  turns that into a ``RuntimeError`` with the message: its pluggable allocator does not check
  for a null pointer (up to 2.9 at least; a null would become a tensor at address 0), and it
  raises ``torch.OutOfMemoryError`` only for its own ``c10::OutOfMemoryError``, which a library
  that does not link against c10 cannot throw. A size of 0 returns NULL, as torch expects.
* ``xlog_actors_alloc_or_null``: the same without the throw (NULL on refusal), for callers in C,
  where a C++ exception cannot be caught (ctypes).
* ``xlog_actors_free(void* ptr, ssize_t size, int device, void* stream)``: the allocator's
  ``free(ptr, size, stream_handle)``. A free cannot report: what it raises is logged and kept as
  the device's last error.

Every refusal or failure is kept, per device, as :func:`last_error` (the exception object,
report included), so it stays reachable whatever the caller did with the message.

**The cache** (a stream-ordered caching layer, as torch's own allocator and RMM's pool): a
registered device has one, in C++ behind a ``std::mutex``, in flat tables that grow to the most
blocks live and kept at once and are emptied only by a drain, so once they have grown a hit and a
cached free allocate no memory. A size is rounded up to its class
(512-byte steps up to 4 KiB, then four classes per power of two: at most 25% more), and the
allocator is asked for the class's size. A free keeps the block in the cache, keyed by (stream,
class), and a later allocation of that class on that stream takes it back without the GIL, any
Python or any driver call: the stream's own order puts the new use after the old one. A block
is cached only when freed on the stream it was allocated for, by the exact size asked, and in
the epoch it was allocated in; any other free goes to the allocator. Cached blocks stay
allocated, counted under the allocator's tag (torch's "reserved"; the device's memory report
shows them as the cache's share of the tag), until :func:`empty_cache` gives them back through
the allocator (also on a budget or memory refusal of a cache miss, which is then tried once
more, after the allocator's ``synchronize()`` where it has one), :func:`invalidate` drops them
without freeing (a rebuild: they belonged to the old context) or
:func:`unregister`/:func:`disable_cache` (closing) empties and disables the cache. A limit
(:func:`set_cache_limit`; none by default, as torch's own cache has none) bounds the bytes held
idle: a free that would pass it first gives the oldest cached blocks back through the allocator
(a free like any other: stream-ordered after the stream the block was freed on), and a block
larger than the limit is not cached. Not kept: torch's ``record_stream`` uses on other streams (the pluggable
allocator does not forward them): as without the cache, a use on another stream is the
library's to order before the free.

The module is compiled as C++ (for the throw); the exported names are ``extern "C"``.

Invariants: the registry maps a CUDA device ordinal to one allocator object; it changes only
through :func:`register` and :func:`unregister`. Every pointer the bridge handed out from an enabled
cache and not yet taken back is in its device's live table (class, size asked, stream, epoch); every cached
pointer is live in the allocator (allocated, not freed), in no live table, and once both in the
cache's order of frees and in its (stream, class) list; the cached bytes never exceed the limit. The mutex is never
held while the GIL is taken (a thread holding it never waits for the GIL), so a thread with the
GIL may take it. After the interpreter began to exit (an ``atexit`` hook), or once it is
finalized, the exported functions no longer take the GIL: a cache miss throws (or returns NULL),
a free is dropped (the driver's close, or the process's end, frees the memory).

The module is past 400 lines because the cache's C++ and the exported functions' two paths (a
hit in C++, a miss through Python) share one entry layout and one locking rule; apart, each
half would have to know the other's.

Thread rule: any thread, with or without the GIL held (a cache miss and a free that is not
cached take it with ``PyGILState_Ensure``); the registry's functions from any Python thread.
"""

import atexit
import logging

from libc.stdint cimport uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

from .size_class cimport class_size

__all__ = [
    "ALLOC_OR_NULL_SYMBOL",
    "ALLOC_SYMBOL",
    "FREE_SYMBOL",
    "cache_stats",
    "disable_cache",
    "empty_cache",
    "invalidate",
    "last_error",
    "library_path",
    "register",
    "registered",
    "set_cache_limit",
    "size_class",
    "unregister",
]

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef extern from *:
    """
    #include <stdexcept>
    #include <string>
    static void xlog_actors_throw(const std::string& message) {
        throw std::runtime_error(message);
    }
    """
    void _throw "xlog_actors_throw"(const string& message) nogil

cdef extern from *:
    """
    #include <algorithm>
    #include <atomic>
    #include <cstdint>
    #include <mutex>
    #include <vector>

    namespace xlog_actors_cache {

    // Why no std::unordered_map or std::list here: they allocate a node on every insert and free
    // one on every erase, two of each per allocate+free pair, which was most of a hit's cost.
    // These tables grow (amortized, as blocks are kept or handed out for the first time) and
    // never shrink between drains, so a pair in a steady state allocates nothing.

    struct Live { size_t cls; size_t req; uintptr_t stream; uint64_t epoch; };
    struct Cached { uintptr_t ptr; size_t cls; uintptr_t stream; };
    struct Stats {
        uint64_t hits, misses, epoch, evicted_blocks, evicted_bytes;
        size_t cached_bytes, cached_blocks, live_blocks, limit;
        bool enabled;
    };
    static const size_t NO_LIMIT = SIZE_MAX;
    static const uint32_t NIL = UINT32_MAX;

    // Fibonacci hashing: block pointers are aligned, so their low bits say nothing; the product's
    // high bits mix every bit of the key.
    static inline size_t slot_of(uint64_t key, unsigned bits) {
        return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
    }

    // The live table: pointer -> Live, open addressing with linear probing and backward-shift
    // deletion (no tombstones, so a long run of pairs never degrades it). ptr 0 marks a free slot
    // (no block is at address 0). At most 3/4 full.
    struct LiveSlot { uintptr_t ptr; Live v; };
    struct LiveTable {
        std::vector<LiveSlot> slots = std::vector<LiveSlot>(64, LiveSlot{0, Live{0, 0, 0, 0}});
        unsigned bits = 6;
        size_t count = 0;

        size_t mask() const { return slots.size() - 1; }
        // The slot holding ptr, or the free slot where it would go.
        size_t probe(uintptr_t ptr) const {
            size_t i = slot_of(ptr, bits), m = mask();
            while (slots[i].ptr != 0 && slots[i].ptr != ptr) i = (i + 1) & m;
            return i;
        }
        void grow() {
            std::vector<LiveSlot> old(slots.size() * 2, LiveSlot{0, Live{0, 0, 0, 0}});
            old.swap(slots);
            bits++;
            for (const LiveSlot& s : old)
                if (s.ptr != 0) slots[probe(s.ptr)] = s;
        }
        void set(uintptr_t ptr, const Live& v) {
            size_t i = probe(ptr);
            if (slots[i].ptr == 0) {
                if ((count + 1) * 4 > slots.size() * 3) { grow(); i = probe(ptr); }
                count++;
            }
            slots[i] = LiveSlot{ptr, v};
        }
        void erase_at(size_t i) {
            size_t m = mask(), j = i;
            for (;;) {
                j = (j + 1) & m;
                if (slots[j].ptr == 0) break;
                size_t home = slot_of(slots[j].ptr, bits);
                // slots[j] may move to the hole at i unless its home lies cyclically in (i, j].
                if (((j - home) & m) >= ((j - i) & m)) { slots[i] = slots[j]; i = j; }
            }
            slots[i].ptr = 0;
            count--;
        }
        void clear() {
            for (LiveSlot& s : slots) s.ptr = 0;
            count = 0;
        }
    };

    // A cached block, linked twice: into the order of frees (oldest first, for a limit's
    // evictions and a drain) and into its (stream, class) list (newest first, for a hit).
    struct Node { Cached b; uint32_t older, newer, key_older, key_newer, key; };
    // One (stream, class) with its newest cached block (NIL: none).
    struct Key { uintptr_t stream; size_t cls; uint32_t newest; };

    struct Cache {
        std::mutex mu;
        uint64_t epoch = 0;
        bool enabled = false;
        size_t limit = NO_LIMIT;
        uint64_t hits = 0, misses = 0, evicted_blocks = 0, evicted_bytes = 0;
        size_t cached_bytes = 0, cached_blocks = 0;
        LiveTable live;
        std::vector<Node> nodes;
        uint32_t spare = NIL;                     // the unused nodes, linked through .newer
        uint32_t oldest = NIL, newest = NIL;      // the order of frees
        std::vector<Key> keys;
        std::vector<uint32_t> key_slots = std::vector<uint32_t>(64, NIL);  // open addressing into keys
        unsigned key_bits = 6;

        static uint64_t key_hash(uintptr_t stream, size_t cls) {
            return (uint64_t)stream * 0xC2B2AE3D27D4EB4Full ^ (uint64_t)cls;
        }
        // The key's index, or NIL; with make, a new empty key where there was none.
        uint32_t find_key(uintptr_t stream, size_t cls, bool make) {
            size_t m = key_slots.size() - 1, i = slot_of(key_hash(stream, cls), key_bits);
            for (; key_slots[i] != NIL; i = (i + 1) & m) {
                const Key& k = keys[key_slots[i]];
                if (k.stream == stream && k.cls == cls) return key_slots[i];
            }
            if (!make) return NIL;
            uint32_t index = (uint32_t)keys.size();
            keys.push_back(Key{stream, cls, NIL});
            key_slots[i] = index;
            if (keys.size() * 4 > key_slots.size() * 3) {  // keys are never erased but by a drain
                key_slots.assign(key_slots.size() * 2, NIL);
                key_bits++;
                m = key_slots.size() - 1;
                for (uint32_t k = 0; k < keys.size(); k++) {
                    size_t j = slot_of(key_hash(keys[k].stream, keys[k].cls), key_bits);
                    while (key_slots[j] != NIL) j = (j + 1) & m;
                    key_slots[j] = k;
                }
            }
            return index;
        }

        // Keep b as the newest block of the order of frees and of its key.
        void push(const Cached& b) {
            uint32_t key = find_key(b.stream, b.cls, true);
            uint32_t n;
            if (spare != NIL) { n = spare; spare = nodes[n].newer; }
            else { n = (uint32_t)nodes.size(); nodes.push_back(Node{}); }
            Key& k = keys[key];
            nodes[n] = Node{b, newest, NIL, k.newest, NIL, key};
            if (newest != NIL) nodes[newest].newer = n; else oldest = n;
            newest = n;
            if (k.newest != NIL) nodes[k.newest].key_newer = n;
            k.newest = n;
            cached_bytes += b.cls;
            cached_blocks++;
        }
        // Take node n out of both orders; its block.
        Cached unlink(uint32_t n) {
            Node& x = nodes[n];
            Key& k = keys[x.key];
            if (x.older != NIL) nodes[x.older].newer = x.newer; else oldest = x.newer;
            if (x.newer != NIL) nodes[x.newer].older = x.older; else newest = x.older;
            if (x.key_older != NIL) nodes[x.key_older].key_newer = x.key_newer;
            if (x.key_newer != NIL) nodes[x.key_newer].key_older = x.key_older; else k.newest = x.key_older;
            x.newer = spare;
            spare = n;
            cached_bytes -= x.b.cls;
            cached_blocks--;
            return x.b;
        }
    };

    // Indexed by CUDA ordinal; an entry is made once (with the GIL, at register) and never
    // freed, so a reader in any thread needs no lock to reach it.
    static const int MAX_DEVICES = 256;
    static std::atomic<Cache*> caches[MAX_DEVICES];

    static Cache* get(int device) {
        if (device < 0 || device >= MAX_DEVICES) return nullptr;
        return caches[device].load(std::memory_order_acquire);
    }

    static Cache* ensure(int device) {
        Cache* c = get(device);
        if (c == nullptr && device >= 0 && device < MAX_DEVICES) {
            c = new Cache();
            caches[device].store(c, std::memory_order_release);
        }
        return c;
    }

    // A hit: the pointer, now live. A miss (0): *epoch is the epoch to record the new block
    // under, *tracked whether to record it at all (the cache is enabled).
    static uintptr_t take(Cache* c, size_t cls, size_t req, uintptr_t stream, uint64_t* epoch, bool* tracked) {
        std::lock_guard<std::mutex> g(c->mu);
        *tracked = c->enabled;
        *epoch = c->epoch;
        if (!c->enabled) return 0;
        uint32_t key = c->find_key(stream, cls, false);
        if (key == NIL || c->keys[key].newest == NIL) { c->misses++; return 0; }
        uintptr_t ptr = c->unlink(c->keys[key].newest).ptr;
        c->hits++;
        c->live.set(ptr, Live{cls, req, stream, c->epoch});
        return ptr;
    }

    static void note(Cache* c, uintptr_t ptr, const Live& e) {
        std::lock_guard<std::mutex> g(c->mu);
        c->live.set(ptr, e);
    }

    enum { PASS = 0, CACHED = 1, ROUTE = 2 };

    // The oldest cached block, out of the cache (the caller holds the mutex; the cache is not empty).
    static Cached evict_oldest(Cache* c) {
        Cached e = c->unlink(c->oldest);
        c->evicted_blocks++;
        c->evicted_bytes += e.cls;
        return e;
    }

    // PASS: not handed out by the bridge, or freed with another size: the allocator judges the
    // free with the caller's size, the live table unchanged. CACHED: kept, after moving the
    // oldest cached blocks to *evicted until the limit holds them all. ROUTE: taken out of the
    // live table (*e), to be freed by the allocator with e->cls (put back if it refuses); so is
    // a block larger than the limit by itself.
    static int put(Cache* c, uintptr_t ptr, size_t req, uintptr_t stream, Live* e, std::vector<Cached>* evicted) {
        std::lock_guard<std::mutex> g(c->mu);
        size_t i = c->live.probe(ptr);
        if (c->live.slots[i].ptr == 0 || c->live.slots[i].v.req != req) return PASS;
        *e = c->live.slots[i].v;
        c->live.erase_at(i);
        if (!c->enabled || e->stream != stream || e->epoch != c->epoch || e->cls > c->limit) return ROUTE;
        while (c->cached_bytes > c->limit - e->cls) evicted->push_back(evict_oldest(c));
        c->push(Cached{ptr, e->cls, stream});
        return CACHED;
    }

    // A new limit; the oldest cached blocks that no longer fit, out of the cache.
    static std::vector<Cached> set_limit(Cache* c, size_t limit) {
        std::vector<Cached> out;
        std::lock_guard<std::mutex> g(c->mu);
        c->limit = limit;
        while (c->cached_bytes > limit) out.push_back(evict_oldest(c));
        return out;
    }

    // Every cached block, out of the cache (oldest first); with bump, a new epoch (blocks handed
    // out before it are not cached when freed); with disable, no caching from now on. The
    // (stream, class) keys go too, so streams long gone leave nothing behind.
    static std::vector<Cached> drain(Cache* c, bool bump, bool disable) {
        std::vector<Cached> out;
        std::lock_guard<std::mutex> g(c->mu);
        out.reserve(c->cached_blocks);
        for (uint32_t n = c->oldest; n != NIL; n = c->nodes[n].newer) out.push_back(c->nodes[n].b);
        c->nodes.clear();
        c->spare = c->oldest = c->newest = NIL;
        c->keys.clear();
        std::fill(c->key_slots.begin(), c->key_slots.end(), NIL);
        c->cached_bytes = 0;
        c->cached_blocks = 0;
        if (bump) c->epoch++;
        if (disable) c->enabled = false;
        return out;
    }

    // A fresh start for a new registration: counters at 0, no limit, the live table of the last
    // one forgotten (its frees go to the allocator with the caller's size), a new epoch.
    static void enable(Cache* c) {
        std::lock_guard<std::mutex> g(c->mu);
        c->enabled = true;
        c->epoch++;
        c->hits = c->misses = c->evicted_blocks = c->evicted_bytes = 0;
        c->limit = NO_LIMIT;
        c->live.clear();
    }

    static Stats stats(Cache* c) {
        std::lock_guard<std::mutex> g(c->mu);
        return Stats{c->hits, c->misses, c->epoch, c->evicted_blocks, c->evicted_bytes, c->cached_bytes,
                     c->cached_blocks, c->live.count, c->limit, c->enabled};
    }

    }  // namespace xlog_actors_cache
    """
    cdef cppclass Cache "xlog_actors_cache::Cache":
        pass
    cdef cppclass Live "xlog_actors_cache::Live":
        size_t cls
        size_t req
        uintptr_t stream
        uint64_t epoch
    cdef cppclass Cached "xlog_actors_cache::Cached":
        uintptr_t ptr
        size_t cls
        uintptr_t stream
    cdef cppclass Stats "xlog_actors_cache::Stats":
        uint64_t hits, misses, epoch, evicted_blocks, evicted_bytes
        size_t cached_bytes, cached_blocks, live_blocks, limit
        cbool enabled
    size_t NO_LIMIT "xlog_actors_cache::NO_LIMIT"
    int PASS "xlog_actors_cache::PASS"
    int CACHED "xlog_actors_cache::CACHED"
    Cache* _cache_get "xlog_actors_cache::get"(int device) nogil
    Cache* _cache_ensure "xlog_actors_cache::ensure"(int device) nogil
    uintptr_t _cache_take "xlog_actors_cache::take"(
        Cache* c, size_t cls, size_t req, uintptr_t stream, uint64_t* epoch, cbool* tracked) nogil
    void _cache_note "xlog_actors_cache::note"(Cache* c, uintptr_t ptr, const Live& e) nogil
    int _cache_put "xlog_actors_cache::put"(
        Cache* c, uintptr_t ptr, size_t req, uintptr_t stream, Live* e, vector[Cached]* evicted) nogil
    vector[Cached] _cache_set_limit "xlog_actors_cache::set_limit"(Cache* c, size_t limit) nogil
    vector[Cached] _cache_drain "xlog_actors_cache::drain"(Cache* c, bint bump, bint disable) nogil
    void _cache_enable "xlog_actors_cache::enable"(Cache* c) nogil
    Stats _cache_stats "xlog_actors_cache::stats"(Cache* c) nogil


#: The exported symbols, for ``CUDAPluggableAllocator(library_path(), ALLOC_SYMBOL, FREE_SYMBOL)``.
ALLOC_SYMBOL = "xlog_actors_alloc"
ALLOC_OR_NULL_SYMBOL = "xlog_actors_alloc_or_null"
FREE_SYMBOL = "xlog_actors_free"

logger = logging.getLogger("xlog_actors.interop")

cdef dict _allocators = {}
cdef dict _last_errors = {}
cdef bint _exiting = False
cdef const char* _EXITING = b"xlog_actors: the interpreter is exiting; no more device allocations"


def _at_exit():
    global _exiting
    _exiting = True


atexit.register(_at_exit)


def register(int device, allocator):
    """Route the exported functions' calls for CUDA device ``device`` to ``allocator``, with
    the device's cache enabled afresh (counters at 0, in a new epoch: blocks handed out before
    are never cached).

    Args:
        device: the CUDA device ordinal the foreign library names (below 256 for a cache; a
            higher one is routed without).
        allocator: an object with ``allocate(nbytes, stream_handle) -> int`` (the device pointer)
            and ``free(ptr, nbytes, stream_handle) -> None``; optionally ``synchronize()``,
            called after the cache was given back on a refusal, before the one retry.
    Raises:
        TypeError: ``allocator`` lacks one of the two methods.
        ValueError: ``device`` is negative, or another allocator is registered for it.
    Thread rule: any thread.
    """
    if device < 0:
        raise ValueError(f"device ordinal must be >= 0, got {device}")
    if not callable(getattr(allocator, "allocate", None)) or not callable(getattr(allocator, "free", None)):
        raise TypeError(f"an allocator needs allocate() and free() methods, got {type(allocator).__name__}")
    current = _allocators.setdefault(device, allocator)
    if current is not allocator:
        raise ValueError(f"CUDA device {device} already routes its allocations to {current!r}")
    _last_errors.pop(device, None)
    cdef Cache* cache = _cache_ensure(device)
    if cache != NULL:
        _cache_enable(cache)


def unregister(int device, allocator=None):
    """Stop routing CUDA device ``device``'s calls (later allocations there are refused), after
    giving the cached blocks back through the allocator and disabling the cache.

    Args:
        device: the CUDA device ordinal.
        allocator: when given, unregister only if it is the one registered.
    Returns:
        whether an allocator was removed.
    Thread rule: any thread but the allocator's device actor's own.
    """
    current = _allocators.get(device)
    if current is None or (allocator is not None and current is not allocator):
        return False
    _release(device, current, True)
    del _allocators[device]
    return True


def registered(int device):
    """The allocator registered for CUDA device ``device``, or None. Thread rule: any thread."""
    return _allocators.get(device)


def last_error(int device):
    """The last refusal or failure met by the exported functions for ``device`` (the exception
    object, with its message and report), or None since the last :func:`register`.

    Thread rule: any thread.
    """
    return _last_errors.get(device)


def library_path():
    """The path of this shared library, the one to hand to ``CUDAPluggableAllocator``. It is
    already loaded (this module is), so a ``dlopen`` of it shares the registry above.

    Thread rule: any thread.
    """
    return __file__


def size_class(Py_ssize_t nbytes):
    """The size the bridge asks the allocator for when ``nbytes`` are asked: rounded up to 512
    bytes up to 4 KiB, then to a quarter of the largest power of two not above it.

    Raises:
        ValueError: ``nbytes`` is not positive.
    Thread rule: any thread.
    """
    if nbytes <= 0:
        raise ValueError(f"a size class needs a positive size, got {nbytes}")
    return class_size(<size_t>nbytes)


def empty_cache(int device):
    """Give every cached block of ``device`` back through its allocator (its ``free``); the
    cache stays enabled. A free that fails is logged and kept as :func:`last_error`, the others
    still done.

    Returns:
        the bytes given back (0 when nothing is registered or cached).
    Thread rule: any thread but the allocator's device actor's own.
    """
    allocator = _allocators.get(device)
    if allocator is None:
        return 0
    return _release(device, allocator, False)


def disable_cache(int device):
    """:func:`empty_cache`, and cache nothing more for ``device`` until it is registered again
    (an allocator being closed). Returns the bytes given back.

    Thread rule: any thread but the allocator's device actor's own.
    """
    allocator = _allocators.get(device)
    if allocator is None:
        return 0
    return _release(device, allocator, True)


def invalidate(int device):
    """Drop every cached block of ``device`` without freeing it, and start a new epoch: blocks
    handed out before are not cached when freed. For a rebuild: the cached blocks belonged to
    the old context, and their memory went with it.

    Returns:
        the dropped blocks, as ``(ptr, nbytes, stream_handle)`` tuples, for the allocator to
        forget.
    Thread rule: any thread (the device actor's own included: nothing is freed).
    """
    cdef Cache* cache = _cache_get(device)
    if cache == NULL:
        return []
    cdef vector[Cached] dropped = _cache_drain(cache, True, False)
    return [(<size_t>e.ptr, e.cls, <size_t>e.stream) for e in dropped]


def cache_stats(int device):
    """The cache's figures for ``device``: ``hits``, ``misses``, ``cached_bytes`` and
    ``cached_blocks`` (allocated, counted under the tag, free for reuse), ``live_blocks``
    (handed out by the bridge, not yet freed), ``limit`` (the most bytes it may hold, None for
    no limit), ``evicted_blocks`` and ``evicted_bytes`` (given back to make room under the
    limit, since the registration), ``epoch`` and ``enabled``; all 0 (False, None) for a device
    that was never registered.

    Thread rule: any thread.
    """
    cdef Cache* cache = _cache_get(device)
    if cache == NULL:
        return {"hits": 0, "misses": 0, "cached_bytes": 0, "cached_blocks": 0, "live_blocks": 0, "limit": None,
                "evicted_blocks": 0, "evicted_bytes": 0, "epoch": 0, "enabled": False}
    cdef Stats st = _cache_stats(cache)
    return {"hits": st.hits, "misses": st.misses, "cached_bytes": st.cached_bytes, "cached_blocks": st.cached_blocks,
            "live_blocks": st.live_blocks, "limit": None if st.limit == NO_LIMIT else st.limit,
            "evicted_blocks": st.evicted_blocks, "evicted_bytes": st.evicted_bytes, "epoch": st.epoch,
            "enabled": st.enabled}


def set_cache_limit(int device, limit):
    """Bound what ``device``'s cache may hold idle: a free that would take it past ``limit``
    bytes first gives the oldest cached blocks back through the allocator (stream-ordered, as
    any free), and a block larger than the limit is not cached. The oldest blocks past a lower
    new limit are given back now. A new registration starts without a limit.

    Args:
        device: the CUDA device ordinal, with an allocator registered.
        limit: a byte count >= 0 (0: nothing is cached), or None for no limit.
    Returns:
        the bytes given back now.
    Raises:
        ValueError: no allocator is registered for ``device``, it has no cache (256 and up), or
            ``limit`` is negative; nothing changed.
        TypeError: ``limit`` is neither an int nor None.
    Thread rule: any thread but the allocator's device actor's own.
    """
    if limit is not None and (type(limit) is bool or not isinstance(limit, int)):
        raise TypeError(f"a cache limit is an int or None, got {limit!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"a cache limit must be >= 0, got {limit}")
    allocator = _allocators.get(device)
    cdef Cache* cache = _cache_get(device)
    if allocator is None or cache == NULL:
        raise ValueError(f"CUDA device {device} has no registered allocator with a cache to limit")
    cdef size_t bound = NO_LIMIT if limit is None or limit >= <object>NO_LIMIT else <size_t>limit
    cdef vector[Cached] evicted = _cache_set_limit(cache, bound)
    return _free_blocks(device, allocator, evicted)


cdef size_t _release(int device, allocator, bint disable):
    """Take the cached blocks out (disabling the cache if told) and free them through
    ``allocator``; the bytes freed."""
    cdef Cache* cache = _cache_get(device)
    if cache == NULL:
        return 0
    cdef vector[Cached] blocks = _cache_drain(cache, False, disable)
    return _free_blocks(device, allocator, blocks)


cdef size_t _free_blocks(int device, allocator, vector[Cached]& blocks):
    """Free blocks taken out of the cache through ``allocator``; the bytes freed. A failed free
    is logged and kept as the device's last error, the others still done."""
    cdef size_t freed = 0
    for e in blocks:
        try:
            allocator.free(<size_t>e.ptr, e.cls, <size_t>e.stream)
            freed += e.cls
        except BaseException as exc:  # noqa: BLE001 - one failed free must not keep the others
            _last_errors[device] = exc
            logger.error("device allocator of CUDA device %d: free of cached %#x failed: %r", device,
                         <size_t>e.ptr, exc)
    return freed


cdef void* _allocate(Py_ssize_t size, int device, void* stream, string* message) noexcept with gil:
    allocator = _allocators.get(device)
    try:
        if allocator is None:
            raise LookupError(f"xlog_actors: no device routes CUDA device {device}'s allocations (not registered)")
        try:
            return <void*><size_t>allocator.allocate(size, <size_t>stream)
        except MemoryError:
            # The cache's blocks are allocated: give them back, wait for their stream-ordered
            # frees (as torch's allocator synchronizes before its own retry), then try once more.
            if _release(device, allocator, False) == 0:
                raise
            settle = getattr(allocator, "synchronize", None)
            if settle is not None:
                settle()
        return <void*><size_t>allocator.allocate(size, <size_t>stream)
    except BaseException as exc:  # noqa: BLE001 - C has no exceptions: kept, and handed on as text
        _last_errors[device] = exc
        message[0] = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        return NULL


cdef void* _alloc_or_null(Py_ssize_t size, int device, void* stream, string* message) noexcept nogil:
    if size <= 0:
        return NULL  # torch asks for 0 bytes for an empty tensor, and takes NULL for it
    cdef Cache* cache = _cache_get(device)
    cdef uint64_t epoch = 0
    cdef cbool tracked = False
    cdef size_t cls = <size_t>size
    cdef uintptr_t hit
    cdef Live entry
    if cache != NULL:
        cls = class_size(<size_t>size)
        hit = _cache_take(cache, cls, <size_t>size, <uintptr_t>stream, &epoch, &tracked)
        if hit != 0:
            return <void*>hit
        if not tracked:
            cls = <size_t>size  # not cached: the allocator gets the size asked
    if _exiting or not Py_IsInitialized():
        message[0] = string(_EXITING)
        return NULL
    cdef void* ptr = _allocate(<Py_ssize_t>cls, device, stream, message)
    if ptr != NULL and tracked:
        entry.cls = cls
        entry.req = <size_t>size
        entry.stream = <uintptr_t>stream
        entry.epoch = epoch
        _cache_note(cache, <uintptr_t>ptr, entry)
    return ptr


cdef public void* xlog_actors_alloc(Py_ssize_t size, int device, void* stream) noexcept nogil:
    cdef string message
    cdef void* ptr = _alloc_or_null(size, device, stream, &message)
    if ptr == NULL and size > 0:
        # The GIL is not held here: _allocate gave it back, so unwinding leaves it untouched.
        _throw(message)
    return ptr


cdef public void* xlog_actors_alloc_or_null(Py_ssize_t size, int device, void* stream) noexcept nogil:
    cdef string message
    return _alloc_or_null(size, device, stream, &message)


cdef bint _free(void* ptr, Py_ssize_t size, int device, void* stream) noexcept with gil:
    allocator = _allocators.get(device)
    try:
        if allocator is None:
            raise LookupError(
                f"xlog_actors: no device routes CUDA device {device}'s frees (not registered): "
                f"{size} bytes at {<size_t>ptr:#x} are not freed"
            )
        allocator.free(<size_t>ptr, size, <size_t>stream)
        return True
    except BaseException as exc:  # noqa: BLE001 - a free cannot raise into C: logged and kept
        _last_errors[device] = exc
        logger.error("device allocator of CUDA device %d: free of %#x failed: %r", device, <size_t>ptr, exc)
        return False


cdef void _free_evicted(int device, vector[Cached]& blocks) noexcept with gil:
    allocator = _allocators.get(device)
    if allocator is None:  # unregistered between the eviction and now: nobody to free them
        logger.error("device allocator of CUDA device %d: %d evicted block(s) had no allocator to go back to",
                     device, blocks.size())
        return
    _free_blocks(device, allocator, blocks)


cdef public void xlog_actors_free(void* ptr, Py_ssize_t size, int device, void* stream) noexcept nogil:
    if ptr == NULL or _exiting or not Py_IsInitialized():
        return  # nothing to free, or the process is going and its memory with it
    cdef Cache* cache = _cache_get(device)
    cdef Live entry
    cdef int outcome = PASS
    cdef vector[Cached] evicted
    if cache != NULL and size > 0:
        outcome = _cache_put(cache, <uintptr_t>ptr, <size_t>size, <uintptr_t>stream, &entry, &evicted)
        if outcome == CACHED:
            if not evicted.empty():
                _free_evicted(device, evicted)
            return
    if outcome == PASS:
        _free(ptr, size, device, stream)
    elif not _free(ptr, <Py_ssize_t>entry.cls, device, stream):
        _cache_note(cache, <uintptr_t>ptr, entry)  # the allocator kept it: still live here
