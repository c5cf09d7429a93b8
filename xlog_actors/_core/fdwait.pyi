from .doorbell import Doorbell

__all__ = ["wait_readable"]

def wait_readable(fd: int, seconds: float, bell: Doorbell | None = None) -> bool: ...
