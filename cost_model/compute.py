"""Roofline compute time: the slower of arithmetic and memory traffic."""
from __future__ import annotations

from ..cluster import DeviceSpec


def compute_time(device: DeviceSpec, flops: float, nbytes: float, dtype: str = "float32") -> float:
    """Seconds for ``flops`` FLOPs touching ``nbytes`` bytes on one device."""
    t_flops = flops / device.flops_for(dtype) if flops > 0 else 0.0
    t_mem = nbytes / device.memory_bandwidth_bytes_per_s if nbytes > 0 else 0.0
    return max(t_flops, t_mem)
