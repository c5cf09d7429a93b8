# The size classes of the block caches: 512-byte steps up to 4 KiB, then four classes per power
# of two (a size rounded up to a quarter of the largest power of two not above it: at most 25%
# more). Shared because the rule is one promise kept in three places: the block cache
# (cache_core) and the allocator bridge's cache (alloc_bridge) ask their upstream for the same
# sizes (their ``size_class`` functions are tested equal), and the null allocator is the bench's
# ceiling for the bridge only while it rounds as the bridge does.

cdef extern from *:
    int __builtin_clzll(unsigned long long x) nogil


cdef inline size_t class_size(size_t n) noexcept nogil:
    # The class's size in bytes for a request of ``n`` > 0 bytes. ``step`` is a power of two, so
    # the mask rounds as a division would, without one (a 64-bit division is tens of cycles).
    cdef size_t step = 512
    if n > 4096:
        step = ((<size_t>1) << (63 - __builtin_clzll(<unsigned long long>n))) >> 2
    return (n + step - 1) & ~(step - 1)


cdef inline Py_ssize_t class_index(size_t cls) noexcept nogil:
    # The index of class size ``cls``, dense from 0: 512 .. 4096 are 0 .. 7; above, with
    # 2**t <= cls < 2**(t + 1), cls = q * 2**(t - 2) with q in 4..7 (4: a power of two, the
    # previous power's last class), so each power of two past 4 KiB adds four indices (a class of
    # up to 2**48 bytes is below 152, of up to 2**63 below 212).
    cdef int t
    if cls <= 4096:
        return <Py_ssize_t>(cls >> 9) - 1
    t = 63 - __builtin_clzll(<unsigned long long>cls)
    return 8 + (t - 12) * 4 + <Py_ssize_t>(cls >> (t - 2)) - 5
