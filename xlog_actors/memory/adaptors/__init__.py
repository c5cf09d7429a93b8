"""Adaptors: resources that wrap an ``upstream`` resource and add one concern each. Every
adaptor forwards the block-use tracking hooks and ``reap_pending``, so any stack keeps the
guarantees of its base resource.

:data:`xlog_actors.memory.stack.ADAPTORS` names them for the stack grammar::

    stats               StatisticsResource
    log[:PATH]          LoggingResource; PATH "-" is stderr; without PATH, $XLOG_ACTORS_LOG,
                        else stderr
    budget:SIZE         BudgetResource; SIZE as memory.sizes.parse_size reads it ("8GiB",
                        "512MiB", "1000000")
    guard[:SIZE]        GuardResource; SIZE of each canary, a multiple of 256 (default 256)
    cache[:SIZE]        BlockCacheResource, right after ``async``; SIZE: the most bytes kept idle
                        (default: no limit)

for example ``"async+cache+stats+log:/tmp/alloc.csv+budget:8GiB+guard"`` (base first, then each
adaptor around the previous one).
"""

from __future__ import annotations

from .block_cache import MAX_CACHED, BlockCacheResource, size_class
from .budget import BudgetResource
from .guard import CANARY_PATTERN, DEFAULT_GUARD_BYTES, GuardResource, check_guard_bytes
from .log_resource import LOG_ENV, LOG_HEADER, LoggingResource
from .statistics import StatisticsResource
from .upstream import ResourceAdaptor

__all__ = [
    "CANARY_PATTERN",
    "DEFAULT_GUARD_BYTES",
    "LOG_ENV",
    "LOG_HEADER",
    "MAX_CACHED",
    "BlockCacheResource",
    "BudgetResource",
    "GuardResource",
    "LoggingResource",
    "ResourceAdaptor",
    "StatisticsResource",
    "check_guard_bytes",
    "size_class",
]

