"""Plan quality: Alpa's Figure 7 and its ablations (Zheng et al., OSDI'22).

Every model of Alpa's GPT, MoE and Wide-ResNet weak-scaling suites on the GPU
count of its preset (AWS p3.16xlarge, 8 V100s per host; fewer than 8 GPUs: one
host with fewer GPUs), planned by meshplan's Auto and by the baselines:

    auto      meshplan.Auto()
    data      DataParallel(): one stage, replicated weights
    zero3     one stage, 1-D data mesh, weights and optimizer state sharded over it
    intra     ShardParallel(): one stage, every logical mesh (intra-op only)
    inter     PipeshardParallel with data-parallel stages of equally many layers
              (inter-op only), best over the number of stages
    grid      the best Megatron-style hand plan Manual(dp, tp, pp, mb, schedule)

data, zero3 and intra take the whole batch at once when it fits, else they
accumulate gradients over micro-batches (one pipeline stage, micro-batches
searched), as Alpa's intra-op-only runs do; --no-grad-accum turns that off.

    python benchmarks/plan_quality.py [--suite gpt,moe,wresnet] [--max-gpus 64]
        [--rows gpt-350m,moe-380m@8] [--skip-grid] [--grid-micro-batches 1,2,4,8,16,32,64]
        [--no-grad-accum] [--out DIR] [--resume [--replan auto,...]]

Rows run smallest cluster first and the files are rewritten after every row.
--resume keeps the rows of DIR/plan_quality.csv that have no planner error and
plans only the others (delete a row from the CSV to plan it again); with
--replan, the named methods of every kept row are planned again and the other
columns kept (after a change that moves only those methods' plans).
Writes benchmarks/results/plan_quality.{csv,md,png}.  Planning only: the
figures are TFLOP/s per GPU predicted by meshplan's cost model.  Set
MESHPLAN_WORKERS to bound the processes that solve layer ILPs.
"""
from __future__ import annotations

import argparse
import csv
import functools
import pathlib
import sys
import time
import traceback

import meshplan
from meshplan.api import plan_graph, retracer
from meshplan.dp_search.assemble import plan_from_intra_op
from meshplan.dp_search import PipelineOptions, Session, plan_pipeline
from meshplan.errors import InfeasiblePlanError
from meshplan.graph import BATCH, strip_markers
from meshplan.ilp import InputLayouts, solve_intra_op
from meshplan.models import PRESET_INFO, PRESETS, build_model
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SUITES = ("gpt", "moe", "wresnet")
METHODS = ("auto", "data", "zero3", "intra", "inter", "grid")
BASELINES = METHODS[1:]
TOLERANCE = 0.005     # auto counts as best when within 0.5% of every baseline


def cluster_for(gpus: int) -> meshplan.ClusterSpec:
    """aws-p3.16xlarge-x{gpus/8}; below 8 GPUs, one host with ``gpus`` GPUs."""
    hosts = max(1, gpus // 8)
    c = meshplan.load_cluster(ROOT / "examples" / "clusters" / f"aws-p3.16xlarge-x{hosts}.json")
    return c if gpus >= 8 else c.with_devices(1, gpus)


def cluster_file(gpus: int) -> pathlib.Path:
    """A cluster JSON file of :func:`cluster_for` (for the CLI); below 8 GPUs
    written to a temporary folder."""
    if gpus >= 8:
        return ROOT / "examples" / "clusters" / f"aws-p3.16xlarge-x{gpus // 8}.json"
    import tempfile
    path = pathlib.Path(tempfile.gettempdir()) / f"meshplan-aws-p3.16xlarge-{gpus}gpu.json"
    path.write_text(cluster_for(gpus).to_json())
    return path


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def describe(plan: meshplan.Plan) -> str:
    """Stages, their logical meshes, micro-batches and schedule, e.g. '2x[2x4] mb16 1f1b'."""
    meshes = ["x".join(map(str, s.logical_mesh.shape)) for s in plan.stages]
    shape = f"[{meshes[0]}]" if len(set(meshes)) == 1 else "[" + ",".join(meshes) + "]"
    text = f"{len(plan.stages)}x{shape}"
    if plan.num_micro_batches > 1:
        text += f" mb{plan.num_micro_batches}"
    if len(plan.stages) > 1:
        text += f" {plan.schedule}"
    if any(s.remat for s in plan.stages):
        text += " remat"
    return text


# -- the methods: each returns (plan, description) -------------------------------

# One-stage baselines take the whole batch at once when it fits, else (as
# Alpa's intra-op-only runs, with 16-64 micro-batches) accumulate gradients
# over micro-batches: one pipeline stage, micro-batches searched.
GRAD_ACCUM = True


def one_stage(whole, graph, cluster, rt, session, **options):
    try:
        p = whole()
        return p, describe(p)
    except InfeasiblePlanError:
        if not GRAD_ACCUM:
            raise
    opts = PipelineOptions(num_stages=1, schedules=("1f1b",), **options)
    p = plan_pipeline(graph, cluster, meshplan.PipeshardParallel(stages=1), retrace=rt,
                      options=opts, session=session)
    return p, describe(p)


def m_auto(graph, cluster, rt, layers, mbs, session):
    p = plan_graph(graph, cluster, meshplan.Auto(), retrace=rt, session=session)
    return p, describe(p)


def m_data(graph, cluster, rt, layers, mbs, session):
    return one_stage(lambda: plan_graph(graph, cluster, meshplan.DataParallel(), session=session),
                     graph, cluster, rt, session, data_parallel_stages=True,
                     input_filter=InputLayouts("replicated"))


def m_zero3(graph, cluster, rt, layers, mbs, session):
    def whole():
        g = strip_markers(graph)
        r = solve_intra_op(g, cluster, LogicalMesh(("data",), (cluster.num_devices,)),
                           input_filter=InputLayouts("sharded"))
        return plan_from_intra_op(g, cluster, r, "zero3")
    return one_stage(whole, graph, cluster, rt, session, data_parallel_stages=True,
                     input_filter=InputLayouts("sharded"))


def m_intra(graph, cluster, rt, layers, mbs, session):
    return one_stage(lambda: plan_graph(graph, cluster, meshplan.ShardParallel(), session=session),
                     graph, cluster, rt, session)


def best_of(candidates):
    """The fastest plan of ``candidates`` (thunks returning (plan, text));
    InfeasiblePlanError when none fits."""
    best, err = None, None
    for make in candidates:
        try:
            p, text = make()
        except InfeasiblePlanError as e:
            err = e
            continue
        if best is None or p.predicted.iteration_s < best[0].predicted.iteration_s:
            best = (p, text)
    if best is None:
        raise err or InfeasiblePlanError("no candidate plan")
    return best


def m_inter(graph, cluster, rt, layers, mbs, session):
    n = cluster.num_devices
    # one GPU: one stage with gradient accumulation is the only "pipeline"
    stages = [s for s in divisors(n) if 2 <= s <= layers] or [1]

    def one(S):
        opts = PipelineOptions(num_stages=S, data_parallel_stages=True, equal_layers=True,
                               input_filter=InputLayouts("replicated"),
                               schedules=("1f1b", "gpipe"))
        p = plan_pipeline(graph, cluster, meshplan.PipeshardParallel(stages=S), retrace=rt,
                          options=opts, session=session)
        return p, describe(p)
    return best_of([functools.partial(one, S) for S in stages])


def grid_points(n: int, per_host: int, batch: int, layers: int, mbs: list[int]):
    """(dp, tp, pp, micro-batches, schedule) of every Megatron-style hand plan:
    tp inside a host, pp at most the layers, each micro-batch split over dp."""
    for tp in divisors(min(n, per_host)):
        if n % tp:
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp > layers:
                continue
            for mb in mbs:
                if batch % mb or (batch // mb) % dp:
                    continue
                for sched in (("gpipe", "1f1b") if pp > 1 else ("1f1b",)):
                    yield dp, tp, pp, mb, sched


def m_grid(graph, cluster, rt, layers, mbs, session):
    batch = graph.tensors[next(i.tensor for i in graph.inputs if i.role == BATCH)].shape[0]

    def one(dp, tp, pp, mb, sched):
        p = plan_graph(graph, cluster, meshplan.Manual(dp, tp, pp, mb, sched), retrace=rt,
                       session=session)
        return p, f"dp{dp} tp{tp} pp{pp} mb{mb} {sched}" + (
            " remat" if any(s.remat for s in p.stages) else "")
    def points(counts):
        return [functools.partial(one, *pt) for pt in
                grid_points(cluster.num_devices, cluster.devices_per_host, batch, layers, counts)]
    counts, more = mbs, max(mbs) * 2
    while True:
        try:
            return best_of(points(counts))
        except InfeasiblePlanError:
            # nothing fits: like auto, go on to ever more (smaller) micro-batches
            if more > batch:
                raise       # (why the most micro-batches tried fit nothing)
            counts, more = [more], more * 2


METHOD_FNS = {"auto": m_auto, "data": m_data, "zero3": m_zero3, "intra": m_intra,
              "inter": m_inter, "grid": m_grid}


# -- rows -------------------------------------------------------------------------

def run_row(name: str, gpus: int, methods: tuple[str, ...], mbs: list[int],
            kept: dict | None = None) -> dict:
    """Plan ``methods`` for one row; ``kept``: the earlier run's row, whose
    other columns stay as they were."""
    cluster = cluster_for(gpus)
    m = build_model(name)
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name=name)
    # the step split into micro-batches (rewritten from `graph` where that is
    # proven exact, as `meshplan plan` does), shared by all methods
    rt = functools.lru_cache(maxsize=None)(
        retracer(m.train_step, m.abstract_args, m.batch_argnums, name, graph=graph))
    layers = m.config["layers"]
    row = dict(kept or {"model": name, "gpus": gpus, "cluster": cluster.name})
    session = Session.from_env()     # layer ILPs shared by the methods of this row
    for meth in methods:
        print(f"  {name} on {gpus} GPU(s): {meth} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            p, text = METHOD_FNS[meth](graph, cluster, rt, layers, mbs, session)
            row[meth] = round(p.predicted.tflops_per_device, 2)
            row[f"{meth} plan"] = text
        except InfeasiblePlanError as e:
            row[meth], row[f"{meth} plan"] = "OOM", str(e).split(";")[0]
        except Exception as e:   # a planner failure is reported, not fatal to the run
            traceback.print_exc()
            row[meth], row[f"{meth} plan"] = "ERROR", f"{type(e).__name__}: {e}"
        row[f"{meth} s"] = round(time.perf_counter() - t0, 1)
    if "auto" in row:
        row["auto best"] = auto_is_best(row, [m for m in METHODS if m in row])
    return row


def value(x) -> float:
    return x if isinstance(x, (int, float)) else 0.0


def auto_is_best(row: dict, methods) -> str:
    """yes / NO / all OOM, against the baselines that did not fail ("?": auto failed)."""
    if row["auto"] == "ERROR":
        return "?"
    base = [value(row[k]) for k in methods if k in BASELINES]
    if not value(row["auto"]) and not any(base):
        return "all OOM"
    return "yes" if value(row["auto"]) >= (1 - TOLERANCE) * max(base, default=0.0) else "NO"


def select_rows(args) -> list[tuple[str, int]]:
    if args.rows:
        out = []
        for item in args.rows.split(","):
            name, _, g = item.partition("@")
            out.append((name, int(g) if g else PRESET_INFO[name]["gpus"]))
        return out
    suites = args.suite.split(",")
    rows = [(name, info["gpus"]) for name, info in PRESET_INFO.items()
            if PRESETS[name][0] in suites and info["source"].startswith("Alpa")
            and info["gpus"] and info["gpus"] <= args.max_gpus]
    # smallest clusters first, suites interleaved: a long run stopped early
    # has every suite up to some GPU count
    return sorted(rows, key=lambda r: (r[1], SUITES.index(PRESETS[r[0]][0])))


# -- output -------------------------------------------------------------------------

def md_table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def read_rows(path: pathlib.Path) -> dict[tuple[str, int], dict]:
    """Rows of an earlier run's CSV by (model, GPUs), figures back to numbers."""
    def parse(v: str):
        try:
            return float(v) if "." in v else int(v)
        except ValueError:
            return v
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        rows = [{k: parse(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return {(r["model"], r["gpus"]): r for r in rows}


def write_results(rows: list[dict], methods, command: str, mbs,
                  planned: int, out: pathlib.Path = RESULTS, replan: tuple[str, ...] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    wall_s = sum(value(r.get(f"{m} s")) for r in rows for m in (replan or methods))
    run = (f"Run of {time.strftime('%Y-%m-%d')}: {wall_s / 60:.1f} min of planning (the sum of "
           "the per-method times below)" if not replan else
           f"Columns {', '.join(replan)} planned again on {time.strftime('%Y-%m-%d')} "
           f"({wall_s / 60:.1f} min of planning), the others kept from the earlier run's CSV")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "plan_quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
    main_keys = ["model", "gpus", *methods] + (["auto best"] if "auto" in methods else [])
    plan_keys = ["model", "gpus"] + [f"{m} plan" for m in methods]
    time_keys = ["model", "gpus"] + [f"{m} s" for m in methods]
    not_best = [r for r in rows if r.get("auto best") == "NO"]
    errors = [(r["model"], r["gpus"], m, r[f"{m} plan"]) for r in rows for m in methods
              if r.get(m) == "ERROR"]
    md = [
        "# Plan quality: Alpa Figure 7 and its ablations (predicted by meshplan's cost model)",
        "",
        f"Reproduce: `{command}`",
        "",
        run + " on the shared 2-core machine" + ("." if len(rows) == planned else
                            f", stopped after {len(rows)} of the {planned} rows it plans.") +
        "  Cluster: AWS p3.16xlarge (8 V100 16 GB per host, NVLink inside a "
        "host, 25 Gbit/s between hosts); below 8 GPUs one host with fewer GPUs.  Figures: "
        "TFLOP/s per GPU predicted by meshplan's cost model (model FLOPs / GPUs / predicted "
        "iteration time); nothing ran on a GPU.  OOM: the method has no plan that fits 90% of "
        "the 16 GB of a V100 in the cost model's memory estimate.",
        "",
        "Methods: **auto** `meshplan.Auto()`; **data** `DataParallel()` (one stage, replicated "
        "weights); **zero3** one stage on a 1-D `data` mesh with weights and optimizer state "
        "sharded over it (`InputLayouts(\"sharded\")`); **intra** `ShardParallel()` (intra-op "
        "only: one stage, every logical mesh).  These three take the whole batch at once when "
        "it fits, else accumulate gradients over micro-batches (one pipeline stage, "
        "micro-batches 1-64 searched, remat allowed), as Alpa's own intra-op-only runs do with "
        "16-64 micro-batches" + ("" if GRAD_ACCUM else " (not in this run: --no-grad-accum)") +
        ".  **inter** inter-op only: pipelines of "
        "data-parallel stages with equally many layer groups each, best over the number of "
        "stages (divisors of the GPU count from 2 up to the model's layers; one stage on one "
        "GPU), micro-batches and schedule (1F1B, GPipe) searched; **grid** the best "
        "Megatron-style hand plan `Manual(dp, tp, pp, mb, schedule)` with dp*tp*pp = GPUs, "
        "tp inside a host, pp at most the model's layers, micro-batches in "
        f"{{{', '.join(map(str, mbs))}}} (those dividing the batch into pieces dp divides; "
        "when none of them fits, twice the largest, and so on), "
        "GPipe and 1F1B (1F1B only for pp = 1).  **auto best**: auto within 0.5% of every "
        "baseline or better.",
        "",
        "## TFLOP/s per GPU",
        "",
        md_table(rows, main_keys),
        "",
        "![plan quality](plan_quality.png)",
        "",
        "## Rows where auto is not the best",
        "",
    ]
    if not_best:
        for r in not_best:
            beat = [f"{m} {r[m]} ({r[f'{m} plan']})" for m in methods
                    if m in BASELINES and value(r[m]) > value(r["auto"]) * (1 + TOLERANCE)]
            md.append(f"- **{r['model']} on {r['gpus']} GPUs**: auto {r['auto']} "
                      f"({r['auto plan']}) < " + "; ".join(beat) + ".")
        md.append("")
    else:
        md += ["None.", ""]
    if errors:
        md += ["## Planner errors", "", "(left out of the auto-best comparison)", ""]
        md += [f"- {m} on {g} GPUs, {meth}: `{text}`" for m, g, meth, text in errors]
        md.append("")
    plans = [{k: (r[k[:-5]] if r.get(k[:-5]) in ("OOM", "ERROR") else v) for k, v in r.items()}
             for r in rows]
    reasons: dict[str, list[str]] = {}
    for r in rows:
        for m in methods:
            if r.get(m) == "OOM":
                reasons.setdefault(r[f"{m} plan"], []).append(f"{r['model']}/{r['gpus']} {m}")
    md += ["## Plans chosen", "",
           "`SxM`: S stages on logical mesh M (per stage when they differ), `mbB`: B "
           "micro-batches, then the schedule; `remat`: at least one stage recomputes its "
           "forward pass.", "",
           md_table(plans, plan_keys), "", "The planner's reasons for OOM:", ""]
    md += [f"- {why}: {', '.join(where)}" for why, where in reasons.items()]
    md += ["",
           "## Planning wall time (seconds)", "",
           "Methods of a row run in this order in one process; layer ILPs are cached "
           "across the grid's points (same dp x tp mesh and micro-batch count).", "",
           md_table(rows, time_keys), ""]
    (out / "plan_quality.md").write_text("\n".join(md))
    plot(rows, methods, out)


def plot(rows: list[dict], methods, out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    suites = [s for s in SUITES if any(PRESETS.get(r["model"], ("",))[0] == s for r in rows)]
    fig, axes = plt.subplots(len(suites), 1, figsize=(11, 3.4 * len(suites)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, suite in zip(axes[:, 0], suites):
        rs = [r for r in rows if PRESETS[r["model"]][0] == suite]
        for k, meth in enumerate(methods):
            xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(rs))]
            ys = [value(r.get(meth)) for r in rs]
            ax.bar(xs, ys, width, label=meth)
            for x, r in zip(xs, rs):
                if r.get(meth) in ("OOM", "ERROR"):
                    ax.text(x, 0, "x" if r[meth] == "OOM" else "!", ha="center", va="bottom",
                            fontsize=8, color="red")
        ax.set_xticks(range(len(rs)), [f"{r['model']}\n{r['gpus']} GPU" for r in rs], fontsize=8)
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{suite} (predicted; x = OOM, ! = planner error)")
        ax.set_ylim(0, max([value(r.get(m)) for r in rs for m in methods] + [1]) * 1.1)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out / "plan_quality.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=",".join(SUITES))
    ap.add_argument("--max-gpus", type=int, default=64)
    ap.add_argument("--rows", default="", help="presets, optionally name@GPUs; overrides --suite")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--grid-micro-batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--no-grad-accum", action="store_true",
                    help="one-stage baselines only with the whole batch at once")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of OUT/plan_quality.csv without planner errors")
    ap.add_argument("--replan", default="",
                    help="with --resume: methods planned again in the kept rows")
    args = ap.parse_args(argv)
    replan = tuple(m for m in args.replan.split(",") if m)
    if replan and (not args.resume or not set(replan) <= set(METHODS)):
        ap.error(f"--replan takes --resume and methods among {', '.join(METHODS)}")
    global GRAD_ACCUM
    GRAD_ACCUM = not args.no_grad_accum
    methods = tuple(m for m in METHODS if not (args.skip_grid and m == "grid"))
    mbs = [int(x) for x in args.grid_micro_batches.split(",")]
    command = "python benchmarks/plan_quality.py " + " ".join(argv if argv is not None
                                                              else sys.argv[1:])
    out = pathlib.Path(args.out)
    earlier = read_rows(out / "plan_quality.csv") if args.resume else {}
    rows, selected = [], select_rows(args)
    for name, gpus in selected:
        old = earlier.get((name, gpus))
        if old and all(m in old and old[m] != "ERROR" for m in methods):
            if not replan:
                print(f"kept {name} on {gpus} GPU(s) from the earlier run", file=sys.stderr)
                rows.append(old)
                continue
            print(f"planning {'/'.join(replan)} of {name} on {gpus} GPU(s) again ...",
                  file=sys.stderr, flush=True)
            rows.append(run_row(name, gpus, replan, mbs, kept=old))
        else:
            print(f"planning {name} on {gpus} GPU(s) ...", file=sys.stderr, flush=True)
            rows.append(run_row(name, gpus, methods, mbs))
        print(" | ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        # written after every row: a long run interrupted keeps what it has
        write_results(rows, methods, command.strip(), mbs, len(selected), out, replan)
    write_results(rows, methods, command.strip(), mbs, len(selected), out, replan)
    print(md_table(rows, ["model", "gpus", *methods] + (["auto best"] if "auto" in methods else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
