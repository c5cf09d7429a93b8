"""Ray, imported lazily: the one place that turns its absence into an error that says what to install.

Invariant: nothing in ``xlog_actors`` imports ray at import time; every use goes through
:func:`require_ray`, so the core and this package's modules import without it.
Thread rule: any thread.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["NAMESPACE", "require_ray"]

#: The Ray namespace of the runtime's named actors (generation keepers), so that two jobs of one
#: cluster find the same keeper for a (node, ordinal).
NAMESPACE = "xlog_actors"


def require_ray() -> ModuleType:
    """The ``ray`` module.

    Returns:
        The imported ``ray`` module.
    Raises:
        ImportError: ray is not installed; the message names the extra to install.
    Thread rule: any thread.
    """
    try:
        # import_module: a ModuleType whether or not ray (and its type information) is installed
        return importlib.import_module("ray")
    except ImportError as exc:
        raise ImportError("xlog_actors.ray needs Ray: pip install 'xlog-actors[ray]'") from exc
