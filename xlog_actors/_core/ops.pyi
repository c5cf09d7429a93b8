from typing import Any

from ..driver.protocol import Driver

__all__ = ["CudaOps", "DriverOps", "ops_for"]

class DriverOps:
    @property
    def driver(self) -> Driver: ...
    @property
    def ordinal(self) -> int: ...
    def __init__(self, driver: Driver, ordinal: int) -> None: ...
    def check_context(self) -> None: ...

class CudaOps(DriverOps):
    def __init__(
        self, driver: Driver, ordinal: int, entry_points: dict[str, int], device: Any, tls: Any,
        stream_type: type, event_type: type, cuda_result: Any,
    ) -> None: ...

def ops_for(driver: Driver, ordinal: int) -> DriverOps: ...
