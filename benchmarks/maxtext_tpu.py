"""MaxText's published MFU on TPU v5p and v5e against meshplan's prediction
for the same model size, chips and parallel layout (plan-only, deterministic).

    python benchmarks/maxtext_tpu.py [--out benchmarks/results/maxtext_tpu.md]

Sources (MaxText, github.com/AI-Hypercomputer/maxtext):
- README.md, "Runtime Performance Results": the v5p table (TFLOP/chip/sec, MFU
  per parameter count and slice) and the v5e table (1x .. 32x v5e-256).
- MaxText/configs/v5p/{32b,64b}.sh: global_parameter_scale, per_device_batch_size
  7 and 3, ici_fsdp_parallelism=-1, ici_tensor_parallelism=4,
  max_target_length=2048, remat_policy=minimal.
- MaxText/configs/v5e/{16b,32b}.sh: per_device_batch_size 6 and 4,
  remat_policy=full, max_target_length=2048; base.yml's defaults
  (ici_fsdp_parallelism=-1, dcn_data_parallelism=-1: FSDP over a slice's chips,
  data parallel over slices).
- base.yml: base_emb_dim 2048, base_num_query_heads 16, base_mlp_dim 7168,
  base_num_decoder_layers 16, head_dim 128, vocab 32000, gated (silu, linear)
  MLP; get_individual_scales() turns global_parameter_scale into those scales.

The model is MaxText's decoder shape written in plain JAX
(benchmarks/_maxtext_decoder.py: gated MLP, RMSNorm, float32 weights and AdamW
state, bfloat16 compute; what it leaves out is listed there, above all
MaxText's fused attention kernel).  The plan is
``ShardParallel(mesh_shape=MaxText's mesh)``: one stage on MaxText's mesh
(slices x fsdp x tensor), the ILP choosing each tensor's layout (FSDP, tensor
or data splits emerge from it).  Recomputation is MaxText's own: each layer is
wrapped in ``jax.checkpoint`` with its remat_policy (minimal: the projections'
outputs kept; full: nothing kept), which the planner sees in the step's jaxpr.  MFU is
MaxText's own FLOP count (:func:`maxtext_flops`) over the predicted step time
and the chip's bf16 peak, so predicted and published MFU compare step times.
The TPU cluster files carry no achieved efficiencies (peak rates).  Nothing is
fitted to a row.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (label, global_parameter_scale, per-device batch, cluster file, mesh shape,
#  MaxText's TFLOP/s per chip, MaxText's MFU)
ROWS = (
    ("32B v5p-128", 32, 7, "tpu-v5p-128", (16, 4), 328, 0.6776, "minimal"),
    ("64B v5p-128", 64, 3, "tpu-v5p-128", (16, 4), 323, 0.7031, "minimal"),
    ("16B 1x v5e-256", 16, 6, "tpu-v5e-256", (256,), 120, 0.6110, "full"),
    ("16B 2x v5e-256", 16, 6, "tpu-v5e-256-x2", (2, 256), 117, 0.5937, "full"),
    ("32B 1x v5e-256", 32, 4, "tpu-v5e-256", (256,), 132, 0.6686, "full"),
    ("32B 2x v5e-256", 32, 4, "tpu-v5e-256-x2", (2, 256), 128, 0.6481, "full"),
)


def scales(scale: int) -> tuple[int, int, int, int]:
    """MaxText's get_individual_scales: (emb, heads, mlp, layers) exponents."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def model_dims(scale: int) -> dict[str, int]:
    """MaxText's model for ``global_parameter_scale``: emb, heads, mlp, layers."""
    emb, heads, mlp, layers = scales(scale)
    return {"emb": 2048 * 2**emb, "heads": 16 * 2**heads, "mlp": 7168 * 2**mlp,
            "layers": 16 * 2**layers, "vocab": 32000, "seq": 2048}


def maxtext_flops(d: dict[str, int], batch: int) -> float:
    """Training FLOPs of one step as MaxText counts them for its TFLOP/s
    (calculate_tflops_training_per_device: 6 x the matmul weights' FLOPs per
    token, plus attention scores and context at the full, not causal, s^2)."""
    tokens = batch * d["seq"]
    hd = d["heads"] * 128
    per_layer = 2 * tokens * (3 * d["emb"] * d["mlp"] + 3 * d["emb"] * hd + hd * d["emb"])
    weights = d["layers"] * per_layer + 2 * tokens * d["emb"] * d["vocab"]
    attention = d["layers"] * 4 * batch * d["seq"] ** 2 * hd
    return 3 * (weights + attention)


def run_row(row) -> str:
    import meshplan
    from _maxtext_decoder import abstract_step

    label, scale, pdb, cluster_name, shape, mt_tflops, mt_mfu, remat = row
    cluster = meshplan.load_cluster(ROOT / "examples" / "clusters" / "tpu" / f"{cluster_name}.json")
    d = model_dims(scale)
    batch = pdb * cluster.num_devices
    step, state, tokens = abstract_step(batch=batch, remat_policy=remat, **d)
    peak = cluster.device.flops_for("bfloat16")
    flops = maxtext_flops(d, batch) / cluster.num_devices
    measured_s = flops / (mt_tflops * 1e12)          # MaxText's step time, implied
    start = time.perf_counter()
    try:
        plan = meshplan.plan(step, state, tokens, cluster=cluster,
                             method=meshplan.ShardParallel(mesh_shape=shape))
    except meshplan.MeshplanError as e:
        outcome = f"no plan: {str(e).splitlines()[0][:400]}"
        predicted = "-"
    else:
        t = plan.predicted.iteration_s
        mfu = flops / t / peak
        predicted = f"{mfu:.1%} ({(mfu - mt_mfu) / mt_mfu:+.0%})"
        st = plan.stages[0]
        outcome = (f"{t:.3g} s vs {measured_s:.3g} s; compute {st.predicted.compute_s:.3g} s, "
                   f"comm {st.predicted.comm_s:.3g} s, {human(st.predicted.memory_bytes)}/chip")
    took = time.perf_counter() - start
    layers_emb = f"{d['layers']} x {d['emb']} (mlp {d['mlp']})"
    return (f"| {label} | {shape} | {layers_emb} | {remat} | {mt_tflops} | {mt_mfu:.2%} | "
            f"{predicted} | {outcome} ({took:.0f} s) |")


def human(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


NOTE = ("Predictions use the TPU files' peak rates (no achieved efficiency is published "
        "for TPU matmuls; none is assumed). The stand-in's attention passes each block's "
        "scores through HBM, which MaxText's splash kernel does not, so attention is "
        "priced slower than it runs; peak matmul rates price the rest faster than it runs. "
        "Where a row has no plan, the reason is printed in full.")


def select(rows, only: str | None):
    return rows if not only else [r for r in rows if any(o in r[0] for o in only.split(","))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table (markdown) here")
    parser.add_argument("--only", help="rows whose label contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    lines = ["# MaxText's published MFU on TPU against meshplan's prediction", "",
             "Command: `python benchmarks/maxtext_tpu.py --out benchmarks/results/"
             "maxtext_tpu.md`. Sources and the model stand-in: see the script's docstring. "
             "MFU = MaxText's FLOPs per chip / step time / bf16 peak; the error is relative to MaxText's. "
             "Times in brackets are planning wall time on a shared machine.", "",
             "| row | mesh | layers x emb | remat | MaxText TFLOP/s/chip | MaxText MFU | "
             "meshplan MFU (error) | predicted vs MaxText's step; plan |",
             "|---|---|---|---|---|---|---|---|"]
    for row in select(ROWS, args.only):
        lines.append(run_row(row))
        print(lines[-1], file=sys.stderr)
    lines += ["", NOTE]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
