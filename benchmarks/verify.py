"""Predicted vs compiled communication and memory per device.

Plans the built-in models (small defaults) with ShardParallel on 8 fake CPU
devices for every mesh shape of 8 devices, compiles each step and compares
the plan's comm_bytes_per_device and peak memory with the compiled HLO and
``memory_analysis()`` (see meshplan.tools.verify).  Prints a markdown table and
writes benchmarks/results/verify.md and verify.csv.

Pipeline rows (one per stage): gpt and mlp under Manual with 2 stages of
2x2 devices and 4 stages of 2, gpt and moe with 4 stages of 1x2 (no data
parallelism), every stage program compiled as the pipeline
runs it, against the stage's predicted communication and memory (see
meshplan.tools.verify.verify_pipeline); written to verify_pipeline.md.

    python benchmarks/verify.py [--models mlp,gpt] [--meshes 8 2x4] [--no-pipelines]

Recomputation rows (``--remat``, alone): a gpt with long sequences under
``Manual(dp=2, tp=4, remat=k)`` for none / selective / full, the plan's
predicted activation bytes and memory against the compiled program's
``memory_analysis()`` (XLA CPU with its memory-aware scheduler, see
meshplan.tools.remat_memory); written to verify_remat.md.

    python benchmarks/verify.py --remat
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import _fake_devices  # noqa: E402,F401  (before jax: 8 fake CPU devices)

MODELS = ("mlp", "gpt", "moe", "wresnet")
MESHES = ((8,), (2, 4), (4, 2), (2, 2, 2))
# (model, dp, tp, pp, micro-batches, schedule)
# (gpt 1x2 x4 stages: the head cuts its tokens over the model axis, where
# the plan reduces the tied weight's gradient every micro-batch)
PIPELINES = (("gpt", 2, 2, 2, 4, "1f1b"), ("gpt", 2, 1, 4, 2, "gpipe"),
             ("gpt", 1, 2, 4, 4, "1f1b"), ("moe", 1, 2, 4, 4, "1f1b"),
             ("mlp", 2, 2, 2, 4, "1f1b"), ("mlp", 2, 1, 4, 2, "gpipe"))
# searched (PipeshardParallel(stages=pp) on 8 devices): model, stages, micro-batches, schedule
SEARCHED = (("gpt", 2, 4, "1f1b"), ("mlp", 2, 4, "1f1b"))
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", nargs="*", default=["x".join(map(str, m)) for m in MESHES])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-pipelines", action="store_true", help="skip the pipeline rows")
    ap.add_argument("--only-pipelines", action="store_true", help="only the pipeline rows")
    ap.add_argument("--remat", action="store_true",
                    help="only the recomputation rows (memory_analysis per choice)")
    a = ap.parse_args(argv)
    if a.remat:
        return remat(a)
    if not a.no_pipelines:
        pipelines(a)
    if a.only_pipelines:
        return 0

    from meshplan.tools.verify import csv_text, markdown_table, verify

    rows = []
    for model in a.models.split(","):
        for m in a.meshes:
            shape = tuple(int(x) for x in m.split("x"))
            r = verify(model, shape)
            rows.append(r)
            print(f"{model:8s} {m:6s} comm {r.predicted_comm_bytes:>10,} vs {r.actual_comm_bytes:>10,} "
                  f"({r.comm_rel_error:+.1%})  mem {r.predicted_memory_bytes:>10,} vs "
                  f"{r.actual_memory_bytes:>10,} ({r.memory_rel_error:+.1%})", flush=True)
    table = markdown_table(rows)
    print()
    print(table)
    bad = [r for r in rows if not r.comm_ok]
    if not a.no_write:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        md = ["# Predicted vs compiled communication and memory (per device)", "",
              "8 fake CPU devices (XLA CPU), built-in models at their default (small) sizes, "
              "ShardParallel on each mesh shape.  Communication: the plan's "
              "`comm_bytes_per_device` vs the summed result bytes of the collectives in "
              "`compiled.as_text()` (AR all-reduce, AG all-gather, RS reduce-scatter, "
              "A2A all-to-all, CP collective-permute; K = KiB).  Memory: the plan's peak vs "
              "`memory_analysis()` argument + output - alias + temp.", "",
              table, "",
              f"{len(rows) - len(bad)}/{len(rows)} cases within 10% on communication.", ""]
        (out / "verify.md").write_text("\n".join(md))
        (out / "verify.csv").write_text(csv_text(rows))
    return 0


def pipelines(a: argparse.Namespace) -> None:
    from meshplan.tools.verify import pipeline_table, verify_pipeline

    rows = []
    for model, dp, tp, pp, mb, schedule in PIPELINES:
        rows += verify_pipeline(model, dp, tp, pp, mb, schedule)
    for model, pp, mb, schedule in SEARCHED:
        rows += verify_pipeline(model, 1, 8 // pp, pp, mb, schedule, searched=True)
    table = pipeline_table(rows)
    print(table, flush=True)
    ok = sum(r.comm_ok for r in rows)
    mem = sum(abs(r.memory_rel_error) <= 0.10 for r in rows)
    print(f"\n{ok}/{len(rows)} stages within 10% on communication, {mem}/{len(rows)} on memory")
    if not a.no_write:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        md = ["# Pipeline stages: predicted vs compiled communication and memory (per device)", "",
              "8 fake CPU devices (XLA CPU), built-in models at their default sizes, Manual plans, "
              "and (`searched`) `PipeshardParallel(stages=2, num_micro_batches=4)` plans. "
              "Communication: the stage's predicted `comm_bytes` vs the collectives of its "
              "compiled programs, each times the runs of one call (forward and backward per "
              "micro-batch; means of the running sums and update once: with partial gradient "
              "sums the means program holds the step's one data-parallel gradient reduction, "
              "see meshplan.runtime.pipeline_partial).  Memory: the stage's predicted `memory_bytes` vs its "
              "state + running sums + activations of the micro-batches in flight + the largest "
              "`temp` of its programs (`memory_analysis()`); *pred temporaries*: the plan's "
              "part for the latter.", "", table, "",
              f"{ok}/{len(rows)} stages within 10% on communication, {mem}/{len(rows)} on "
              "memory.", ""]
        (out / "verify_pipeline.md").write_text("\n".join(md))


REMAT_GPT = {"optimizer": "sgd", "layers": 4, "hidden": 64, "seq_len": 256, "vocab": 128,
             "batch": 16, "heads": 8}


def remat(a: argparse.Namespace) -> int:
    import os
    # (before jax starts: the scheduler that frees what is recomputed)
    from meshplan.tools.remat_memory import SCHEDULER_FLAG
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SCHEDULER_FLAG}".strip()
    from meshplan.tools.remat_memory import remat_table, verify_remat

    table = remat_table(verify_remat("gpt", 2, 4, overrides=REMAT_GPT))
    print(table, flush=True)
    if not a.no_write:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = ", ".join(f"{k}={v}" for k, v in REMAT_GPT.items())
        md = ["# One-program recomputation: predicted vs compiled memory (per device)", "",
              f"gpt ({cfg}) under `Manual(dp=2, tp=4, remat=k)` on 8 fake CPU devices, "
              "XLA CPU with `--xla_cpu_enable_concurrency_optimized_scheduler=false`.  "
              "none is planned by the whole-graph ILP, selective and full by the stage DP "
              "(other layouts, other memory model).  Compiled: `memory_analysis()` of the "
              "step as `parallelize` runs it.", "", table, ""]
        (out / "verify_remat.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
