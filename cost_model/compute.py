"""Compute time at what the device achieves, not at its datasheet peak.

A kernel's time is its fixed launch cost plus the slower of its arithmetic
and its memory traffic.  Arithmetic runs at the device's achieved matmul
rate; a matmul's output tiles are spread over the device's compute units in
waves, and a last wave that fills only part of the units costs as much as a
full one (wave quantization).  Memory traffic runs at the achieved streaming
bandwidth.  With the ideal device (``Achieved()``) this is the plain roofline
at peak.
"""
from __future__ import annotations

import math

from ..cluster import DeviceSpec


def compute_time(device: DeviceSpec, flops: float, nbytes: float, dtype: str = "float32",
                 out_elements: float = 0.0) -> float:
    """Seconds of arithmetic and memory traffic for ``flops`` FLOPs touching
    ``nbytes`` bytes on one device, launch cost not included.  ``out_elements``
    (the result's elements on this device) turns on wave quantization for a
    matmul."""
    a = device.achieved
    t_flops = 0.0
    if flops > 0:
        rate = device.flops_for(dtype) * a.matmul_efficiency
        t_flops = flops / (rate * wave_utilisation(device, out_elements))
    t_mem = nbytes / (device.memory_bandwidth_bytes_per_s * a.memory_efficiency) \
        if nbytes > 0 else 0.0
    return max(t_flops, t_mem)


def wave_utilisation(device: DeviceSpec, out_elements: float) -> float:
    """Fraction of the compute units' time a matmul with ``out_elements``
    output elements keeps busy: its tiles run in waves of ``compute_units``,
    and the last wave may be partly empty.  Fewer tiles than units make no
    idle wave: GEMM libraries then split the contraction (split-K) or take
    smaller tiles until every unit has work (a matrix-vector-like product,
    a few rows by a wide weight, is memory-bound, not one tile's work).
    Small GEMMs are slower than this on an H200 (512^3 and 1024^3 bfloat16:
    8.8-16.5 and 11-12.7 us against 5.4 and 8.5 predicted,
    benchmarks/results/gpu_check.md): a fixed latency per GEMM that is not
    modelled.  1.0 without unit figures."""
    a = device.achieved
    if a.compute_units <= 0 or out_elements <= 0:
        return 1.0
    tiles = math.ceil(out_elements / a.tile_elements)
    if tiles <= a.compute_units:
        return 1.0
    waves = math.ceil(tiles / a.compute_units)
    return tiles / (waves * a.compute_units)


def launch_time(device: DeviceSpec, kernels: float) -> float:
    """Fixed cost of launching ``kernels`` kernels."""
    return kernels * device.achieved.kernel_launch_s
