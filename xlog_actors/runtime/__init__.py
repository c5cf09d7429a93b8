"""Layer 3: the per-ordinal device runtime."""

from __future__ import annotations

from .device_runtime import MAX_DEVICE_ORDINALS, XlogDeviceRuntime

__all__ = ["MAX_DEVICE_ORDINALS", "XlogDeviceRuntime"]
