"""Named shared-memory segments: what processes of one node map together.

A :class:`SharedSegment` is a POSIX shared-memory object (``/dev/shm/<name>``, Linux) mapped
whole. The host driver keeps the emulated device memory of a shareable device in one, and the
handle export keeps its small tables (generation cell, reference counts, event counters) in
others. Pages are committed only when touched, so a large segment costs nothing until used.

Invariants: the creating process owns the name. It unlinks the name itself on
:meth:`SharedSegment.close`, and registers it with ``multiprocessing``'s resource tracker, which
unlinks it when the tracker's process tree ends. A process that opens the segment never unlinks
it. Unlinking removes only the name: every process that mapped the segment keeps its mapping (and
the bytes) until it unmaps, so a late reader never faults.

The resource tracker: one tracker process serves a whole process tree (a spawned child writes to
its parent's), keeps a set of names, and prints a traceback (``KeyError``) for an ``unregister``
of a name it does not hold, and a "leaked shared_memory objects" warning for every name still
held when the tree ends. Only the owner's :meth:`SharedSegment.close` unregisters plainly (its
own :meth:`SharedSegment.create` registered the name). A process that unlinks a name it does not
own (a dead child's, :func:`unlink_segments_of`; an orphan, :func:`sweep_orphans`) cannot know
whether its tracker holds the name: the owner may have died before registering it or after
unregistering it, and an orphan of another process tree was never registered here. It therefore
*forgets* the name (:func:`_forget`: a ``register`` then an ``unregister``, which leaves the name
out of the tracker's set whether or not it was in it), and does so before it unlinks. Likewise the
owner unregisters before it unlinks: killed between the two steps, either leaves a file nobody
tracks, which the next sweep takes, never a tracked name without a file.

Names and orphans: :func:`segment_name` puts the creator's pid *and* a random token drawn once per
process in every name, so a name never repeats on the node, not even when a pid is reused after a
reboot-free container restart shares ``/dev/shm`` with the old one. The owner holds a shared
``flock`` on the segment's file for as long as it owns it; the kernel drops it when the owner dies
however it dies. A segment whose lock nobody holds is an orphan: its owner and its owner's
tracker were both killed (a Ray worker killed with its process group, say). The first segment a
process creates sweeps the orphans older than :data:`ORPHAN_AGE_S` away (:func:`sweep_orphans`);
the lock, not the pid, says who is alive, so a process of another pid namespace that shares
``/dev/shm`` is never mistaken for a dead one.

Thread rules: the mapping may be read and written from any thread (ordering is the caller's).
:meth:`SharedSegment.locked` serializes a read-modify-write of a range across the threads of
this process (a lock per segment name, shared by every mapping of the name in the process) and
across processes (an ``fcntl.lockf`` record lock, which on its own does not exclude threads, nor
two mappings, of one process). The lock is reentrant within a thread: the garbage collector runs
finalizers on whatever thread allocates, so a handle's finalizer that gives a count back may run
inside a section its thread already holds (the owner's sweep, say); it then runs as part of that
section (a plain lock would hang the thread there, and every later exporter with it).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker

from ..errors import DeviceUnavailable, InvalidRequest
from .once import made_once

__all__ = [
    "ORPHAN_AGE_S",
    "SHM_DIR",
    "SharedSegment",
    "mapped",
    "mapped_if_open",
    "segment_name",
    "sweep_orphans",
    "unlink_segments_of",
]

#: Where POSIX shared-memory objects live on Linux.
SHM_DIR = "/dev/shm"

#: How old an unlocked segment must be before a sweep takes it for an orphan, in seconds. An
#: owner takes its lock microseconds after it creates the file; the margin covers a stalled one.
ORPHAN_AGE_S = 10.0

_serial = itertools.count()
_token: tuple[int, str] = (-1, "")
_swept_in = -1  # the pid that made its first segment (and swept): a forked child sweeps again


def segment_name(what: str, ordinal: int) -> str:
    """A segment name never used before on the node: ``xlog-<what>-<pid>-<token>-<ordinal>-<serial>``.

    ``token`` is random, drawn once per process (again after a fork), so a reused pid never meets
    a name an earlier process of that pid left behind.

    Args:
        what: the segment's role (``mem``, ``events``, ``refs``, ``lane``); no ``-`` or ``/``.
        ordinal: the device it belongs to.
    Returns:
        The name, without the leading slash.
    Thread rule: any thread.
    """
    global _token
    pid = os.getpid()
    if _token[0] != pid:
        _token = (pid, secrets.token_hex(4))
    return f"xlog-{what}-{pid}-{_token[1]}-{ordinal}-{next(_serial)}"

class _RangeLock:
    """The lock of one segment name in this process: a reentrant thread lock, and how deep the
    thread holding it is (only the outermost section takes and lets go of the record lock).

    Thread rule: ``depth`` is read and written only by the thread holding ``lock``.
    """

    __slots__ = ("depth", "lock")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0


_name_locks: dict[str, _RangeLock] = {}
_name_locks_guard = threading.Lock()


def _lock_of(name: str) -> _RangeLock:
    with _name_locks_guard:
        lock = _name_locks.get(name)
        if lock is None:
            lock = _name_locks[name] = _RangeLock()
        return lock


class SharedSegment:
    """One named shared-memory segment, mapped; see the module docstring.

    Fields: ``name`` (without the leading slash), ``size`` (bytes), ``mm`` (the ``mmap``),
    ``owner`` (True in the creating process).

    Thread rule: see the module docstring; :meth:`close` once.
    """

    __slots__ = ("_fd", "_lock", "mm", "name", "owner", "size")

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        """Map ``size`` bytes of the open object ``fd`` (use :meth:`create` or :meth:`open`)."""
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        self._lock = _lock_of(name)
        self.mm = mmap.mmap(fd, size)

    @staticmethod
    def _path(name: str) -> str:
        if not name or "/" in name or "\0" in name:
            raise InvalidRequest(f"a shared segment name must be a non-empty file name, got {name!r}")
        if not os.path.isdir(SHM_DIR):
            raise DeviceUnavailable(f"shared device memory needs POSIX shared memory at {SHM_DIR} (Linux)")
        return os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        """Create the segment ``name`` of ``size`` zeroed bytes, owned by this process.

        The first call in a process sweeps orphaned segments away first (:func:`sweep_orphans`).

        Args:
            name: a file name unique on the node (:func:`segment_name` makes one).
            size: bytes, positive.
        Returns:
            The mapped segment.
        Raises:
            InvalidRequest: a bad name or size, or the name exists already.
            DeviceUnavailable: no POSIX shared memory on this system.
        Thread rule: any thread.
        """
        if type(size) is not int or size <= 0:
            raise InvalidRequest(f"a shared segment size must be a positive int, got {size!r}")
        path = cls._path(name)
        global _swept_in
        if _swept_in != os.getpid():
            _swept_in = os.getpid()
            sweep_orphans(ORPHAN_AGE_S)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise InvalidRequest(f"shared segment {name!r} exists already") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "owned": held until close() or this process's death
            os.ftruncate(fd, size)
            segment = cls(name, fd, size, owner=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        # The tracker unlinks the name if this process dies before close() does.
        resource_tracker.register("/" + name, "shared_memory")
        return segment

    @classmethod
    def open(cls, name: str) -> SharedSegment:
        """Map the existing segment ``name`` (made by another process, or this one).

        Returns:
            The mapped segment, not owned (its close never unlinks).
        Raises:
            DeviceUnavailable: no segment of that name (its owner closed it, or died).
            InvalidRequest: a bad name.
        Thread rule: any thread.
        """
        path = cls._path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise DeviceUnavailable(f"shared segment {name!r} is gone: its owner closed it or ended") from None
        try:
            return cls(name, fd, os.fstat(fd).st_size, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def int64s(self, offset: int, count: int) -> memoryview:
        """``count`` native int64 cells from byte ``offset`` (8-aligned), as a writable view.

        A single aligned 8-byte load or store through it is what the hardware makes atomic; a
        read-modify-write needs :meth:`locked`.

        Thread rule: any thread.
        """
        return memoryview(self.mm)[offset : offset + 8 * count].cast("q")

    @contextlib.contextmanager
    def locked(self, offset: int, length: int) -> Iterator[None]:
        """Hold the range ``[offset, offset + length)`` exclusively, across threads and processes.

        A section entered again by the thread that holds it (a finalizer run by the garbage
        collector inside it) runs as part of the outer one: the record lock is taken by the
        outermost section only, and let go when it ends (the callers of a segment all lock the
        same range).

        Thread rule: any thread; never hold it across a blocking wait.
        """
        held = self._lock
        with held.lock:
            outermost = held.depth == 0
            if outermost:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, length, offset)
            held.depth += 1
            try:
                yield
            finally:
                held.depth -= 1
                if outermost:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, length, offset)

    def close(self) -> None:
        """Unmap (or leave that to the last view still exporting the mapping), close the file,
        and, in the owner, unlink the name. Idempotent.

        Thread rule: any thread, once the segment's users are done with it.
        """
        if self._fd < 0:
            return
        with contextlib.suppress(BufferError):
            # A view still exports the mapping: it is unmapped when the last view goes.
            self.mm.close()
        fd, self._fd = self._fd, -1
        try:
            if self.owner:
                # Both steps while the ownership lock is still held (closing the file lets go of
                # it): a sweep that found the lock free could otherwise forget and unlink the name
                # between them, and this unregister would then be one too many. Unregistered
                # first: killed between the two, this process leaves a file that its parent or a
                # sweep unlinks, where the other order left the tracker a name with no file (a
                # "leaked" warning and a failed unlink when the tree ends).
                resource_tracker.unregister("/" + self.name, "shared_memory")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, self.name))
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"SharedSegment({self.name!r}, {self.size} bytes{', owner' if self.owner else ''})"


_mapped: dict[str, SharedSegment] = {}
_mapped_lock = threading.Lock()


def mapped(name: str) -> SharedSegment:
    """This process's one mapping of segment ``name``: opened on first use, then kept (a mapping
    outlives the name's unlinking, so a kept one stays valid).

    Raises:
        DeviceUnavailable, InvalidRequest: as :meth:`SharedSegment.open`, on first use.
    Thread rule: any thread.
    """
    return made_once(_mapped, _mapped_lock, name, lambda: SharedSegment.open(name))


def mapped_if_open(name: str) -> SharedSegment | None:
    """The mapping :func:`mapped` keeps for ``name``, or None if this process never opened it;
    opens nothing (for finalizers). Thread rule: any thread."""
    return _mapped.get(name)


def _forget(name: str) -> None:
    """Leave segment ``name`` out of this process tree's resource tracker, whether or not the
    tracker holds it (see the module docstring).

    A plain ``unregister`` of a name the tracker does not hold makes the tracker process print a
    ``KeyError`` traceback (the error is raised there, not here); a ``register`` first makes the
    ``unregister`` always find the name. Both go down the one pipe every process of the tree
    writes to, in order, after anything the name's dead owner wrote.

    Args:
        name: the segment's name, without the leading slash.
    Thread rule: any thread.
    """
    resource_tracker.register("/" + name, "shared_memory")
    resource_tracker.unregister("/" + name, "shared_memory")


def _unlink_unowned(name: str, min_age_s: float, now: float) -> bool:
    """Unlink segment ``name`` if no process holds its ownership lock and it is at least
    ``min_age_s`` old (at ``now``, by its change time); forget it in the tracker first.

    Returns:
        Whether this call unlinked it (False: owned, too young, gone meanwhile, or another
        user's).
    Thread rule: any thread.
    """
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, or another user's
        return False
    try:
        st = os.fstat(fd)
        if now - st.st_ctime < min_age_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner holds the lock: alive
        try:
            if os.stat(path).st_ino != st.st_ino:
                return False  # not the file judged any more: a new one of the same name
        except OSError:
            return False
        # Forgotten before the unlink: killed between the two, this process leaves an untracked
        # file (the next sweep takes it), never a tracked name without a file.
        _forget(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def unlink_segments_of(pid: int) -> list[str]:
    """Unlink the segments a dead process of this runtime owned (named ``xlog-<what>-<pid>-...``).

    The resource tracker would unlink them only when the tracking process tree ends; a parent
    that replaces a killed child calls this so that each death does not leave its device memory
    in ``/dev/shm`` until then. Processes that mapped a segment keep their mapping. Each name is
    forgotten in this process tree's tracker (whether the child had registered it or not), and a
    segment whose ownership lock is held is kept: its pid was reused by a live process.

    Args:
        pid: the dead process.
    Returns:
        The names unlinked.
    Thread rule: any thread; call it only once ``pid`` is dead (its names are then unused).
    """
    if not os.path.isdir(SHM_DIR):
        return []
    now = time.time()
    gone = []
    for name in os.listdir(SHM_DIR):
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "xlog" and parts[2] == str(pid) and _unlink_unowned(name, 0.0, now):
            gone.append(name)
    return gone


def sweep_orphans(min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Unlink this runtime's segments (``xlog-*``) that no live process owns any more.

    A segment is an orphan when no process holds its ownership lock (the owner died, and so did
    the resource tracker that would have unlinked it) and it is older than ``min_age_s`` (so a
    segment being created is never taken). Segments of other users, and names that vanish
    meanwhile, are passed over. Processes that mapped an orphan keep their mapping. Each orphan
    is forgotten in this process tree's tracker (an orphan of this tree may be in it; one of
    another tree never is).

    Args:
        min_age_s: the youngest age, by the file's change time, taken for an orphan; >= 0.
    Returns:
        The names unlinked.
    Raises:
        InvalidRequest: a negative ``min_age_s``.
    Thread rule: any thread.
    """
    if not min_age_s >= 0:
        raise InvalidRequest(f"min_age_s must be >= 0 seconds, got {min_age_s!r}")
    if not os.path.isdir(SHM_DIR):
        return []
    now = time.time()
    return [name for name in os.listdir(SHM_DIR) if name.startswith("xlog-") and _unlink_unowned(name, min_age_s, now)]
