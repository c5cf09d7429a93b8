"""``xlog-actors info``."""

from __future__ import annotations

import platform
from importlib import metadata

from ..driver.open import open_driver
from ..errors import XlogError
from ..memory.report import memory_report
from ..memory.stack import default_description
from ..runtime.device_runtime import XlogDeviceRuntime

__all__ = ["run_info", "versions"]


def versions() -> dict[str, str]:
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
    driver = open_driver(kind)  # type: ignore[arg-type]
    try:
        print(f"driver         {driver.kind}")
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
