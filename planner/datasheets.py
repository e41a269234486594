"""Datasheet figures of device kinds, for ``ClusterSpec.local()`` and
``meshplan calibrate`` (apart from the cluster-file parser).

Peak FLOP/s are dense (no structured sparsity) datasheet figures.  float32 is
the non-tensor-core FMA rate; float64 on A100/H100 is the FP64 tensor-core
rate that DGEMM reaches.  int32 (integer operations, a random generator's)
is 64 per clock per SM (NVIDIA CUDA C++ Programming Guide, throughput of
native arithmetic instructions: 32-bit integer add, shift and bitwise
operations, compute capability 7.0-9.0) at the datasheet boost clock.
Intra-host links: NVLink per GPU per direction for
SXM parts, a PCIe x16 slot per direction otherwise.  Latencies are estimates.
Links are ``(bandwidth bytes/s, latency s)``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

Link = tuple[float, float]


@dataclass(frozen=True)
class Datasheet:
    match: tuple[str, ...]          # all of these occur in the lower-cased kind
    flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    intra_host: Link
    inter_host: Link
    source: str
    note: str = "Peak FLOP/s are datasheet figures for this device kind."
    # ``Achieved`` fields (meshplan.cluster): empty is the ideal device
    achieved: tuple[tuple[str, Any], ...] = ()
    # the device's PCIe link to host memory (what offloading pays); None: unknown
    host_link: Link | None = None


_GIB = 2**30
_NVLINK2, _NVLINK3, _NVLINK4 = ((b, 5e-6) for b in (150e9, 300e9, 450e9))
_PCIE3, _PCIE4, _PCIE5 = ((b, 1e-5) for b in (16e9, 32e9, 64e9))
# A GPU's link to host memory: PCIe 3.0/4.0/5.0 x16 per direction (as the
# example cluster files, examples/clusters/generate.py), ~10 us (estimate).
_HOST3, _HOST4, _HOST5 = ((b, 1e-5) for b in (15.75e9, 31.5e9, 63.0e9))
HOST_LINK_EFFICIENCY = 0.8          # estimate, as in the example cluster files
# Between GPU hosts: a typical 100 Gbit/s NIC (12.5e9 bytes/s), ~10 us.
_GPU_NET = (12.5e9, 1e-5)
# TPU: ICI within a slice (order of v4/v5e ICI per chip), data-centre network between hosts.
_TPU_ICI, _TPU_DCN = (100e9, 5e-6), (12.5e9, 2e-5)


def _f(**tflops: float) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((k, v * 1e12) for k, v in tflops.items()))


# What NVIDIA GPUs achieve, for the example cluster files and for
# ClusterSpec.local() on a GPU; each figure's source is cited in the files
# (examples/clusters/generate.py).  Fixed costs: a kernel's launch with its
# gap on the stream, and one jitted XLA program launched from Python.
GPU_KERNEL_LAUNCH_S = 5e-6          # estimate (V100/A100 generation)
GPU_PROGRAM_DISPATCH_S = 50e-6      # estimate
# Hopper, measured with XLA (jax 0.11.2).  The matmul rate is what the GEMMs
# of a train step achieve: the median bf16 TFLOP/s of the unbatched GEMMs of
# the gpt-h2048-l8-b8 step profiled on an H100 (benchmarks/gpu_profile.py,
# benchmarks/results/gpu_profile.md; 6 shapes, 776-837).  Chains of 16 equal
# GEMMs timed apart ran slower, 716 on an H200 and 711 on the H100
# (benchmarks/results/gpu_check.md, gpu_profile/h100_gpu_check_kernels.log);
# the 350M step's GEMMs ran at 740-820,
# as in the h2048 step.  The streaming bandwidth is the mean of 1 GiB arrays
# on an H200, and the kernel launch meshplan calibrate's there.
HOPPER_MATMUL_TFLOPS = 811.4        # of 989.4 peak (H100 and H200 share the GH100 die)
H200_STREAM_BYTES_PER_S = 4.39e12   # of 4.8e12 peak
HOPPER_KERNEL_LAUNCH_S = 2.3e-6
# A kernel's floor (its shortest time, launch included), the medians of the
# small kernels whose time stays flat as their work grows, from the same two
# runs (benchmarks/kernel_latency.py prints them): matmuls 9.9 us (8 timings
# of 256^3-1024^3 products, 3.9-16.5 us), streaming kernels 3.1 us (4 timings
# of 1-4 MiB x + y, 2.6-6.1 us).  Unmeasured GPUs (V100, A100) keep the
# launch alone: no floor was measured there.
HOPPER_MATMUL_KERNEL_MIN_S = 9.9e-6
HOPPER_MEMORY_KERNEL_MIN_S = 3.1e-6


def _achieved(**fields: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(fields.items()))


V100_ACHIEVED = _achieved(matmul_efficiency=round(83 / 125, 3),
                         memory_efficiency=round(750 / 900, 3),
                         kernel_launch_s=GPU_KERNEL_LAUNCH_S,
                         program_dispatch_s=GPU_PROGRAM_DISPATCH_S,
                         overlap_communication=True, compute_units=80)
A100_ACHIEVED = _achieved(matmul_efficiency=round(267.9 / 312, 3), memory_efficiency=0.9,
                         kernel_launch_s=GPU_KERNEL_LAUNCH_S,
                         program_dispatch_s=GPU_PROGRAM_DISPATCH_S,
                         overlap_communication=True, compute_units=108)
H100_ACHIEVED = _achieved(matmul_efficiency=round(HOPPER_MATMUL_TFLOPS / 989.4, 3),
                         memory_efficiency=0.9, kernel_launch_s=HOPPER_KERNEL_LAUNCH_S,
                         matmul_kernel_min_s=HOPPER_MATMUL_KERNEL_MIN_S,
                         memory_kernel_min_s=HOPPER_MEMORY_KERNEL_MIN_S,
                         program_dispatch_s=GPU_PROGRAM_DISPATCH_S,
                         overlap_communication=True, compute_units=132)
H200_ACHIEVED = _achieved(**{**dict(H100_ACHIEVED),
                             "memory_efficiency": round(H200_STREAM_BYTES_PER_S / 4.8e12, 3)})

# int32: 108 SMs x 64 x 1.41 GHz (A100); 132 x 64 x 1.98 (H100 SXM); 114 x 64 x
# 1.755 (H100 PCIe); 80 x 64 x 1.53 / 1.38 (V100 SXM2 / PCIe); 40 x 64 x 1.59 (T4)
_A100 = _f(bfloat16=312, float16=312, tfloat32=156, float32=19.5, float64=19.5, int8=624,
           int32=9.7)
_H100_SXM = _f(bfloat16=989.4, float16=989.4, tfloat32=494.7, float32=66.9, float64=66.9,
               float8_e4m3fn=1978.9, float8_e5m2=1978.9, int8=1978.9, int32=16.7)
_H100_PCIE = _f(bfloat16=756, float16=756, tfloat32=378, float32=51.2, float64=51.2,
                float8_e4m3fn=1513, float8_e5m2=1513, int8=1513, int32=12.8)
_KNOWN_GPUS = (
    Datasheet(("v100", "sxm2"), _f(float16=125, float32=15.7, float64=7.8, int32=7.8),
           16 * _GIB, 900e9,
           _NVLINK2, _GPU_NET, "NVIDIA Tesla V100 datasheet (V100 SXM2)",
           achieved=V100_ACHIEVED, host_link=_HOST3),
    Datasheet(("v100",), _f(float16=112, float32=14, float64=7, int32=7.1), 16 * _GIB, 900e9,
           _PCIE3, _GPU_NET, "NVIDIA Tesla V100 datasheet (V100 PCIe)", host_link=_HOST3),
    Datasheet(("t4",), _f(float16=65, float32=8.1, int8=130, int32=4.1), 16 * _GIB, 320e9,
           _PCIE3, _GPU_NET, "NVIDIA T4 datasheet", host_link=_HOST3),
    Datasheet(("a100", "pcie"), _A100, 80 * _GIB, 1935e9, _PCIE4, _GPU_NET,
           "NVIDIA A100 Tensor Core GPU datasheet (A100 PCIe)", host_link=_HOST4),
    Datasheet(("a100", "40gb"), _A100, 40 * _GIB, 1555e9, _NVLINK3, _GPU_NET,
           "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM)", achieved=A100_ACHIEVED,
           host_link=_HOST4),
    Datasheet(("a100",), _A100, 80 * _GIB, 2039e9, _NVLINK3, _GPU_NET,
           "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)", achieved=A100_ACHIEVED,
           host_link=_HOST4),
    Datasheet(("h100", "pcie"), _H100_PCIE, 80 * _GIB, 2.0e12, _PCIE5, _GPU_NET,
           "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)", host_link=_HOST5),
    Datasheet(("h100",), _H100_SXM, 80 * _GIB, 3.35e12, _NVLINK4, _GPU_NET,
           "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)", achieved=H100_ACHIEVED,
           host_link=_HOST5),
    Datasheet(("h200",), _H100_SXM, 141 * 10**9, 4.8e12, _NVLINK4, _GPU_NET,
           "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM; same compute as H100 SXM)",
           achieved=H200_ACHIEVED, host_link=_HOST5),
    Datasheet(("l4",), _f(bfloat16=121, float16=121, tfloat32=60, float32=30.3,
                       float8_e4m3fn=242.5, float8_e5m2=242.5, int8=242.5),
           24 * _GIB, 300e9, _PCIE4, _GPU_NET, "NVIDIA L4 Tensor Core GPU datasheet", host_link=_HOST4),
)
# TPUs: float32 matmuls at JAX's default precision run on the bf16 MXU, so only
# bf16/int8 are given and flops_for("float32") falls back to the bf16 figure.
_KNOWN_TPUS = (
    Datasheet(("v4",), _f(bfloat16=275, int8=275), 32 * _GIB, 1200e9, _TPU_ICI, _TPU_DCN,
           "Google Cloud TPU v4 documentation"),
    Datasheet(("v5", "lite"), _f(bfloat16=197, int8=394), 16 * _GIB, 819e9, _TPU_ICI, _TPU_DCN,
           "Google Cloud TPU v5e documentation"),
    Datasheet(("v6", "lite"), _f(bfloat16=918, int8=1836), 32 * _GIB, 1640e9, _TPU_ICI, _TPU_DCN,
           "Google Cloud TPU v6e (Trillium) documentation"),
    Datasheet(("v5",), _f(bfloat16=459, int8=918), 95 * _GIB, 2765e9, _TPU_ICI, _TPU_DCN,
           "Google Cloud TPU v5p documentation"),
)
# CPU (also the fake devices of --xla_force_host_platform_device_count): a
# modest 5e10 FLOP/s float32 per device -- a few vector cores' worth; virtual
# devices share one host's cores, so this is nominal.  XLA:CPU computes 16-bit
# floats through float32, so flops_for gives them the float32 figure.  Devices
# exchange data through host memory (~10 GB/s, ~10 us); processes on different
# hosts talk over TCP (gloo), taken as 10 Gbit/s Ethernet at ~50 us.  Each
# program and kernel costs a fixed launch: what `meshplan calibrate` measured on
# a 2-core x86-64 host with 8 fake devices, jax 0.10.2 (2026-11-28,
# benchmarks/results/measured_grid_cluster.json: 20.8 us per program, 4.4 us
# per kernel); without them a pipeline of tiny stages looked free.
CPU_PROGRAM_DISPATCH_S = 20.8e-6
CPU_KERNEL_LAUNCH_S = 4.4e-6
# The host's time per stage program of a pipeline (the driver's own work and
# jit's dispatch, Achieved.pipeline_program_s) and per array buffer a program
# takes or makes (pipeline_buffer_s): `meshplan calibrate --quick` on the same
# kind of host, 8 fake devices, jax 0.10.2, five runs on 2026-12-04 (stop 69):
# a call of k arrays in and out, 0.76-1.08 us a buffer (median 0.84); a 2-stage
# MLP over 4 micro-batches, 18 programs and 1168 buffers in 8.0-10.0 ms, less
# the buffers 387-488 us a program (median 478).  (Stop 68's two runs, on a
# day the machine dispatched faster, took 399 and 428 us a program, buffers
# included.)
CPU_PIPELINE_PROGRAM_S = 478e-6
CPU_PIPELINE_BUFFER_S = 0.84e-6
# A program on several of the fake devices while the others are busy
# (Achieved.busy_program_s): calibrate's measurement on the same kind of host,
# two runs on 2026-12-04 (stop 72): 1.28 and 1.30 ms a program + 17.3 and 15.5
# us a device (a trivial program on 2 and 4 of 8 devices took 1.41-1.48 ms
# beside 4 busy ones, 78-112 us on an idle host): their means
CPU_BUSY_PROGRAM_S = 1.29e-3
CPU_BUSY_PROGRAM_PER_DEVICE_S = 16.4e-6
_CPU = Datasheet((), _f(float32=0.05, float64=0.025), 16 * _GIB, 20e9,
              (10e9, 1e-5), (1.25e9, 5e-5),
              "meshplan default for CPU devices (nominal, not measured; launch costs as "
              "`meshplan calibrate` measured them on one 2-core x86-64 host)",
              note="Peak FLOP/s is meshplan's nominal CPU default.",
              achieved=_achieved(kernel_launch_s=CPU_KERNEL_LAUNCH_S,
                                 program_dispatch_s=CPU_PROGRAM_DISPATCH_S,
                                 pipeline_program_s=CPU_PIPELINE_PROGRAM_S,
                                 pipeline_buffer_s=CPU_PIPELINE_BUFFER_S,
                                 busy_program_s=CPU_BUSY_PROGRAM_S,
                                 busy_program_per_device_s=CPU_BUSY_PROGRAM_PER_DEVICE_S))


def known_device(platform: str, kind: str) -> Datasheet | None:
    if platform == "cpu":
        return _CPU
    table = _KNOWN_TPUS if platform == "tpu" else _KNOWN_GPUS
    text = kind.lower()
    for entry in table:
        if all(re.search(rf"(?<![a-z0-9]){re.escape(m)}(?![0-9])", text) for m in entry.match):
            return entry
    return None


def generic_device(platform: str) -> Datasheet:
    links = (_TPU_ICI, _TPU_DCN) if platform == "tpu" else (_PCIE4, _GPU_NET)
    return Datasheet((), _f(bfloat16=50, float16=50, float32=10), 16 * _GIB, 500e9, *links,
                  source="meshplan rough default for an unknown accelerator (a guess)",
                  note="Unknown device kind: peak FLOP/s and memory bandwidth are guesses.")


def allocator_limit(device: Any) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend implements memory_stats
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if isinstance(limit, (int, float)) and limit > 0 else None


def memory_from_kind(kind: str) -> int | None:
    m = re.search(r"(\d+)\s*gb", kind.lower())
    return int(m.group(1)) * _GIB if m else None


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GIB
