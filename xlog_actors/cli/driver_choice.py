"""Which driver a command runs on, and why: the flag, ``XLOG_ACTORS_DRIVER``, or ``auto``.

``auto`` falls back to the host driver when no GPU is reachable; a user should see that it did and
why, so the choice is made here step by step (``open_driver("cuda")``, then ``"host"``) rather than
inside one ``open_driver("auto")`` call that would hide the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..driver import DRIVER_ENV, Driver, open_driver
from ..driver.open import DRIVER_KINDS, DriverChoiceKind, env_driver_kind
from ..errors import DeviceUnavailable, InvalidRequest
from .options import UsageError

__all__ = ["KINDS", "DriverChoice", "NoGpu", "check_env", "choose_driver"]

#: The ``--driver`` choices: the kinds ``open_driver`` takes.
KINDS = DRIVER_KINDS
Kind = DriverChoiceKind


class NoGpu(Exception):
    """``--driver cuda`` (or ``XLOG_ACTORS_DRIVER=cuda``) where no usable GPU is reachable. Its
    message is the one line printed (it names what is missing); the command exits with status 1.

    Thread rule: raised and caught on the command's main thread.
    """


@dataclass(frozen=True)
class DriverChoice:
    """An opened driver and the reason it was chosen. The caller owns ``driver`` and closes it.

    Thread rule: any thread (immutable).
    """

    driver: Driver
    reason: str

    def describe(self) -> str:
        """``"driver: <kind> (<reason>)"``: the line commands print first.

        Returns:
            The line, without a newline.
        Thread rule: any thread.
        """
        return f"driver: {self.driver.kind} ({self.reason})"


def check_env() -> tuple[Kind, str] | None:
    """The kind ``XLOG_ACTORS_DRIVER`` asks for, with the text that says so, or None when unset.

    Returns:
        ``(kind, "XLOG_ACTORS_DRIVER=<kind>")`` or None.
    Raises:
        UsageError: when the variable names no known driver.
    Thread rule: any thread.
    """
    try:
        kind = env_driver_kind()
    except InvalidRequest as exc:
        raise UsageError(str(exc)) from None
    return None if kind is None else (kind, f"{DRIVER_ENV}={kind}")


def choose_driver(flag: str | None) -> DriverChoice:
    """Open the driver a command asked for and say why it is that one.

    Precedence: ``--driver`` (other than ``auto``), then ``XLOG_ACTORS_DRIVER``, then auto: the
    CUDA driver where a GPU is reachable, else the host driver.

    Args:
        flag: the ``--driver`` value, or None when not given.
    Returns:
        The opened driver and its reason.
    Raises:
        UsageError: a bad ``XLOG_ACTORS_DRIVER``.
        NoGpu: CUDA was asked for explicitly and cannot be opened (the message says what is missing).
    Thread rule: the command's main thread.
    """
    env = check_env()
    kind: Kind
    if flag is not None and flag != "auto":
        kind, source = flag, f"--driver {flag}"  # type: ignore[assignment]  # argparse choices
    elif env is not None:
        kind, source = env
    else:
        kind, source = "auto", "--driver auto" if flag == "auto" else "auto"
    if kind == "host":
        return DriverChoice(open_driver("host"), source)
    try:
        driver = open_driver("cuda")
    except DeviceUnavailable as exc:
        if kind == "cuda":
            raise NoGpu(f"{source}: no usable GPU: {' '.join(str(exc).split())}") from exc
        return DriverChoice(open_driver("host"), f"{source}: no CUDA GPU reachable: {' '.join(str(exc).split())}")
    return DriverChoice(driver, source if kind == "cuda" else f"{source}: a CUDA GPU is reachable")
