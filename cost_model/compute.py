"""Compute time at what the device achieves, not at its datasheet peak.

A kernel's time is its launch cost plus the slower of its arithmetic and
its memory traffic (the roofline), but never under the kernel's floor: a
real kernel has a shortest time however little work it does (ramp-up, a
GEMM's prologue and epilogue), measured apart for matmuls and for the rest
(:func:`kernel_fixed_time`).  Arithmetic runs at the device's achieved matmul
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
                 out_elements: float = 0.0, out_side: float = 0.0) -> float:
    """Seconds of arithmetic and memory traffic for ``flops`` FLOPs touching
    ``nbytes`` bytes on one device, launch cost not included.  ``out_elements``
    (the result's elements on this device) turns on wave quantization for a
    matmul; ``out_side``: the result's shorter matrix side (0: unknown)."""
    a = device.achieved
    t_flops = 0.0
    if flops > 0:
        rate = device.flops_for(dtype) * a.matmul_efficiency
        t_flops = flops / (rate * wave_utilisation(device, out_elements, out_side))
    t_mem = nbytes / (device.memory_bandwidth_bytes_per_s * a.memory_efficiency) \
        if nbytes > 0 else 0.0
    return max(t_flops, t_mem)


# rows of one tensor-core matrix instruction (NVIDIA mma m16n8k16)
MMA_ROWS = 16


def wave_utilisation(device: DeviceSpec, out_elements: float, out_side: float = 0.0) -> float:
    """Fraction of the compute units' time a matmul with ``out_elements``
    output elements keeps busy: its tiles run in waves of ``compute_units``,
    and the last wave may be partly empty -- also the only wave, when there
    are fewer tiles than units: on an H200 512^3 and 1024^3 bfloat16 products
    ran at 16-30 and 169-194 TFLOP/s (benchmarks/results/gpu_check.md).  A result with fewer rows than one
    tensor-core instruction's (``out_side`` < ``MMA_ROWS``: a few rows by a
    wide weight) is a matrix-vector product, run by other kernels (split-K)
    and memory-bound anyway: no quantization.  1.0 without unit figures."""
    a = device.achieved
    if a.compute_units <= 0 or out_elements <= 0:
        return 1.0
    if 0 < out_side < MMA_ROWS:
        return 1.0
    tiles = math.ceil(out_elements / a.tile_elements)
    waves = math.ceil(tiles / a.compute_units)
    return tiles / (waves * a.compute_units)


def launch_time(device: DeviceSpec, kernels: float) -> float:
    """Fixed cost of launching ``kernels`` kernels (no floor: collectives)."""
    return kernels * device.achieved.kernel_launch_s


def kernel_fixed_time(device: DeviceSpec, roofline_s: float, matmul: bool) -> float:
    """What one compute kernel costs beyond its roofline ``roofline_s``: the
    launch, or more when the kernel's floor is longer than launch + roofline;
    the kernel then takes max(floor, launch + roofline).  Not floor +
    roofline: on the H200 kernel table that prices mid-sized GEMMs 1.1-1.9x
    their measured time, where the maximum stays within noise
    (benchmarks/kernel_latency.py).  ``matmul``: a matmul or convolution."""
    a = device.achieved
    floor = a.matmul_kernel_min_s if matmul else a.memory_kernel_min_s
    return max(a.kernel_launch_s, floor - roofline_s)
