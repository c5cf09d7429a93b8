"""The table a chaos run prints: one row per invariant and one column per device (and the end of
the run), then what broke each broken row, then the counts.

A cell reads ``ok (N)``: the invariant was checked N times and held each time; ``FAIL (B of N)``:
it broke B times out of N checks (the messages follow the table); ``-``: not checked there.
"""

from __future__ import annotations

from .ledger import INVARIANTS, Ledger

__all__ = ["broken_rows", "render"]


def _cell(ledger: Ledger, key: str) -> str:
    if not ledger.ran:
        return "not run"
    verdict = ledger.verdict(key)
    if verdict is None:
        return "-"
    held, broken, _ = verdict
    return f"ok ({held})" if not broken else f"FAIL ({broken} of {held + broken})"


def broken_rows(ledgers: list[Ledger]) -> list[str]:
    """The titles of the invariants that broke in any column.

    Args:
        ledgers: the columns.
    Returns:
        The titles, in table order.
    Thread rule: any thread.
    """
    out = []
    for inv in INVARIANTS:
        if any((v := led.verdict(inv.key)) is not None and v[1] for led in ledgers):
            out.append(inv.title)
    return out


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render(ledgers: list[Ledger], log_lines: list[str]) -> str:
    """The table, the messages of broken rows, the counts and the verdict line.

    Args:
        ledgers: the columns, in order.
        log_lines: lines about the runtime's log (printed after the counts).
    Returns:
        The text, lines joined by newlines (no trailing newline).
    Thread rule: any thread.
    """
    head = ["invariant", *(led.column for led in ledgers)]
    rows = [head, ["-" * len(c) for c in head]]
    rows += [[inv.title, *(_cell(led, inv.key) for led in ledgers)] for inv in INVARIANTS]
    lines = _grid(rows)
    failures = []
    for inv in INVARIANTS:
        for led in ledgers:
            verdict = led.verdict(inv.key)
            if verdict is None or not verdict[1]:
                continue
            _, broken, messages = verdict
            failures.append(f"[{led.column}] {inv.title}: broke {broken} time(s)")
            failures += [f"    {m}" for m in messages]
            if broken > len(messages):
                failures.append(f"    ... and {broken - len(messages)} more")
    if failures:
        lines += ["", "what broke:", *(f"  {line}" for line in failures)]
    names: list[str] = []
    for led in ledgers:
        names += [n for n in led.counts() if n not in names]
    if names:
        counts = [["count", *(led.column for led in ledgers)]]
        counts.append(["-" * len(c) for c in counts[0]])
        for name in names:
            counts.append([name, *(str(led.counts().get(name, "-")) for led in ledgers)])
            parts: list[str] = []
            for led in ledgers:
                parts += [p for p in led.details(name) if p not in parts]
            for part in parts:
                counts.append([f"  {part}", *(str(led.details(name).get(part, "-")) for led in ledgers)])
        lines += ["", *_grid(counts)]
    lines += log_lines
    titles = broken_rows(ledgers)
    summary = ("chaos: every invariant held" if not titles
               else f"chaos: {len(titles)} invariant(s) broken: {'; '.join(titles)}")
    lines += ["", summary]
    return "\n".join(lines)
