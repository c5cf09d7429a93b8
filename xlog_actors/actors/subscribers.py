"""Telling a device's subscribers of a status change, for every kind of device actor (in-process
and isolated): each subscriber is told once; one that has stopped is dropped from the list, which
is how a stopped subscriber unsubscribes itself.

Thread rule: call from the device actor's own thread (it owns the list).
"""

from __future__ import annotations

from typing import Any

import pykka

__all__ = ["tell_subscribers"]


def tell_subscribers(subscribers: list[pykka.ActorRef[Any]], message: object) -> list[pykka.ActorRef[Any]]:
    """Tell every subscriber ``message``.

    Args:
        subscribers: the refs subscribed.
        message: what to tell them (a ``GenerationChanged``).
    Returns:
        The subscribers still alive, in their order.
    Thread rule: the owning actor's thread.
    """
    alive = []
    for subscriber in subscribers:
        try:
            subscriber.tell(message)
            alive.append(subscriber)
        except pykka.ActorDeadError:
            pass  # a stopped subscriber unsubscribes itself this way
    return alive
