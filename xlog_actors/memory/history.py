"""``MemoryHistory``: every allocation and free of a device's base resource, with the Python stack
that asked for it, kept in a bounded ring and written in the snapshot format PyTorch's memory
viewer reads.

The compiled resources (``AsyncCudaResource``, ``DirectCudaResource``) record each allocation and
each successful free once a history is set on them (``set_history``); nothing is recorded, and
nothing is paid but one pointer compare, while none is. ``MemoryHistory`` is the Python face of the
compiled ``HistoryRing`` (``_core/history_ring.pyx``), which the resources call in C: the ring, the
live blocks, the interned stacks and the stack walk are there; here are the settings' checks, the
stacks of requests served for another thread (``asked_from``), and the readers (``events``,
``snapshot``, ``dump``). ``XlogDeviceRuntime.set_history`` finds the base resource under any
adaptor stack, and a ``DeviceActor`` switches it on with the ``RecordMemoryHistory`` message.

What one event keeps (C structs in the ring; tuples, then dicts, only when read): the wall-clock
time in nanoseconds (``CLOCK_REALTIME``, as ``time.time_ns``), the action (``alloc`` or
``free``; with a block cache in the stack, which records instead of the base resource, also
``cache_hit`` and ``trim``), the device ordinal, the stream (the ``StreamId`` the block was allocated on, as an
int), the tag, the size in bytes, the address, and the stack: at most ``max_frames`` (code object,
instruction offset) pairs, innermost first (no ``traceback``/``inspect`` objects, no source read;
the line numbers are worked out from the offsets only when a snapshot is taken), skipping the
runtime's own frames (files inside the ``xlog_actors`` package, inside ``pykka``, and
``threading.py``: ``_is_runtime``, cached per file name in ``_skip_cache``), so the user's code is
on top. A ``DeviceActor`` serves requests on its own thread; there the stack is the one captured
(``capture_frames``) where the ``Allocate``/``AllocateMany``/``Free`` message was made
(``messages.py``), in the asker's thread. Frees of dropped handles, which the device actor performs
on its own, carry an empty stack.

Thread rule: every name, any thread (each says how).
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

from .._core.history_ring import HistoryRing
from ..errors import InvalidRequest

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_FRAMES",
    "ORIGIN_CAPTURE",
    "SNAPSHOT_FORMAT",
    "Frames",
    "MemoryHistory",
    "capture_frames",
    "check_max_entries",
    "frame_line",
    "origin_capture",
]

#: The ring's default bound (PyTorch's own default is unbounded; ours is not).
DEFAULT_MAX_ENTRIES = 100_000
#: The most frames kept per event: each costs about 0.1-0.25 µs to walk, twice per block (its
#: allocation and its free), and the innermost frames are the ones that name the culprit.
DEFAULT_MAX_FRAMES = 8
#: The version of the ``"xlog_actors"`` key of a snapshot.
SNAPSHOT_FORMAT = 1

#: A captured stack: (code object, instruction offset) pairs, innermost first.
Frames = tuple[tuple[CodeType, int], ...]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_THREADING_FILE = os.path.abspath(threading.__file__) if threading.__file__ else "threading.py"
_PYKKA_PART = os.sep + "pykka" + os.sep
# filename -> whether its frames are the runtime's own (skipped). Filenames are few and shared.
_skip_cache: dict[str, bool] = {}

#: ``ORIGIN_CAPTURE[0]`` > 0 while some device actor records a history: only then do the
#: ``Allocate``/``AllocateMany``/``Free`` messages capture the stack of the thread that makes them
#: (a list, so the check is one index, not a function call).
ORIGIN_CAPTURE = [0]
_origin_lock = threading.Lock()


def _is_runtime(filename: str) -> bool:
    skip = _skip_cache.get(filename)
    if skip is None:
        path = os.path.abspath(filename) if filename[:1] not in ("<", "") else filename
        skip = path.startswith(_PACKAGE_DIR) or _PYKKA_PART in path or path == _THREADING_FILE
        _skip_cache[filename] = skip
    return skip


def capture_frames(frame: FrameType | None, max_frames: int = DEFAULT_MAX_FRAMES) -> Frames:
    """The stack from ``frame`` outwards, without the runtime's own frames.

    Each frame is kept as its code object and its instruction offset (``f_lasti``): reading
    ``f_lineno`` decodes the line table, several times dearer, so lines are found only when a
    snapshot is taken (:func:`frame_line`).

    Args:
        frame: where to start (``sys._getframe(n)``); None gives an empty stack.
        max_frames: the most frames kept (the innermost ones).
    Returns:
        (code object, instruction offset) pairs, innermost first.
    Thread rule: any thread, on a frame of its own stack.
    """
    out: list[tuple[CodeType, int]] = []
    append = out.append
    cache = _skip_cache
    n = 0
    while frame is not None:
        code = frame.f_code
        skip = cache.get(code.co_filename)
        if skip is None:
            skip = _is_runtime(code.co_filename)
        if not skip:
            append((code, frame.f_lasti))
            n += 1
            if n == max_frames:
                break
        frame = frame.f_back
    return tuple(out)


_line_cache: dict[tuple[CodeType, int], int] = {}


def frame_line(code: CodeType, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code`` (as ``f_lineno`` would say).

    Thread rule: any thread.
    """
    key = (code, lasti)
    line = _line_cache.get(key)
    if line is None:
        line = code.co_firstlineno
        for start, end, number in code.co_lines():
            if start <= lasti < end:
                if number is not None:
                    line = number
                break
        if len(_line_cache) > 100_000:
            _line_cache.clear()
        _line_cache[key] = line
    return line


@contextmanager
def origin_capture() -> Iterator[None]:
    """While entered, messages capture the stack where they are made (see ``ORIGIN_CAPTURE``).
    Nests; a device actor holds it while it records.

    Thread rule: any thread.
    """
    with _origin_lock:
        ORIGIN_CAPTURE[0] += 1
    try:
        yield
    finally:
        with _origin_lock:
            ORIGIN_CAPTURE[0] -= 1


def check_max_entries(value: object, what: str = "max_entries") -> int:
    """``value`` if it is a positive ``int`` (not a ``bool``).

    Raises:
        InvalidRequest: otherwise, naming ``what``.
    Thread rule: any thread.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequest(f"{what} must be a positive int, got {value!r}")
    return value


# One event, as ``HistoryRing.entries`` gives it back: (time_ns, action, device, stream, tag, nbytes,
# ptr, frames, note, generation).
_Entry = tuple[int, str, int, int, str, int, int, Frames, str, int]


def _frames_dicts(frames: Frames) -> list[dict[str, Any]]:
    return [{"filename": code.co_filename, "line": frame_line(code, lasti), "name": code.co_name}
            for code, lasti in frames]


class MemoryHistory(HistoryRing):
    """A bounded, thread-safe record of allocations and frees.

    ``MemoryHistory(max_entries=100_000, max_frames=8)``. Give it to
    ``XlogDeviceRuntime.set_history`` (or a base resource's ``set_history``), or let a
    ``DeviceActor`` own one (``RecordMemoryHistory``). The ring keeps the newest ``max_entries``
    events; the blocks still live are kept apart from the ring (one entry per live block), so a
    snapshot lists every block live at that moment even when its allocation left the ring.
    Recording (``record_alloc``, ``record_free``, ``forget_device``), ``resize``, ``clear``,
    ``recorded`` and ``len()`` are the compiled ``HistoryRing``'s (see
    ``xlog_actors/_core/history_ring.pyx``): an event is a C struct, its stack an interned id.

    The snapshot follows the format of ``torch.cuda.memory._snapshot()`` as documented in
    ``torch/cuda/memory.py`` and read by ``torch/cuda/_memory_viz.py`` (PyTorch 2.11 and the
    ``main`` branch of late 2026; the trace-entry keys are those of PyTorch 2.1 and later).

    Thread rule: every method, any thread, any time; events from several threads are kept in the
    order they took the lock, which is the order of the calls except in one race: when a free in
    one thread and the reuse of its address by another thread's allocation record at the same
    moment, the allocation may come first (the live blocks stay right: they are matched by
    generation).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        """
        Args:
            max_entries: the most events kept (a positive int).
            max_frames: the most frames kept per event (a positive int).
        Raises:
            InvalidRequest: either is not a positive int.
        """
        super().__init__(check_max_entries(max_entries), check_max_entries(max_frames, "max_frames"),
                         _skip_cache, _is_runtime)

    @contextmanager
    def asked_from(self, frames: Frames | None) -> Iterator[None]:
        """While entered, events recorded in this thread carry ``frames`` (the stack captured
        where a request was made, in another thread) instead of this thread's stack.

        Thread rule: any thread; it affects only the calling thread.
        """
        if frames is None:
            yield
            return
        ident = threading.get_ident()
        before = self._origins.get(ident)
        self._origins[ident] = frames  # one key per thread: no other thread writes it
        try:
            yield
        finally:
            if before is None:
                del self._origins[ident]
            else:
                self._origins[ident] = before

    # -- settings ---------------------------------------------------------------------------------
    def resize(self, max_entries: int) -> None:
        """Change the ring's bound, keeping the newest events that fit.

        Raises:
            InvalidRequest: ``max_entries`` is not a positive int; nothing changes.
        Thread rule: any thread.
        """
        super().resize(check_max_entries(max_entries))

    # -- reading ----------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """The events in the ring, oldest first, as plain dicts: ``time_ns``, ``action``
        (``"alloc"``/``"free"``, and under a block cache ``"cache_hit"`` (an allocation served from
        a kept block) and ``"trim"`` (a kept block given back)), ``device``, ``stream``, ``tag``,
        ``size``, ``addr``, ``frames`` (``[{"filename", "line", "name"}]``, innermost first) and
        ``note``.

        Thread rule: any thread.
        """
        entries = self.entries()[0]
        return [
            {"time_ns": t, "action": a, "device": d, "stream": int(s), "tag": str(tag), "size": n, "addr": p,
             "frames": _frames_dicts(f), "note": note}
            for t, a, d, s, tag, n, p, f, note, _g in entries
        ]

    def snapshot(self) -> dict[str, Any]:
        """The history in the format of ``torch.cuda.memory._snapshot()``.

        * ``"segments"``: one segment per block live now (a stream-ordered pool hides the driver's
          own segments, so each block is its own segment, ``segment_type`` ``"large"`` above 1
          MiB else ``"small"``), each with one ``"active_allocated"`` block; keys ``device``,
          ``address``, ``total_size``, ``allocated_size``, ``active_size``, ``requested_size``,
          ``stream``, ``segment_type``, ``segment_pool_id``, ``is_expandable``, ``frames``,
          ``blocks`` (``size``, ``requested_size``, ``address``, ``state``, ``frames``).
        * ``"device_traces"``: one list per device ordinal (up to the highest one seen), oldest
          first; an allocation is one ``"alloc"`` entry (with ``"cache_hit": True`` where a block
          cache served it from a kept block), a free a ``"free_requested"`` and a
          ``"free_completed"`` entry at the time it was asked (a stream-ordered free completes
          later on its stream; the history does not wait for it), and a kept block a block cache
          gives back to its upstream a ``"segment_free"`` entry. Keys: ``action``, ``addr``,
          ``size``, ``stream``, ``time_us`` (microseconds since the epoch), ``frames``
          (``{"filename", "line", "name"}``, innermost first), ``compile_context`` and
          ``user_metadata`` (empty).
        * ``"allocator_settings"``: empty.

        Extra keys the viewer ignores and ``xlog-actors memory`` reads: ``"tag"`` on every trace
        entry, segment and block; ``"note"`` on a free the runtime recorded for a whole context
        (``"context rebuilt"``); and ``"xlog_actors"``: ``{"format", "max_entries", "recorded",
        "dropped", "tags"}``.

        Thread rule: any thread; the snapshot is of one instant (taken under the lock).
        """
        entries, live, recorded, max_entries = self.entries()
        devices = 1 + max([e[2] for e in entries] + [e[2] for e in live] + [-1])
        traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
        tags: set[str] = set()
        for t, action, device, stream_id, alloc_tag, nbytes, ptr, frames, note, _g in entries:
            stream, tag = int(stream_id), str(alloc_tag)
            tags.add(tag)
            fdicts = _frames_dicts(frames)
            base = {"addr": ptr, "size": nbytes, "stream": stream, "time_us": t // 1000, "frames": fdicts,
                    "compile_context": "", "user_metadata": "", "tag": tag}
            if note:
                base["note"] = note
            if action == "alloc":
                traces[device].append({"action": "alloc", **base})
            elif action == "cache_hit":
                traces[device].append({"action": "alloc", "cache_hit": True, **base})
            elif action == "trim":
                traces[device].append({"action": "segment_free", **base})
            else:
                traces[device].append({"action": "free_requested", **base})
                traces[device].append({"action": "free_completed", **base})
        segments = []
        for _t, _a, device, stream_id, alloc_tag, nbytes, ptr, frames, _n, _g in sorted(
            live, key=lambda e: (e[2], e[6])
        ):
            stream, tag = int(stream_id), str(alloc_tag)
            tags.add(tag)
            fdicts = _frames_dicts(frames)
            block = {"address": ptr, "size": nbytes, "requested_size": nbytes, "state": "active_allocated",
                     "frames": fdicts, "tag": tag}
            segments.append({
                "device": device, "address": ptr, "total_size": nbytes, "allocated_size": nbytes,
                "active_size": nbytes, "requested_size": nbytes, "stream": stream,
                "segment_type": "large" if nbytes > (1 << 20) else "small", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": fdicts, "blocks": [block], "tag": tag,
            })
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": {},
            "xlog_actors": {
                "format": SNAPSHOT_FORMAT, "max_entries": max_entries, "recorded": recorded,
                "dropped": recorded - len(entries), "tags": sorted(tags),
            },
        }

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`snapshot` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does (one
        ``pickle.dump`` of the dict), for ``xlog-actors memory`` or pytorch.org/memory_viz.

        Raises:
            OSError: the file cannot be written.
        Thread rule: any thread.
        """
        snap = self.snapshot()
        with open(path, "wb") as f:
            pickle.dump(snap, f)

    def __repr__(self) -> str:
        return f"MemoryHistory(events={len(self)}, max_entries={self.max_entries}, live={self.live_blocks})"
