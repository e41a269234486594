"""Write the TPU cluster files in this folder from one table of figures.

Run ``python examples/clusters/tpu/generate.py`` after changing a figure
(``--check`` compares instead of writing and exits 1 on a difference).
Every file is parsed by meshplan's cluster parser before it is written, so
each one is valid by construction.

Figures are Google Cloud's TPU documentation, one page per generation, cited
in each file.  Google gives ICI as a chip's bidirectional total over its
ports; a file holds one link per direction: total / 2 / ports (4 ports on
the 2-D tori of v5e and v6e, 6 on the 3-D tori of v4 and v5p).  DCN is per
host: Google's per-host NICs (v5e, v6e) or its per-chip DCN figure times the
chips of a host (v5p).  Latencies are estimates, not published figures.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))    # (a checkout without meshplan installed)

from meshplan.cluster import CLUSTER_FORMAT, parse_cluster  # noqa: E402

GIB = 2**30
T = 1e12
ICI_LATENCY_S = 1e-6     # estimate: one step of a ring over ICI
DCN_LATENCY_S = 2e-5     # estimate: one step of a ring over the data-centre network

ESTIMATES = ("Latencies are estimates, not published figures: ~1 us per ring step over ICI, "
             "~20 us over the data-centre network (DCN). Peak FLOP/s are Google's; no "
             "achieved efficiencies are given (the plan assumes peak rates).")
WRAP_NOTE = ("Wraparound (assumed from Google's topology pages): v4 and v5p slices have "
             "wraparound links along each dimension of 4 or more chips (whole 4x4x4 cubes joined "
             "by optical switches); v5e and v6e have them only in a full 16x16 pod, smaller "
             "slices are 2-D meshes.")

GENERATIONS = {
    # kind, memory, memory bandwidth, peak FLOP/s, ICI per link per direction,
    # chips per host, DCN per host, torus rank, source lines
    "v4": dict(
        kind="TPU v4", memory=32 * GIB, hbm=1200e9, flops={"bfloat16": 275 * T, "int8": 275 * T},
        ici=50e9, chips_per_host=4, dcn=4 * 50e9 / 8, wrap=lambda size, topo: size >= 4,
        sources=(
            "Google Cloud, TPU v4 (https://cloud.google.com/tpu/docs/v4): 275 TFLOP/s per chip "
            "(bf16 or int8), HBM2 32 GiB at 1200 GB/s, 3D mesh / 3D torus, 4 chips per host",
            "ICI 50 GB/s per link per direction (400 Gbit/s each way, 6 links per chip): "
            "glennklockwood.com/garden/processors/TPUv4, citing Jouppi et al., TPU v4 (ISCA "
            "2023); consistent with v5p's 4800 Gbit/s per chip documented as twice v4's",
            "DCN per host: not on the v4 page; assumed equal to v5p's 50 Gbit/s per chip x 4 "
            "chips = 25 GB/s per host (an estimate)")),
    "v5e": dict(
        kind="TPU v5 lite", memory=16 * GIB, hbm=819e9,
        flops={"bfloat16": 197 * T, "int8": 393 * T}, ici=400e9 / 2 / 4, chips_per_host=8,
        dcn=2 * 100e9 / 8, wrap=lambda size, topo: topo == (16, 16),
        sources=(
            "Google Cloud, TPU v5e (https://cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, "
            "393 TOP/s int8, HBM2 16 GB at 819 GB/s, ICI 400 GB/s bidirectional per chip over 4 "
            "ports (= 50 GB/s per link per direction), 8 chips per host, 2 x 100 Gbit/s NICs "
            "per host (= 25 GB/s), 256-chip pod as a 2D torus, DCN 6.4 Tbit/s per pod",)),
    "v5p": dict(
        kind="TPU v5", memory=95 * GIB, hbm=2765e9,
        flops={"bfloat16": 459 * T, "float8_e4m3fn": 459 * T}, ici=1200e9 / 2 / 6,
        chips_per_host=4, dcn=4 * 50e9 / 8, wrap=lambda size, topo: size >= 4,
        sources=(
            "Google Cloud, TPU v5p (https://cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 "
            "(and fp8), HBM 95 GiB at 2765 GB/s, ICI 1200 GB/s bidirectional per chip (6 links "
            "of a 3D torus = 100 GB/s per link per direction), DCN 50 Gbit/s per chip, 4 chips "
            "per host; topologies 2x2x1 ... 16x16x24",)),
    "v6e": dict(
        kind="TPU v6 lite", memory=32 * GIB, hbm=1640e9,
        flops={"bfloat16": 918 * T, "int8": 1836 * T}, ici=800e9 / 2 / 4, chips_per_host=8,
        dcn=4 * 200e9 / 8, wrap=lambda size, topo: topo == (16, 16),
        sources=(
            "Google Cloud, TPU v6e / Trillium (https://cloud.google.com/tpu/docs/v6e): 918 "
            "TFLOP/s bf16, 1836 TOP/s int8, HBM 32 GB at 1640 GB/s, ICI 800 GB/s bidirectional "
            "per chip over 4 ports (= 100 GB/s per link per direction), 8 chips per host, 4 x "
            "200 Gbit/s NICs per host (= 100 GB/s), 256-chip pod as a 2D torus, DCN 25.6 "
            "Tbit/s per pod",)),
}

# (file name, generation, topology, slices).  v4 and v5p are named by
# TensorCores (2 per chip) as Google names them; v5e and v6e by chips.
FILES = (
    ("tpu-v4-16", "v4", (2, 2, 2), 1),
    ("tpu-v4-128", "v4", (4, 4, 4), 1),
    ("tpu-v4-512", "v4", (4, 8, 8), 1),
    ("tpu-v5e-4", "v5e", (2, 2), 1),
    ("tpu-v5e-4-x2", "v5e", (2, 2), 2),
    ("tpu-v5e-8", "v5e", (2, 4), 1),
    ("tpu-v5e-16", "v5e", (4, 4), 1),
    ("tpu-v5e-16-x2", "v5e", (4, 4), 2),
    ("tpu-v5e-256", "v5e", (16, 16), 1),
    ("tpu-v5e-256-x2", "v5e", (16, 16), 2),
    ("tpu-v5e-256-x4", "v5e", (16, 16), 4),
    ("tpu-v5p-8", "v5p", (2, 2, 1), 1),
    ("tpu-v5p-128", "v5p", (4, 4, 4), 1),
    ("tpu-v5p-128-x2", "v5p", (4, 4, 4), 2),
    ("tpu-v5p-1024", "v5p", (8, 8, 8), 1),
    ("tpu-v5p-1024-x4", "v5p", (8, 8, 8), 4),
    ("tpu-v6e-8", "v6e", (2, 4), 1),
    ("tpu-v6e-64", "v6e", (8, 8), 1),
    ("tpu-v6e-256", "v6e", (16, 16), 1),
    ("tpu-v6e-256-x2", "v6e", (16, 16), 2),
    ("tpu-v6e-256-x4", "v6e", (16, 16), 4),
)


def cluster_dict(name: str, gen: str, topology: tuple[int, ...], slices: int) -> dict:
    g = GENERATIONS[gen]
    chips = math.prod(topology)
    hosts = max(1, chips // g["chips_per_host"])
    multi = (f" A multi-slice job: {slices} slices joined by DCN." if slices > 1 else "")
    return {
        "format": CLUSTER_FORMAT, "name": name,
        "description": (f"Cloud TPU {gen}: {slices} slice(s) of {'x'.join(map(str, topology))} "
                        f"= {chips} chips, {hosts} host(s) per slice.{multi} {WRAP_NOTE} "
                        f"{ESTIMATES}"),
        "sources": list(g["sources"]),
        "num_slices": slices,
        "slice": {
            "chip": {"kind": g["kind"], "memory_bytes": g["memory"],
                     "memory_bandwidth_bytes_per_s": g["hbm"], "peak_flops": g["flops"]},
            "topology": list(topology),
            "wraparound": [bool(g["wrap"](s, topology)) for s in topology],
            "hosts": hosts,
            "ici": {"bandwidth_bytes_per_s": g["ici"], "latency_s": ICI_LATENCY_S},
        },
        "dcn": {"bandwidth_bytes_per_s": g["dcn"], "latency_s": DCN_LATENCY_S},
    }


def build_all() -> dict[str, str]:
    out = {}
    for name, gen, topology, slices in FILES:
        spec = parse_cluster(json.loads(json.dumps(cluster_dict(name, gen, topology, slices))),
                             source=name)
        out[f"{name}.json"] = spec.to_json(indent=2) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the files on disk instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for file_name, text in build_all().items():
        path = HERE / file_name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(file_name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("out of date (run examples/clusters/tpu/generate.py): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
