"""Write the example cluster files in this folder from one table of figures.

Run ``python examples/clusters/generate.py`` after changing a figure; the
files are built as ClusterSpec objects, so each one is valid by construction.
``--check`` only compares the files on disk with what would be written and
exits 1 on a difference.

Figures are the public datasheet numbers cited in each file's ``sources``.
Peak FLOP/s are dense (no structured sparsity).  Memory is the nominal
capacity; the usable amount is smaller (CUDA context, XLA allocator fraction).
Latencies are not datasheet figures but estimates of the cost of one step of a
ring collective (the alpha of the alpha-beta model, charged 2(n-1) times per
all-reduce): ~1 us over NVLink/NVSwitch (an 8-GPU small-message NCCL
all-reduce then costs ~14 us), ~5 us across InfiniBand, ~20 us for TCP over
25 Gbit/s Ethernet.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

try:
    from meshplan.cluster import Achieved, ClusterSpec, DeviceSpec, HostLink, LinkSpec
except ImportError:  # meshplan not installed: load planner/ as the package without its __init__
    _pkg = types.ModuleType("meshplan")
    _pkg.__path__ = [str(ROOT / "planner")]
    sys.modules["meshplan"] = _pkg
    from meshplan.cluster import Achieved, ClusterSpec, DeviceSpec, HostLink, LinkSpec
from meshplan.datasheets import (A100_ACHIEVED, H100_ACHIEVED, HOPPER_MATMUL_TFLOPS,  # noqa: E402
                                 V100_ACHIEVED)

GIB = 2**30
T = 1e12

LATENCY_NOTE = ("Latencies are estimates, not datasheet figures: the cost of one step of a ring "
                "collective, ~1 us over NVLink, ~5 us across InfiniBand, ~20 us over 25 Gbit/s "
                "Ethernet (TCP).")
ACHIEVED_NOTE = ("achieved: what the hardware reaches, not its peak; matmul_efficiency is "
                 "a measured bf16 matmul rate over the dense peak (the sources say which); "
                 "figures marked as estimates in sources are not measurements.")
INT32_SOURCE = (
    "peak_flops.int32 (integer operations, a random generator's): 64 per clock per SM "
    "(NVIDIA CUDA C++ Programming Guide, throughput of native arithmetic instructions: "
    "32-bit integer add, shift and bitwise operations, compute capability 7.0-9.0) x the "
    "SMs x the datasheet boost clock: V100 SXM2 80 x 1.53 GHz, A100 108 x 1.41, H100 SXM5 "
    "132 x 1.98")
# Fixed costs on NVIDIA GPUs (meshplan.datasheets holds the figures).
FIXED_COSTS_SOURCE = (
    "Estimates, not measurements: kernel_launch_s 5 us (a CUDA kernel launch and its gap "
    "on the stream without CUDA graphs), program_dispatch_s 50 us (one jitted XLA program "
    "launched from Python); tile_elements 128 x 128 (a typical cuBLAS/CUTLASS tile for "
    "large 16-bit GEMMs); no kernel floor (matmul_kernel_min_s, memory_kernel_min_s): none "
    "was measured on this GPU, so a kernel costs its launch plus its roofline")
HOPPER_FIXED_COSTS_SOURCE = (
    "achieved.kernel_launch_s 2.3 us: measured by meshplan calibrate (a jitted chain of k "
    "dependent small matmuls) with jax 0.11.2 on an H200, the same GH100 chip "
    "(benchmarks/results/gpu_check.md); program_dispatch_s 50 us: estimate (one jitted XLA "
    "program launched from Python; calibrate measured 106 us for a program waited for); "
    "tile_elements 128 x 128 (a typical cuBLAS/CUTLASS tile for large 16-bit GEMMs)")
HOPPER_FLOORS_SOURCE = (
    "achieved.matmul_kernel_min_s 9.9 us and memory_kernel_min_s 3.1 us: measured, "
    "gpu_check.py, benchmarks/results/gpu_check/h200-run1.json and h200-run2-kernels.json "
    "(jax 0.11.2 on an H200, the same GH100 chip): the medians of the small kernels whose "
    "time stays flat as their work grows (matmuls 256^3-1024^3: 8 timings, 3.9-16.5 us; "
    "streaming x + y of 1-4 MiB: 4 timings, 2.6-6.1 us), as benchmarks/kernel_latency.py "
    "derives them; a compute kernel costs max(floor, launch + roofline)")
# GPU back ends run collectives on streams of their own, so data-parallel
# gradient reductions and pipeline sends can run under compute
# (meshplan.cost_model.overlap states which).
OVERLAP_SOURCE = (
    "achieved.overlap_communication true: GPU back ends run collectives on a stream of their "
    "own, so a data-parallel gradient reduction runs under the backward pass that follows it, "
    "all but the last bucket (Li et al., PyTorch Distributed: Experiences on Accelerating Data "
    "Parallel Training, VLDB 2020, gradient bucketing; Megatron-LM's --overlap-grad-reduce; "
    "XLA's xla_gpu_enable_latency_hiding_scheduler); which communication hides is stated in "
    "meshplan's cost_model/overlap.py")
# Host <-> device links (what offloading optimizer state to host memory pays):
# a PCIe x16 link per GPU, per direction: lanes x transfer rate x 128b/130b
# encoding / 8 bits.  Latency and efficiency are estimates, not measurements.
# (16 x 8e9 x 128/130 / 8 = 15.75e9, rounded as the figures are usually quoted)
PCIE3_X16 = 15.75e9
PCIE4_X16 = 31.5e9
PCIE5_X16 = 63.0e9
HOST_LINK_NOTE = (
    "links.host_device: the GPU's PCIe x16 link to host memory, per direction (lanes x "
    "transfer rate x 128b/130b encoding; PCI-SIG PCI Express Base Specifications 3.0, 4.0 "
    "and 5.0: 8, 16 and 32 GT/s per lane); efficiency 0.8 and latency 10 us (a DMA copy "
    "from pinned host memory and its setup) are estimates, not measurements. GPUs that "
    "share a PCIe switch's uplink share its bandwidth when all copy at once; not modelled")
MEMORY_NOTE = ("memory_bytes is the nominal capacity; the usable amount is smaller "
               "(CUDA context, XLA allocator fraction).")

# -- AWS p3.16xlarge: Alpa's testbed -------------------------------------------
P3_DEVICE = DeviceSpec(
    kind="V100-SXM2-16GB",
    memory_bytes=16 * GIB,
    memory_bandwidth_bytes_per_s=900e9,
    # V100 has no bfloat16 units: XLA computes bf16 matmuls at about the fp32
    # rate, so bfloat16 gets the fp32 figure rather than the fp16 tensor-core one.
    peak_flops={"float16": 125 * T, "bfloat16": 15.7 * T, "float32": 15.7 * T,
                "float64": 7.8 * T, "int32": 7.8 * T},
    achieved=Achieved(**dict(V100_ACHIEVED)),
)
P3_INTRA = LinkSpec(bandwidth_bytes_per_s=150e9, latency_s=1e-6, efficiency=0.8)
P3_INTER = LinkSpec(bandwidth_bytes_per_s=25e9 / 8, latency_s=20e-6, efficiency=0.8)
P3_TEXT = (
    "AWS p3.16xlarge: 8 x NVIDIA V100-SXM2 16 GB per host, the testbed of Alpa "
    "(Zheng et al., OSDI'22). Within a host the GPUs are joined by NVLink 2 in a "
    "hybrid cube-mesh: each GPU has 6 links of 25 GB/s per direction (300 GB/s "
    "aggregate bidirectional, 150 GB/s per direction), but not every pair of GPUs is "
    "directly linked, so 150 GB/s is optimistic for all-to-all patterns. Between "
    "hosts, 25 Gbit/s networking = 3.125e9 bytes/s per host. V100 lacks bfloat16 "
    "hardware, so bfloat16 is given the fp32 rate. " + MEMORY_NOTE + " " + LATENCY_NOTE + " "
    + ACHIEVED_NOTE)
P3_SOURCES = (
    "NVIDIA Tesla V100 GPU datasheet (SXM2): 125 TFLOP/s tensor (fp16), 15.7 TFLOP/s "
    "fp32, 7.8 TFLOP/s fp64, 16 GB HBM2 at 900 GB/s, NVLink 300 GB/s "
    "- https://www.nvidia.com/en-us/data-center/v100/",
    "NVIDIA DGX-1 with Tesla V100 system architecture whitepaper: hybrid cube-mesh "
    "NVLink topology, 6 NVLink 2 links of 25 GB/s per direction per GPU",
    "Amazon EC2 P3 instances: p3.16xlarge has 8 V100 16 GB with NVLink and 25 Gbit/s "
    "network bandwidth - https://aws.amazon.com/ec2/instance-types/p3/",
    "Zheng et al., Alpa: Automating Inter- and Intra-Operator Parallelism for "
    "Distributed Deep Learning, OSDI 2022 (arXiv:2201.12023): p3.16xlarge testbed",
    "achieved.matmul_efficiency 0.664: Markidis et al., NVIDIA Tensor Core Programmability, "
    "Performance & Precision, IPDPSW 2018 (arXiv:1803.04014): cuBLAS mixed-precision GEMM "
    "reached 83 TFLOP/s on a V100, over the 125 TFLOP/s peak",
    "achieved.memory_efficiency 0.833: Jia et al., Dissecting the NVIDIA Volta GPU "
    "Architecture via Microbenchmarking (arXiv:1804.06826): 750 GB/s measured global "
    "memory bandwidth of the 900 GB/s peak; compute_units 80 SMs (V100 whitepaper)",
    "links efficiency 0.8 (NVLink 2 and 25 Gbit/s TCP): estimates, not measurements",
    FIXED_COSTS_SOURCE,
    INT32_SOURCE,
    OVERLAP_SOURCE,
    "links.host_device 15.75 GB/s: the V100-SXM2 of a p3.16xlarge attaches to its host over "
    "PCIe 3.0 x16 (NVIDIA DGX-1 with Tesla V100 system architecture whitepaper, the same "
    "board design). " + HOST_LINK_NOTE,
)
P3_HOST = HostLink(bandwidth_bytes_per_s=PCIE3_X16, latency_s=10e-6, efficiency=0.8)

# -- DGX A100 (80 GB): Megatron-LM's testbed (Selene) ----------------------------
A100_DEVICE = DeviceSpec(
    kind="A100-SXM4-80GB",
    memory_bytes=80 * GIB,
    memory_bandwidth_bytes_per_s=2.039e12,
    # float64 is the FP64 tensor-core rate that DGEMM reaches (9.7 without).
    peak_flops={"bfloat16": 312 * T, "float16": 312 * T, "tfloat32": 156 * T,
                "float32": 19.5 * T, "float64": 19.5 * T, "int8": 624 * T, "int32": 9.7 * T},
    achieved=Achieved(**dict(A100_ACHIEVED)),
)
A100_INTRA = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=1e-6, efficiency=0.7)
A100_INTER = LinkSpec(bandwidth_bytes_per_s=8 * 200e9 / 8, latency_s=5e-6, efficiency=0.96)
A100_TEXT = (
    "NVIDIA DGX A100 (80 GB): 8 x A100-SXM4-80GB per host, the testbed of Megatron-LM "
    "(Narayanan et al., SC'21, on Selene). NVLink 3 through NVSwitch gives every GPU "
    "300 GB/s per direction to any other GPU of its host. Between hosts, 8 x 200 Gbit/s "
    "HDR InfiniBand (one HCA per GPU) = 200e9 bytes/s per host. Peak figures are dense; "
    "float64 is the FP64 tensor-core rate. " + MEMORY_NOTE + " " + LATENCY_NOTE + " "
    + ACHIEVED_NOTE)
A100_SOURCES = (
    "NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM): 312 TFLOP/s bf16/fp16, 156 "
    "TFLOP/s tf32, 19.5 TFLOP/s fp32, 19.5 TFLOP/s fp64 tensor core, 624 TOPS int8 "
    "(dense), HBM2e 2,039 GB/s, NVLink 600 GB/s bidirectional "
    "- https://www.nvidia.com/en-us/data-center/a100/",
    "NVIDIA DGX A100 datasheet and user guide: 8 x A100 80 GB, 6 NVSwitches, 8 x "
    "single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute traffic "
    "- https://www.nvidia.com/en-us/data-center/dgx-a100/",
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM, SC 2021 (arXiv:2104.04473): DGX A100 80 GB nodes with 8 x "
    "200 Gbit/s HDR InfiniBand each, up to 3072 GPUs (384 nodes)",
    "achieved.matmul_efficiency 0.859: Bekman, Machine Learning Engineering, Maximum "
    "Achievable Matmul FLOPS table (github.com/stas00/ml-engineering, "
    "compute/accelerator): A100 SXM 267.9 of 312 TFLOP/s bf16, CUDA 12.1; compute_units "
    "108 SMs (A100 whitepaper); memory_efficiency 0.9: estimate",
    "links.intra_host.efficiency 0.7: nccl-tests all_reduce_perf bus bandwidth of about "
    "200-208 GB/s on 8 x A100-SXM4-80GB over NVLink (github.com/NVIDIA/nccl-tests issues "
    "149 and 178) of 300 GB/s per direction",
    "links.inter_host.efficiency 0.96: nccl-tests all_reduce_perf across 3 hosts of 8 x "
    "A100 with 4 x HDR each reached 96 GB/s bus bandwidth of 100 GB/s "
    "(github.com/NVIDIA/nccl-tests issue 119)",
    FIXED_COSTS_SOURCE,
    INT32_SOURCE,
    OVERLAP_SOURCE,
    "links.host_device 31.5 GB/s: each A100 of a DGX A100 attaches to the host CPUs over "
    "PCIe 4.0 x16 through PCIe switches (NVIDIA DGX A100 system architecture whitepaper). "
    + HOST_LINK_NOTE,
)
A100_HOST = HostLink(bandwidth_bytes_per_s=PCIE4_X16, latency_s=10e-6, efficiency=0.8)

# -- DGX H100 -----------------------------------------------------------------------
H100_DEVICE = DeviceSpec(
    kind="H100-SXM5-80GB",
    memory_bytes=80 * GIB,
    memory_bandwidth_bytes_per_s=3.35e12,
    peak_flops={"bfloat16": 989.4 * T, "float16": 989.4 * T, "tfloat32": 494.7 * T,
                "float32": 66.9 * T, "float64": 66.9 * T, "float8_e4m3fn": 1978.9 * T,
                "float8_e5m2": 1978.9 * T, "int8": 1978.9 * T, "int32": 16.7 * T},
    achieved=Achieved(**dict(H100_ACHIEVED)),
)
H100_INTRA = LinkSpec(bandwidth_bytes_per_s=450e9, latency_s=1e-6, efficiency=0.8)
H100_INTER = LinkSpec(bandwidth_bytes_per_s=8 * 400e9 / 8, latency_s=5e-6, efficiency=0.9)
H100_TEXT = (
    "NVIDIA DGX H100: 8 x H100-SXM5-80GB per host. NVLink 4 through NVSwitch gives "
    "every GPU 450 GB/s per direction (900 GB/s bidirectional). Between hosts, 8 x "
    "400 Gbit/s NDR InfiniBand (one ConnectX-7 per GPU) = 400e9 bytes/s per host. "
    "Peak figures are dense; float64 is the FP64 tensor-core rate. " + MEMORY_NOTE + " "
    + LATENCY_NOTE + " " + ACHIEVED_NOTE)
H100_SOURCES = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB): HBM3 3.35 TB/s, NVLink "
    "900 GB/s bidirectional - https://www.nvidia.com/en-us/data-center/h100/",
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper: dense peaks of 989.4 TFLOP/s "
    "bf16/fp16, 494.7 tf32, 1978.9 fp8 and int8, 66.9 fp32 and fp64 tensor core",
    "NVIDIA DGX H100 datasheet and user guide: 8 x H100 SXM5 80 GB, 4 NVSwitch chips, "
    "8 x ConnectX-7 400 Gb/s NDR InfiniBand for compute traffic "
    "- https://www.nvidia.com/en-us/data-center/dgx-h100/",
    f"achieved.matmul_efficiency {dict(H100_ACHIEVED)['matmul_efficiency']}: the median rate of "
    f"the unbatched bf16 GEMMs of a gpt train step (hidden 2048) run by XLA (jax 0.11.2) on an "
    f"H100, {HOPPER_MATMUL_TFLOPS} of 989.4 TFLOP/s (776-837 across 6 shapes; "
    "benchmarks/gpu_profile.py, benchmarks/results/gpu_profile.md; chains of equal GEMMs "
    "timed apart ran at 711-716, benchmarks/results/gpu_check.md and "
    "gpu_profile/h100_gpu_check_kernels.log); for comparison Bekman, "
    "Machine Learning Engineering, Maximum Achievable Matmul FLOPS table "
    "(github.com/stas00/ml-engineering, compute/accelerator) gives the best shape's 792.1 "
    "on an H100 SXM with PyTorch; compute_units 132 SMs (H100 whitepaper); "
    "memory_efficiency 0.9: estimate for HBM3 (0.915 measured for the H200's HBM3e)",
    "links efficiency 0.8 (NVLink 4) and 0.9 (NDR InfiniBand): estimates, not measurements",
    HOPPER_FIXED_COSTS_SOURCE,
    HOPPER_FLOORS_SOURCE,
    INT32_SOURCE,
    OVERLAP_SOURCE,
    "links.host_device 63 GB/s: each H100 of a DGX H100 attaches to the host CPUs over "
    "PCIe 5.0 x16 (NVIDIA DGX H100 user guide; H100 SXM5 datasheet: PCIe Gen5 128 GB/s "
    "bidirectional); an H200 SXM has the same PCIe Gen5 x16 host interface. "
    + HOST_LINK_NOTE,
)
H100_HOST = HostLink(bandwidth_bytes_per_s=PCIE5_X16, latency_s=10e-6, efficiency=0.8)

FAMILIES = (
    # (name prefix, host counts, device, intra link, inter link, host link, description,
    #  sources)
    ("aws-p3.16xlarge", (1, 2, 4, 8), P3_DEVICE, P3_INTRA, P3_INTER, P3_HOST, P3_TEXT,
     P3_SOURCES),
    ("dgx-a100", (1, 2, 4, 8, 16, 32, 35, 64, 128, 192, 240, 256, 315, 384), A100_DEVICE,
     A100_INTRA, A100_INTER, A100_HOST, A100_TEXT, A100_SOURCES),
    ("dgx-h100", (1, 8, 64), H100_DEVICE, H100_INTRA, H100_INTER, H100_HOST, H100_TEXT,
     H100_SOURCES),
)


def build_all() -> dict[str, ClusterSpec]:
    """File name -> ClusterSpec for every example cluster."""
    out = {}
    for prefix, host_counts, device, intra, inter, host, text, sources in FAMILIES:
        for hosts in host_counts:
            name = f"{prefix}-x{hosts}"
            out[f"{name}.json"] = ClusterSpec(
                name=name, num_hosts=hosts, devices_per_host=8, device=device,
                intra_host=intra, inter_host=inter, host_link=host, description=text,
                sources=sources)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the files on disk instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for file_name, spec in build_all().items():
        path = HERE / file_name
        text = spec.to_json(indent=2) + "\n"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(file_name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("out of date (run examples/clusters/generate.py): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
