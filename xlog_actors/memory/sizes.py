"""Byte sizes as text: ``parse_size`` reads what a stack description says (``"8GiB"``),
``format_size`` writes it back exactly, ``human_bytes`` rounds for messages and reports."""

from __future__ import annotations

import re

from ..errors import InvalidRequest

__all__ = ["format_size", "human_bytes", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"1.5G"``, ``"1000000"`` -> bytes.

    Binary units (``KiB MiB GiB TiB``, and ``K M G T`` as their shorthands) and decimal ones
    (``KB MB GB TB``), case-insensitive. Exact: ``"0.5GiB"`` is 536870912 bytes.

    Args:
        text: a number with an optional unit.
    Returns:
        The size in bytes, a positive ``int``.
    Raises:
        InvalidRequest: ``text`` is not a string of that form, or does not come to a positive
            whole number of bytes.
    Thread rule: any thread.
    """
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise InvalidRequest(
            f"size {text!r}: expected a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    number = match.group(1)
    # Exact arithmetic: "0.5GiB" is 536870912 bytes, not a float's approximation of it.
    whole, _, frac = number.partition(".")
    scale: int = 10 ** len(frac)
    numerator = (int(whole) * scale + int(frac or 0)) * unit
    if numerator % scale or numerator == 0:
        raise InvalidRequest(f"size {text!r} is not a positive whole number of bytes")
    return numerator // scale


def format_size(nbytes: int) -> str:
    """The shortest exact rendering ``parse_size`` reads back: ``8589934592`` -> ``"8GiB"``.

    Args:
        nbytes: a positive byte count.
    Returns:
        ``nbytes`` in the largest binary unit that divides it, else as a plain number.
    Thread rule: any thread.
    """
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, one decimal, for messages and reports.

    Args:
        nbytes: a byte count (negative ones too, as a drifted counter may show).
    Returns:
        ``"N B"`` below 1 KiB, else the largest unit up to TiB with one decimal.
    Thread rule: any thread.
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    return f"{value:.1f} TiB"
