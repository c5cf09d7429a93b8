"""The lanes of a :class:`~.batch_graph.BatchGraph`: stages given as several lists, each a chain,
with no order between the lists (on the GPU the lanes of one replay may run at the same time).

What keeps lanes safe is that no lane writes memory another lane names: :func:`check_apart`
judges a recording, :class:`LaneIndex` every later binding. Memory is named by identity
(:func:`~.graph_stages.identity`: a handle's block address, a pinned buffer itself).

Thread rule: pure functions; a ``LaneIndex`` belongs to its graph, whose lock serializes its use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidRequest
from .graph_stages import Operand, Slot, identity

__all__ = ["LaneIndex", "check_apart", "flatten"]


def flatten(stages: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """The stages of ``BatchGraph.record`` as one tuple, and each lane's length: one lane for a
    list of stages, one per list for a list of lists.

    Raises:
        InvalidRequest: an empty lane.
    Thread rule: any thread.
    """
    if not all(isinstance(lane, (list, tuple)) for lane in stages):
        return tuple(stages), (len(stages),)
    flat: list[Any] = []
    lanes: list[int] = []
    for n, lane in enumerate(stages):
        if not lane:
            raise InvalidRequest(f"BatchGraph.record: lane {n} has no stages")
        flat.extend(lane)
        lanes.append(len(lane))
    return tuple(flat), tuple(lanes)


def check_apart(slots: list[Slot]) -> None:
    """Refuse a recording where a stage of one lane writes memory a stage of another lane names.

    Raises:
        InvalidRequest: naming both stages and lanes.
    Thread rule: any thread.
    """
    seen: dict[int, list[Slot]] = {}
    for slot in slots:
        seen.setdefault(identity(slot.recorded), []).append(slot)
    for named in seen.values():
        for a in named:
            for b in named:
                if a.lane != b.lane and a.writes:
                    raise InvalidRequest(
                        f"BatchGraph.record: stage {a.stage} (lane {a.lane}) writes {a.recorded!r}, which stage "
                        f"{b.stage} (lane {b.lane}) names: lanes run at the same time, so no lane may write what "
                        f"another names")


class LaneIndex:
    """Who names what in a graph of several lanes, for judging bindings.

    Keys are the recorded operands' ids (the graph's binding keys). ``use`` gives each key's
    (lane, writes) per stage naming it; ``writers`` the keys some stage writes; ``named`` the
    memory each writer is bound to now -> its keys. A conflict needs a writer, so a binding that
    moves only operands that are read looks up ``named`` alone.

    Invariant: ``named`` matches the graph's bindings of the writers; the graph calls
    :meth:`moved` for every writer it rebinds and :meth:`reindex` after putting bindings back.
    """

    __slots__ = ("named", "recorded", "use", "writers")

    def __init__(self, slots: list[Slot], bound: dict[int, Operand]) -> None:
        """Args:
            slots: every operand of every stage, with its lane.
            bound: the graph's bindings now (key -> operand).
        """
        self.use: dict[int, list[tuple[int, bool]]] = {}
        self.recorded: dict[int, Operand] = {}
        self.writers: set[int] = set()
        for s in slots:
            key = id(s.recorded)
            self.use.setdefault(key, []).append((s.lane, s.writes))
            self.recorded[key] = s.recorded
            if s.writes:
                self.writers.add(key)
        self.named: dict[int, set[int]] = {}
        self.reindex(bound)

    def reindex(self, bound: dict[int, Operand]) -> None:
        """Index the memory each writer is bound to, anew from ``bound``.
        Thread rule: the graph's lock."""
        self.named = {}
        for key in self.writers:
            self.named.setdefault(identity(bound[key]), set()).add(key)

    def moved(self, key: int, old: Operand, new: Operand) -> None:
        """Writer ``key`` is rebound from ``old`` to ``new``. Thread rule: the graph's lock."""
        ident = identity(old)
        keys = self.named.get(ident)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.named[ident]
        self.named.setdefault(identity(new), set()).add(key)

    def check(self, changed: list[tuple[int, Operand]], bound: dict[int, Operand]) -> None:
        """Refuse the bindings ``changed`` (key -> new operand) when they would have one lane
        write memory another lane names, or name memory another lane writes.

        Args:
            changed: the bindings about to be applied, all together.
            bound: the graph's bindings now.
        Raises:
            InvalidRequest: naming the binding and both lanes; nothing was changed.
        Thread rule: the graph's lock.
        """
        moved = {key: identity(new) for key, new in changed}
        if self.writers.isdisjoint(moved):
            named = self.named
            for key, ident in moved.items():
                for other in named.get(ident, ()):
                    self._apart(key, other, changed)
            return
        # A written operand moves: index every operand as it would be bound.
        at: dict[int, list[int]] = {}
        for key, operand in bound.items():
            ident = moved[key] if key in moved else identity(operand)
            at.setdefault(ident, []).append(key)
        for key, ident in moved.items():
            for other in at[ident]:
                if other != key:
                    self._apart(key, other, changed)

    def _apart(self, key: int, other: int, changed: list[tuple[int, Operand]]) -> None:
        """Refuse ``key`` (being rebound, per ``changed``) and ``other``, bound to the same
        memory, when they are named in different lanes and one of them is written."""
        use = self.use
        for lane, writes in use[key]:
            for other_lane, other_writes in use[other]:
                if lane != other_lane and (writes or other_writes):
                    new = dict(changed)[key]
                    raise InvalidRequest(
                        f"BatchGraph.replay: bind[{self.recorded[key]!r}] = {new!r} names memory lane "
                        f"{other_lane} {'writes' if other_writes else 'reads'} in lane {lane}, which "
                        f"{'writes' if writes else 'reads'} it: lanes run at the same time")
