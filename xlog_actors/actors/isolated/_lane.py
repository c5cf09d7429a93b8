"""The parent's side of a child's call lane (``_core.call_lane``): allocations posted in shared
memory and answered in place, without a pickle or a system call.

Invariants:

* Only an asked ``Allocate`` whose fields fit a slot goes through the lane (an int size, a
  ``StreamId``, an ``AllocTag`` of at most ``MAX_TAG`` bytes, no origin); anything else, or no
  free slot, leaves the request to the pipe before anything was sent.
* A request carries the frees queued before it (or, when they do not fit a slot, they go ahead
  on the pipe) and the count of frames its asker's link sent before it, so that the child serves
  it only after those frames.
* The asker spins for the answer in its slot (``ChildLink.lane_spin``; a short wait when nothing
  else spins, ``LANE_MIN_SPIN_S``) and makes the handle itself. An answer that does not fit a
  slot (an error, a busy device actor, an asker that stopped waiting) comes on the pipe under the
  request's id, as any ask's, and the reader answers it; so does a child's death, which marks the
  lane dead and ends every asker's wait there (:mod:`._reader`).
* The request is registered in the link's ``pending`` table like a piped ask, so exactly one of
  the asker, the reader and the death answers it.

Thread rules: ``ask_in_lane`` runs on the asker's own thread while the proxy is idle (the fast
path, ``CallerServedInbox``); the lane's slots are claimed and released by their asker only.
"""

from __future__ import annotations

from typing import Any

import pykka

from ..._core import call_lane as lanes
from ..._core.call_lane import CallLane
from ...driver.shared_memory import SharedSegment, segment_name
from ...memory.block import AllocTag, StreamId
from .. import messages as m
from ..gpu_ref import GpuRef
from ..hot_waits import FUTURE_SPIN_S, spin_budget
from ._link import ChildLink
from ._protocol import block_of

__all__ = ["LANE_MIN_SPIN_S", "ask_in_lane", "lane_spin", "open_lane"]

#: How long an asker waits for the child to claim its call-lane request when nothing spins
#: (``CALL_LANE`` forced on a small machine) before it leaves the answer to the pipe.
LANE_MIN_SPIN_S = 0.005


def lane_spin() -> float:
    """How long an asker spins for its answer in the lane (``ChildLink.lane_spin``).
    Thread rule: any thread."""
    return spin_budget(FUTURE_SPIN_S) or LANE_MIN_SPIN_S


def open_lane(ordinal: int) -> tuple[SharedSegment, CallLane]:
    """A new call lane for a child of device ``ordinal``: its shared segment (the child maps it
    by name) and the parent's view. Thread rule: the proxy's thread."""
    segment = SharedSegment.create(segment_name("lane", ordinal), lanes.SIZE)
    return segment, CallLane(segment.mm)


def ask_in_lane(link: ChildLink, message: m.Allocate, future: pykka.Future[Any]) -> bool:
    """Serve an asked ``Allocate`` through the call lane from the asker's thread: post it
    (with the frees queued before it), spin for the child's answer and set ``future``; or,
    when the child answers on the pipe instead (an error, a busy device actor, an asker that
    stopped waiting), leave ``future`` to the reader. False when the message does not fit
    the lane or no slot is free: nothing was sent, the pipe path takes it.
    Thread rule: the asker's thread (the proxy idle)."""
    lane = link.lane
    nbytes, stream, tag = message.nbytes, message.stream, message.tag
    if (lane is None or message.origin is not None or type(nbytes) is not int or not 0 < nbytes < 1 << 63
            or type(stream) is not StreamId or type(tag) is not AllocTag):
        return False
    tag_bytes = tag.encode()
    if len(tag_bytes) > lanes.MAX_TAG:
        return False
    slot = lane.claim()
    if slot < 0:
        return False
    with link.lock:
        if not link.alive:
            lane.release(slot, False)
            return False
        rid = next(link.ids)
        link.pending[rid] = (future, message)
    frees = link.take_frees()
    if frees is not None and len(frees[1]) > lanes.MAX_FREES:
        link.send_frees(frees)  # ahead in the pipe: the request is served after it
        frees = None
    channel = link.proc.channel
    generation, ptrs = frees if frees is not None else (0, [])
    try:
        asleep = lane.post(slot, rid, channel.sent, nbytes, int(stream), tag_bytes, generation, ptrs)
    except (ValueError, OverflowError):  # a field out of a slot's range: the pipe takes it
        with link.lock:
            link.pending.pop(rid, None)
        lane.release(slot, False)
        link.send_frees(frees)
        return False
    if asleep:
        try:
            channel.send(("wake",))
        except (OSError, ValueError):
            pass  # the child died: the reader marks the lane dead
    state = lane.wait_reply(slot, link.lane_spin)
    if state != lanes.DONE:
        lane.release(slot, state == lanes.PIPED)
        return True  # the reader answers it: the pipe's reply, or the child's death
    ptr, size, align, alloc_stream, block_generation, state_index, ref_generation = lane.reply(slot)
    link.lane_answers += 1
    with link.lock:
        entry = link.pending.pop(rid, None)
    if entry is not None:  # else the child died meanwhile and its asker heard of it
        block = block_of(ptr, link.ordinal, alloc_stream, size, align, tag, block_generation, state_index)
        future.set(GpuRef._new(block, link.context_for(ref_generation)))  # type: ignore[arg-type]
    return True
