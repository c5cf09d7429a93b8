"""Command-line values checked before any work starts: one line naming the flag, exit status 2.

argparse's own error prints the whole usage block before the message; a user who typed one bad
value needs only the line that names it, so :class:`OneLineParser` prints just that line. The
``type=`` checkers here turn a bad value into that line at parse time, before a driver is opened.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "EXIT_USAGE", "OneLineParser", "UsageError", "at_least", "device_count", "positive_float", "writable_file",
]

EXIT_USAGE = 2


class UsageError(Exception):
    """A command-line mistake found after parsing (a value that depends on another flag or on
    the chosen driver). Its message is the one line printed; the command exits with status 2.

    Thread rule: raised and caught on the command's main thread.
    """


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2.

    Thread rule: the command's main thread only.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``"<prog>: error: <message>"`` as one line on stderr and exit with status 2.

        Args:
            message: what argparse found wrong (names the flag).
        Raises:
            SystemExit: always, with status 2.
        Thread rule: the command's main thread only.
        """
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=`` that accepts an integer ``>= low``.

    Args:
        low: the smallest accepted value.
    Returns:
        A converter from the flag's text to ``int``.
    Raises:
        argparse.ArgumentTypeError: (from the converter) for text that is not an integer ``>= low``;
            argparse reports it naming the flag.
    Thread rule: any thread.
    """

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    convert.__name__ = f"integer >= {low}"
    return convert


def device_count(text: str) -> int | str:
    """An argparse ``type=`` for ``--devices``: ``"all"`` or an integer ``>= 1`` (whether that many
    are present is checked once the driver is open).

    Args:
        text: the flag's value.
    Returns:
        ``"all"`` or the integer.
    Raises:
        argparse.ArgumentTypeError: for anything else (argparse names the flag).
    Thread rule: any thread.
    """
    if text.strip().lower() == "all":
        return "all"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'all' or an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type=`` that accepts a finite number greater than 0.

    Args:
        text: the flag's value.
    Returns:
        The number.
    Raises:
        argparse.ArgumentTypeError: for anything else (argparse names the flag).
    Thread rule: any thread.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def writable_file(text: str) -> str:
    """An argparse ``type=`` for an output file: its directory must exist and be writable, and
    the path must not be a directory, so a long run never ends unable to write its result.

    Args:
        text: the path given.
    Returns:
        The path, unchanged.
    Raises:
        argparse.ArgumentTypeError: naming what is wrong with the path.
    Thread rule: any thread.
    """
    path = os.path.abspath(text)
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file path")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} does not exist; expected a path in one that does")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {directory!r} is not writable")
    return text
