"""The cost terms behind a weight's layout on a multi-slice TPU job, written
out for one weight (issue 21): sharded over the slices too (ZeRO-3 over DCN x
ICI) against sharded over one slice's chips only, with data parallelism over
the slices.  Every figure is the cost model's own (meshplan.cost_model), for
the mesh (slices, chips) of a cluster file; nothing is planned.

    python benchmarks/dcn_terms.py [--cluster tpu-v5e-256-x2] [--gathers 2] [--out FILE]

``--gathers``: how often a step gathers the weight (MaxText's 16B with full
recomputation: 2, the forward and the backward's recomputation, whose
gather the input gradient shares; a weight whose input needs no gradient: 1).
The weight is one MLP matrix of MaxText's 16B decoder (4096 x 28672), gathered
and reduced in bfloat16; one micro-batch a step, so every term runs once.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHT = (4096, 28672)
BYTES = 2          # bfloat16: the weight is cast before it is gathered


def terms(cluster_name: str, gathers: int) -> list[str]:
    import meshplan
    from meshplan.cost_model import collectives as C
    from meshplan.cost_model.mesh import mesh_model
    from meshplan.plan import LogicalMesh

    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / "tpu" / f"{cluster_name}.json")
    slices, chips = cluster.num_hosts, cluster.devices_per_host
    mm = mesh_model(cluster, LogicalMesh(("slices", "chips"), (slices, chips)))
    S = WEIGHT[0] * WEIGHT[1] * BYTES
    dcn_bw, dcn_lat = mm.links[0].phases[0][1:]
    ms = 1e3
    ag_both, ag_ici = C.all_gather(mm, (0, 1), S)[0], C.all_gather(mm, (1,), S)[0]
    rs_both, rs_ici = C.reduce_scatter(mm, (0, 1), S)[0], C.reduce_scatter(mm, (1,), S)[0]
    ar_dcn = C.all_reduce(mm, (0,), S / chips)[0]
    zero3 = gathers * ag_both + rs_both
    dp = gathers * ag_ici + rs_ici + ar_dcn
    return [
        f"# One weight's collectives on {cluster_name}: over the slices or off them", "",
        f"Command: `python benchmarks/dcn_terms.py --cluster {cluster_name} --gathers {gathers}`. "
        f"Weight {WEIGHT[0]} x {WEIGHT[1]} in bfloat16 = {S / 1e6:.1f} MB; mesh "
        f"({slices} slices, {chips} chips); DCN: {dcn_bw / 1e9:.4g} GB/s per chip per "
        f"direction (the host's NICs shared by its chips), {dcn_lat * 1e6:.3g} us a step; "
        f"{gathers} gather(s) a step, one micro-batch.", "",
        "| layout | collective | bytes on DCN per chip | ms | how often a step |",
        "|---|---|---|---|---|",
        f"| over slices x chips (ZeRO-3 over DCN) | all-gather over both | {S / slices / chips / 1e6:.3g} MB "
        f"| {ag_both * ms:.3f} (ICI {ag_ici * ms:.3f} + DCN {(ag_both - ag_ici) * ms:.3f}) | {gathers} |",
        f"| | reduce-scatter of the gradient over both | {S / slices / chips / 1e6:.3g} MB | "
        f"{rs_both * ms:.3f} | 1 |",
        f"| | **total** | {(gathers + 1) * S / slices / chips / 1e6:.3g} MB | **{zero3 * ms:.3f}** | |",
        f"| over chips, data parallel over slices | all-gather over chips | 0 | {ag_ici * ms:.3f} | {gathers} |",
        f"| | reduce-scatter of the gradient over chips | 0 | {rs_ici * ms:.3f} | 1 |",
        f"| | all-reduce of its 1/{chips} shard over slices | {2 * (slices - 1) / slices * S / chips / 1e6:.3g} MB "
        f"| {ar_dcn * ms:.3f} | 1 |",
        f"| | **total** | {2 * (slices - 1) / slices * S / chips / 1e6:.3g} MB | **{dp * ms:.3f}** | |",
        "",
        f"Difference: {(zero3 - dp) * ms:+.3f} ms a step for this weight "
        f"({'data parallel over slices is cheaper' if dp < zero3 else 'ZeRO-3 over slices is not dearer'}). "
        "The all-gather's and reduce-scatter's ICI phases are the same in both layouts; "
        "what differs is DCN: ZeRO-3 moves 1/(slices x chips) of the weight over DCN in "
        "every gather and in the reduce-scatter, data parallelism moves twice "
        "(slices-1)/slices of its 1/chips gradient shard once. The second layout's gradient "
        "is a reduce-scatter over ICI then an all-reduce over DCN into the weight's own "
        "layout (meshplan.ilp.strategies._scatter_variants); before that pair was a "
        "strategy, its gradient was reduce-scattered over both axes, slice-major, and "
        "moved back into the weight's layout across slices. A weight gathered once a "
        "step ties (ZeRO-3 then also holds half the memory).", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="tpu-v5e-256-x2")
    parser.add_argument("--gathers", type=int, default=2)
    parser.add_argument("--out", help="write the table (markdown) here")
    args = parser.parse_args(argv)
    text = "\n".join(terms(args.cluster, args.gathers))
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
