"""``made_once``: an entry of a process-wide table, made on first use by one thread only.

The tables of things a process opens or makes once and then keeps (a shared-memory segment
mapped by name, a device state's export table, ...) are read on every use and written once per
key; :func:`made_once` is their one lookup.

Invariants: a key's value is made at most once (under the table's lock, after a second look);
a hit takes no lock (one dict read, atomic under the GIL).

Thread rule: any thread; ``make`` runs under the table's lock, so it must not take that lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import TypeVar

__all__ = ["made_once"]

K = TypeVar("K")
V = TypeVar("V")


def made_once(table: MutableMapping[K, V], lock: threading.Lock, key: K, make: Callable[[], V]) -> V:
    """``table[key]``, made by ``make()`` and stored there on first use.

    Args:
        table: the process-wide table (a dict, or a weak-keyed or weak-valued one).
        lock: the table's lock, held while a value is made.
        key: the entry's key.
        make: makes the value; what it raises reaches the caller and stores nothing.
    Returns:
        The entry's value.
    Thread rule: any thread; ``make`` runs under ``lock``.
    """
    value = table.get(key)
    if value is None:
        with lock:
            value = table.get(key)
            if value is None:
                value = make()
                table[key] = value
    return value
