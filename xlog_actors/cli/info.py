"""``xlog-actors info``: the chosen driver and why, its devices, the default stack, versions."""

from __future__ import annotations

import platform
from importlib import metadata

from ..errors import XlogError
from ..memory.report import memory_report
from ..memory.stack import default_description
from ..runtime.device_runtime import XlogDeviceRuntime
from .driver_choice import choose_driver

__all__ = ["run_info", "versions"]


def versions() -> dict[str, str]:
    """The versions of Python and of the packages this runtime uses, for reports.

    Returns:
        ``{name: version}``; ``"not installed"`` for a package that is absent.
    Thread rule: any thread.
    """
    out = {"python": platform.python_version()}
    for dist in ("xlog-actors", "pykka", "cuda-python", "cuda-bindings", "cuda-core", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def run_info(kind: str | None) -> int:
    """Print the driver (and why it was chosen), devices, default stack, memory report, versions.

    Args:
        kind: the ``--driver`` value, or None.
    Returns:
        The exit status, 0.
    Raises:
        UsageError: a bad ``XLOG_ACTORS_DRIVER``.
        NoGpu: ``cuda`` asked for where no GPU is usable.
    Thread rule: the command's main thread.
    """
    choice = choose_driver(kind)
    driver = choice.driver
    try:
        print(f"driver         {driver.kind} ({choice.reason})")
        print(f"default stack  {default_description()}")
        count = driver.device_count()
        print(f"devices        {count}")
        for ordinal in range(count):
            free, total = driver.mem_info(ordinal)
            print(f"  [{ordinal}] {driver.device_name(ordinal)}: {_mib(free)} free of {_mib(total)}")
        if count:
            try:
                runtime = XlogDeviceRuntime.build(driver, 0)
                print("memory report  " + memory_report(runtime.resource).format().replace("\n", "\n               "))
                runtime.close()
            except XlogError as exc:
                print(f"  [0] stack    could not be built: {exc}")
        print("versions       " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    finally:
        driver.close()
    return 0
