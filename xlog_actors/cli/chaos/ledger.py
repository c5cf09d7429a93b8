"""What a chaos run checks and what it saw: the invariants (rows of the table), one
:class:`Ledger` per column (a device, or the end of the run), and :func:`call`, the one way the
run asks anything, which classifies every answer as it comes.

An answer is one of: a result; a typed error (an ``XlogError``), which the caller handles; or a
broken invariant (no answer within the timeout, ``pykka.ActorDeadError`` while the device was not
being stopped, any other exception), recorded at once and raised as :class:`Lost` so the caller
drops what it was doing. A ``GpuRefStale`` answer to an ``Allocate`` (which names no handle) is a
broken invariant of its own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pykka

from ...errors import GpuRefStale, XlogError

__all__ = ["INVARIANTS", "Invariant", "Ledger", "Lost", "Watch", "ask", "call", "say"]

T = TypeVar("T")

#: How many broken-invariant messages a ledger keeps per row (the rest are counted).
KEPT_MESSAGES = 5
#: How many broken-invariant messages are echoed on stderr as they happen, per ledger.
ECHOED_MESSAGES = 20


def say(line: str) -> None:
    """Write ``"xlog-actors chaos: <line>"`` on stderr as one write, so that lines of several
    threads never run into each other.

    Args:
        line: the text, without a newline.
    Thread rule: any thread.
    """
    with _say_lock:
        sys.stderr.write(f"xlog-actors chaos: {line}\n")
        sys.stderr.flush()


_say_lock = threading.Lock()


@dataclass(frozen=True)
class Invariant:
    """One row of the table: ``key`` names it in code, ``title`` in the table.

    Thread rule: immutable; any thread.
    """

    key: str
    title: str


INVARIANTS = (
    Invariant("answered", "every ask answered in time, typed"),
    Invariant("allocate", "no Allocate answered GpuRefStale"),
    Invariant("hangs", "no thread or process hangs"),
    Invariant("arrived", "every handle sent arrives"),
    Invariant("batches", "every finished batch has the right bytes"),
    Invariant("reads", "every other read has the right bytes"),
    Invariant("stale", "every stale handle refused"),
    Invariant("restarts", "restarts only for serving-process deaths"),
    Invariant("outstanding", "0 outstanding bytes and blocks at the end"),
    Invariant("memory", "device memory back within 64 MiB of idle"),
    Invariant("segments", "no leftover shared-memory segments"),
    Invariant("processes", "no leftover processes"),
    Invariant("threads", "no leftover threads"),
)
_KEYS = frozenset(inv.key for inv in INVARIANTS)


class Lost(Exception):
    """An ask whose answer broke an invariant (already recorded): the caller abandons its step.

    Thread rule: raised and caught in the thread that asked.
    """


class Watch:
    """What one thread is waiting for and until when, so that a monitor sees a hang while it
    lasts (before the thread is joined).

    Thread rule: ``begin``/``end`` from the owning thread; ``overdue`` from any thread.
    """

    def __init__(self, name: str) -> None:
        """Args:
            name: the thread's name, for messages.
        """
        self.name = name
        self._what: tuple[str, float, float] | None = None
        self._reported: float | None = None

    def begin(self, what: str, timeout_s: float) -> None:
        """Start waiting for ``what``, which must end within ``timeout_s``.

        Args:
            what: a label (the message type).
            timeout_s: the wait's own bound.
        Thread rule: the owning thread.
        """
        self._what = (what, time.monotonic(), timeout_s)

    def end(self) -> None:
        """The wait ended (answered or not).

        Thread rule: the owning thread.
        """
        self._what = None

    def overdue(self, now: float, grace_s: float) -> str | None:
        """A message when the current wait runs past its bound plus ``grace_s``, once per wait.

        Args:
            now: ``time.monotonic()``.
            grace_s: the slack allowed past the wait's own timeout.
        Returns:
            The message, or None (no wait, in time, or already reported).
        Thread rule: any thread.
        """
        current = self._what
        if current is None:
            return None
        what, started, timeout_s = current
        if now - started <= timeout_s + grace_s or self._reported == started:
            return None
        self._reported = started
        return f"{self.name}: {what} still waiting after {now - started:.0f} s (its timeout: {timeout_s:.0f} s)"


class Ledger:
    """The invariants and counts of one column of the table.

    ``passed``/``broke`` record checks of an invariant; a row never checked shows ``-``. Counts
    are kept in the order first seen, by name. ``stopping`` is set while the device is being
    stopped on purpose: an ``ActorDeadError`` is then an expected answer.

    Thread rule: any thread (one lock).
    """

    def __init__(self, column: str, echo: bool = True) -> None:
        """Args:
            column: the column's heading (``"in-process"``, ``"isolated"``, ``"end of run"``).
            echo: print each broken invariant on stderr as it is found (the first few).
        """
        self.column = column
        self.echo = echo
        self.stopping = False
        self.ran = False
        self._lock = threading.Lock()
        self._passed: Counter[str] = Counter()
        self._broken: Counter[str] = Counter()
        self._messages: dict[str, list[str]] = {}
        self._counts: dict[str, int] = {}
        self._details: dict[str, dict[str, int]] = {}
        self._echoed = 0

    def passed(self, key: str, n: int = 1) -> None:
        """Record ``n`` checks of invariant ``key`` that held.

        Args:
            key: an invariant's key.
            n: how many.
        Raises:
            KeyError: an unknown key.
        Thread rule: any thread.
        """
        if key not in _KEYS:
            raise KeyError(key)
        with self._lock:
            self._passed[key] += n

    def broke(self, key: str, message: str) -> None:
        """Record a broken invariant with what was seen.

        Args:
            key: an invariant's key.
            message: one line saying what broke it.
        Raises:
            KeyError: an unknown key.
        Thread rule: any thread.
        """
        if key not in _KEYS:
            raise KeyError(key)
        line = " ".join(message.split())
        with self._lock:
            self._broken[key] += 1
            kept = self._messages.setdefault(key, [])
            if len(kept) < KEPT_MESSAGES:
                kept.append(line)
            echo = self.echo and self._echoed < ECHOED_MESSAGES
            self._echoed += echo
        if echo:
            say(f"[{self.column}] BROKEN ({key}): {line}")

    def count(self, name: str, n: int = 1, detail: str | None = None) -> None:
        """Add ``n`` to the count ``name`` (and to its part ``detail`` when given).

        Args:
            name: the count's name (shown as is).
            n: how much.
            detail: a part of it (shown indented under it), or None.
        Thread rule: any thread.
        """
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n
            if detail is not None:
                parts = self._details.setdefault(name, {})
                parts[detail] = parts.get(detail, 0) + n

    def set_count(self, name: str, value: int) -> None:
        """Set the count ``name`` to ``value`` (a reading, such as the last generation).

        Args:
            name: the count's name.
            value: its value.
        Thread rule: any thread.
        """
        with self._lock:
            self._counts[name] = value

    def counts(self) -> dict[str, int]:
        """A copy of the counts, in the order first seen (without their parts).

        Returns:
            name -> value.
        Thread rule: any thread.
        """
        with self._lock:
            return dict(self._counts)

    def details(self, name: str) -> dict[str, int]:
        """A copy of the parts of count ``name``, in the order first seen.

        Args:
            name: the count's name.
        Returns:
            part -> value (empty when it has none).
        Thread rule: any thread.
        """
        with self._lock:
            return dict(self._details.get(name, {}))

    def verdict(self, key: str) -> tuple[int, int, list[str]] | None:
        """How invariant ``key`` fared: None when never checked, else (checks that held,
        checks that broke, the kept messages).

        Args:
            key: an invariant's key.
        Returns:
            The verdict, or None.
        Thread rule: any thread.
        """
        with self._lock:
            held, broken = self._passed[key], self._broken[key]
            if not held and not broken:
                return None
            return held, broken, list(self._messages.get(key, ()))

    @property
    def broken(self) -> int:
        """How many checks broke, all rows together.

        Thread rule: any thread.
        """
        with self._lock:
            return sum(self._broken.values())


def call(ledger: Ledger, watch: Watch, what: str, timeout_s: float, fn: Callable[[], T], *,
         allocates: bool = False) -> T:
    """Run ``fn`` (an ask bounded by ``timeout_s``, or a pickle that asks), classify its answer
    and count it under ``asks``.

    Args:
        ledger: where the answer is recorded.
        watch: the calling thread's watch (a hang shows there while it lasts).
        what: the label (the message type).
        timeout_s: the bound ``fn`` itself applies.
        fn: the call.
        allocates: ``fn`` is an ``Allocate``/``AllocateMany``: a ``GpuRefStale`` answer breaks an
            invariant of its own (it names no handle).
    Returns:
        What ``fn`` returned.
    Raises:
        XlogError: the typed error ``fn`` raised (an acceptable answer; counted).
        Lost: the answer broke an invariant (recorded here).
    Thread rule: the thread ``watch`` belongs to.
    """
    watch.begin(what, timeout_s)
    try:
        value = fn()
    except pykka.Timeout:
        ledger.count("asks unanswered", detail="no answer in time")
        ledger.broke("answered", f"{what}: no answer within {timeout_s:.0f} s")
        raise Lost from None
    except pykka.ActorDeadError as exc:
        if ledger.stopping:
            ledger.count("asks answered", detail="ActorDeadError (device stopped on purpose)")
            raise Lost from None
        ledger.count("asks unanswered", detail="ActorDeadError")
        ledger.broke("answered", f"{what}: ActorDeadError while the device was not being stopped: {exc}")
        raise Lost from None
    except XlogError as exc:
        ledger.count("asks answered", detail=type(exc).__name__)
        ledger.passed("answered")
        if allocates and isinstance(exc, GpuRefStale):
            ledger.broke("allocate", f"{what} answered GpuRefStale({exc.reason!r}): {exc}")
        elif allocates:
            ledger.passed("allocate")
        raise
    except Exception as exc:  # noqa: BLE001 - any other answer breaks the invariant; recorded
        ledger.count("asks unanswered", detail=f"untyped {type(exc).__name__}")
        ledger.broke("answered", f"{what}: untyped {type(exc).__name__}: {exc}")
        raise Lost from None
    finally:
        watch.end()
    ledger.count("asks answered", detail="ok")
    ledger.passed("answered")
    if allocates:
        ledger.passed("allocate")
    return value


def ask(ledger: Ledger, watch: Watch, actor: pykka.ActorRef[Any], message: Any, timeout_s: float) -> Any:
    """``actor.ask(message, timeout=timeout_s)`` through :func:`call`.

    Args:
        ledger, watch, timeout_s: as :func:`call`.
        actor: whom to ask.
        message: what.
    Returns:
        The answer.
    Raises:
        XlogError: a typed error answer.
        Lost: an answer that broke an invariant.
    Thread rule: the thread ``watch`` belongs to.
    """
    name = type(message).__name__
    return call(ledger, watch, name, timeout_s, lambda: actor.ask(message, timeout=timeout_s),
                allocates=name in ("Allocate", "AllocateMany"))
