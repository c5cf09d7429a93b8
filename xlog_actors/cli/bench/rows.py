"""Every bench row, in run order: the groups of rows and their names.

A row is declared once, as data, in the module of its group (see :class:`~.harness.Row`); this
table is the order they run in. The peers' allocators run last (their module says why), then the
training loop, whose halves run in processes of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

from .harness import Group
from .rows_actors import ACTOR
from .rows_allocators import ASYNC, CACHE, DIRECT, SCALING, TRACKING
from .rows_concurrency import CACHED_THREADS, CONCURRENCY
from .rows_copies import COPIES
from .rows_isolated import ISOLATED
from .rows_multi import MULTI
from .rows_peers import PEERS
from .rows_pipeline import PIPELINE
from .rows_shared import SHARED
from .rows_training import TRAINING

__all__ = ["GROUPS", "row_names"]

GROUPS: tuple[Group, ...] = (
    ASYNC, CACHE, DIRECT, ACTOR, ISOLATED, SHARED, CONCURRENCY, CACHED_THREADS, TRACKING, COPIES, PIPELINE, MULTI,
    SCALING, PEERS, TRAINING,
)


def row_names() -> Iterator[str]:
    """Every row's name, in run order.

    Returns:
        An iterator of names.
    Thread rule: any thread.
    """
    for group in GROUPS:
        yield from group.names
