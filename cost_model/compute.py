"""Compute time at what the device achieves, not at its datasheet peak.

A kernel's time is its launch cost plus the slower of its arithmetic and
its memory traffic (the roofline), but never under the kernel's floor: a
real kernel has a shortest time however little work it does (ramp-up, a
GEMM's prologue and epilogue), measured apart for matmuls and for the rest
(:func:`kernel_fixed_time`).  Arithmetic runs at the device's achieved matmul
rate; a matmul's output tiles are spread over the device's compute units in
waves, and a last wave that fills only part of the units costs as much as a
full one (wave quantization) -- unless the matmul's reduction is long enough
to be split over more units (split-K).  Memory traffic runs at the achieved streaming
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
        depth = flops / (2.0 * out_elements) if out_elements > 0 else 0.0
        t_flops = flops / (rate * wave_utilisation(device, out_elements, out_side, depth))
    t_mem = nbytes / (device.memory_bandwidth_bytes_per_s * a.memory_efficiency) \
        if nbytes > 0 else 0.0
    return max(t_flops, t_mem)


# rows of one tensor-core matrix instruction (NVIDIA mma m16n8k16)
MMA_ROWS = 16
# The shortest slice of a matmul's reduction a split keeps.  In an H100
# profile of gpt train steps (benchmarks/results/gpu_profile.md) XLA split
# the weight gradients' 4096- and 8192-deep reductions 2, 4 and 8 ways, so
# as to fill the SMs: slices of 512 to 4096.
SPLIT_K_MIN_DEPTH = 512


def wave_utilisation(device: DeviceSpec, out_elements: float, out_side: float = 0.0,
                     depth: float = 0.0) -> float:
    """Fraction of the compute units' time a matmul with ``out_elements``
    output elements keeps busy: its tiles run in waves of ``compute_units``,
    and the last wave may be partly empty -- also the only wave, when there
    are fewer tiles than units: on an H200 512^3 and 1024^3 bfloat16 products
    ran at 16-30 and 169-194 TFLOP/s (benchmarks/results/gpu_check.md).  A
    reduction ``depth`` (elements summed per output) of several
    ``SPLIT_K_MIN_DEPTH`` lets the libraries cut each tile's sum into slices
    run on other units (split-K, stream-K): the split that fills the waves
    best is taken (on an H100 a 1024 x 1024 weight gradient summed over 8192
    rows, 64 tiles, was split in two and ran at the full rate).  A result
    with fewer rows than one tensor-core instruction's (``out_side`` <
    ``MMA_ROWS``: a few rows by a wide weight) is a matrix-vector product,
    run by other kernels and memory-bound anyway: no quantization.  1.0
    without unit figures."""
    a = device.achieved
    if a.compute_units <= 0 or out_elements <= 0:
        return 1.0
    if 0 < out_side < MMA_ROWS:
        return 1.0
    units = a.compute_units
    tiles = math.ceil(out_elements / a.tile_elements)
    best = 0.0
    for split in range(1, max(1, min(int(depth // SPLIT_K_MIN_DEPTH), units)) + 1):
        work = tiles * split
        best = max(best, work / (math.ceil(work / units) * units))
        if best == 1.0:
            break
    return best


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
