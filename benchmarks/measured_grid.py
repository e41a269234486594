"""Predicted against measured step times on the 8 local fake CPU devices.

Closes the loop between the cost model and real runs: the local devices are
calibrated (``meshplan.tools.calibrate``, as ``meshplan calibrate`` does) or a
cluster JSON is read (``--cluster``), then for the built-in ``gpt`` and
``moe`` (small sizes, ``MODEL_SIZES``) every configuration of a grid
``Manual(dp, tp, pp, num_micro_batches, schedule, remat)`` with
dp * tp * pp = 8, plus ``Auto()``, is planned and run with
``meshplan.parallelize(train_step, method=..., cluster=...)``.

Per configuration: the plan is made (a refusal -- ``InfeasiblePlanError`` or
another ``MeshplanError`` while planning -- is listed as refused), the step
is called once (compilation) and warmed up, then each pass times
``--repeats`` repeats of ``--steps`` steps, each step ended by
``block_until_ready``; a repeat's figure is its mean step time and a pass
keeps the fastest of its repeats (the eight device threads share two
cores: how the scheduler places them only ever slows a repeat down, so the
fastest is the most reproducible figure, as ``timeit`` advises).  Two passes
run over a model's configurations in opposite orders (drift in the shared
machine's load cancels out); the measured figure is the mean of the two
passes and the table shows how much the passes disagree.  Compilation is never timed.

Per model it reports the MAPE of ``plan.predicted.iteration_s`` against the
measured time, the Spearman rank correlation between them, where ``Auto()``'s
plan falls among the measured times (its time over the fastest, its rank),
and the measured time of the predicted-fastest configuration over the
measured-fastest.

    python benchmarks/measured_grid.py [--models gpt,moe] [--quick]
        [--repeats 5] [--steps 2] [--cluster FILE | --save-cluster FILE]
    python benchmarks/measured_grid.py --repredict CSV --cluster FILE [--sensitivity]
    python benchmarks/measured_grid.py --agreement CSV [CSV ...]

Writes benchmarks/results/measured_grid.md and .csv (``--out`` to change)
and prints the table and the summary.  The fake devices share the host's
cores: figures are indicative, above all on a loaded machine.
"""
from __future__ import annotations

import _fake_devices  # noqa: F401  (before jax: 8 fake CPU devices)

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Sequence  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "measured_grid"
DEVICES = 8

# Small enough that one step takes a few hundred ms and compiles in ~10-20 s
# on a 2-core host (compilation is most of the run's time; SGD keeps the
# programs shorter than Adam); 4 blocks still give the planner 8 layers
# (embedding, blocks, head), so 8 one-layer stages are possible.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "gpt": {"hidden": 192, "layers": 4, "seq_len": 64, "batch": 16, "heads": 4,
            "optimizer": "sgd"},
    "moe": {"hidden": 192, "layers": 4, "seq_len": 64, "batch": 16, "heads": 4,
            "num_experts": 8, "optimizer": "sgd"},
}
# the gpt with Megatron-LM's dropout: what drawing the masks costs
MODEL_SIZES["gpt-dropout"] = {**MODEL_SIZES["gpt"], "dropout": 0.1}


def build(name: str) -> Any:
    """The built-in model a grid name stands for, at its size."""
    from meshplan.models import build_model
    return build_model(name.split("-")[0], MODEL_SIZES[name])

MESHES = [(dp, tp, DEVICES // (dp * tp)) for dp in (8, 4, 2, 1) for tp in (1, 2, 4, 8)
          if DEVICES % (dp * tp) == 0]          # (dp, tp, pp), pp = 8 / (dp * tp)


# ---------------------------------------------------------------------------
# the configurations

@dataclass(frozen=True)
class Config:
    """One ``Manual`` configuration, or ``Auto()`` (``auto=True``)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    mb: int = 1
    remat: bool = False
    schedule: str = "1f1b"
    auto: bool = False

    def method(self) -> Any:
        import meshplan
        if self.auto:
            return meshplan.Auto()
        return meshplan.Manual(dp=self.dp, tp=self.tp, pp=self.pp, num_micro_batches=self.mb,
                               schedule=self.schedule, remat=self.remat)

    def label(self) -> str:
        if self.auto:
            return "Auto()"
        return (f"Manual(dp={self.dp}, tp={self.tp}, pp={self.pp}, mb={self.mb}, "
                f"{self.schedule}, remat={self.remat})")


def micro_batch_counts(pp: int) -> tuple[int, ...]:
    """Micro-batch counts tried for ``pp`` stages: one for a single stage,
    otherwise pp and 2 pp (at most 8: the batch is 16 rows, split over dp too)."""
    if pp == 1:
        return (1,)
    return tuple(sorted({min(pp, 8), min(2 * pp, 8)}))


def grid_configs(quick: bool = False) -> list[Config]:
    """The Manual grid over dp x tp x pp x micro-batches x remat (8 devices).

    Full: every (dp, tp, pp) with dp * tp * pp = 8, each micro-batch count of
    :func:`micro_batch_counts` without recomputation; where tp <= 2 the
    largest count also with full recomputation; and a GPipe twin of the
    2 x 2 x 2 pipeline with 4 micro-batches.
    Quick: data parallel and a 2 x 2 x 2 pipeline."""
    if quick:
        return [Config(dp=8), Config(dp=2, tp=2, pp=2, mb=2)]
    out: list[Config] = []
    for dp, tp, pp in MESHES:
        counts = micro_batch_counts(pp)
        out += [Config(dp, tp, pp, mb) for mb in counts]
        if tp <= 2:
            out.append(Config(dp, tp, pp, counts[-1], remat=True))
    out.append(Config(2, 2, 2, 4, schedule="gpipe"))
    return out


def model_configs(quick: bool = False) -> list[Config]:
    """What one model runs: the grid, then ``Auto()``."""
    return grid_configs(quick) + [Config(auto=True)]


def run_list(models: Sequence[str], quick: bool = False) -> list[tuple[str, Config]]:
    """Every (model, configuration) a run plans, in pass-1 order."""
    return [(m, c) for m in models for c in model_configs(quick)]


# ---------------------------------------------------------------------------
# statistics (pure)

def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error of ``predicted`` against ``measured`` (%)."""
    if not measured or len(predicted) != len(measured):
        return math.nan
    return 100.0 * statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured))


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rank correlation (ties averaged); nan with fewer than three
    points or a constant side."""
    if len(predicted) != len(measured) or len(measured) < 3:
        return math.nan
    if len(set(predicted)) < 2 or len(set(measured)) < 2:
        return math.nan
    from scipy.stats import spearmanr
    return float(spearmanr(predicted, measured).statistic)


def auto_position(auto_s: float, others: Sequence[float]) -> tuple[float, int, int]:
    """Where a measured time falls among ``others`` (the other configurations):
    (its time / the fastest of all, its rank with 1 the fastest, how many in all)."""
    fastest = min([auto_s, *others])
    rank = 1 + sum(1 for t in others if t < auto_s)
    return auto_s / fastest, rank, len(others) + 1


def predicted_fastest_ratio(predicted: Sequence[float],
                            measured: Sequence[float]) -> tuple[int, float]:
    """(index of the predicted-fastest configuration, its measured time over
    the measured-fastest)."""
    k = min(range(len(predicted)), key=lambda i: predicted[i])
    return k, measured[k] / min(measured)


def pass_disagreement(a: float, b: float) -> float:
    """How much two passes disagree: |a - b| over their mean (%)."""
    return 100.0 * abs(a - b) / ((a + b) / 2)


def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def ratio_by(rows: Sequence[dict], key: str) -> dict[Any, tuple[float, int]]:
    """Geometric mean of predicted / measured per value of ``key`` over
    measured rows: {value: (geomean ratio, rows)}."""
    groups: dict[Any, list[float]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r["predicted_s"] / r["measured_s"])
    return {k: (geomean(v), len(v)) for k, v in sorted(groups.items(), key=lambda kv: str(kv[0]))}


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """The per-model summary of its rows (measured ones have ``measured_s``)."""
    ok = [r for r in rows if r.get("measured_s")]
    grid = [r for r in ok if r["method"] == "manual"]
    auto = next((r for r in ok if r["method"] == "auto"), None)
    out: dict[str, Any] = {
        "configurations": len(rows), "measured": len(ok),
        "refused": sum(r["status"].startswith("refused") for r in rows),
        "errors": sum(r["status"].startswith("error") for r in rows),
        "mape_pct": mape([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]),
        "spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]),
        "median_ratio": statistics.median(
            [r["predicted_s"] / r["measured_s"] for r in ok]) if ok else math.nan,
        "pass_disagreement_median_pct": statistics.median(
            [r["pass_disagreement_pct"] for r in ok]) if ok else math.nan,
        "pass_disagreement_max_pct": max((r["pass_disagreement_pct"] for r in ok),
                                         default=math.nan),
    }
    if ok:
        fastest = min(ok, key=lambda r: r["measured_s"])
        k, ratio = predicted_fastest_ratio([r["predicted_s"] for r in ok],
                                           [r["measured_s"] for r in ok])
        out.update(fastest=fastest["config"], fastest_ms=fastest["measured_s"] * 1e3,
                   predicted_fastest=ok[k]["config"], predicted_fastest_ratio=ratio)
    if auto is not None and grid:
        ratio, rank, n = auto_position(auto["measured_s"], [r["measured_s"] for r in grid])
        out.update(auto_plan=auto["config"], auto_ratio=ratio, auto_rank=rank, auto_of=n)
    return out


# ---------------------------------------------------------------------------
# the cluster

def get_cluster(args: argparse.Namespace) -> tuple[Any, str]:
    """The cluster to plan for, and where it came from."""
    import meshplan
    if args.cluster:
        return meshplan.load_cluster(args.cluster), f"read from `{args.cluster}`"
    from meshplan.tools.calibrate import calibrate
    t = time.perf_counter()
    # the full calibration even with --quick: quick sizes are too small to
    # reach the devices' speed, and the predictions would mean little
    cal = calibrate()
    cluster = cal.cluster
    how = (f"calibrated in this run with `meshplan calibrate`'s defaults in "
           f"{time.perf_counter() - t:.0f} s")
    for w in cal.warnings:      # (a figure taken on a busy host: the table says so)
        print(f"warning: {w}", file=sys.stderr)
        how += f"; **calibration warning**: {w}"
    if args.save_cluster:
        pathlib.Path(args.save_cluster).write_text(cluster.to_json() + "\n")
        how += f", saved to `{args.save_cluster}`"
    return cluster, how


def cluster_lines(cluster: Any) -> list[str]:
    d = cluster.device
    flops = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(d.peak_flops))
    intra = cluster.intra_host
    return [f"- devices: {cluster.num_hosts} host x {cluster.devices_per_host} `{d.kind}`, "
            f"{d.memory_bytes / 2**30:.2f} GiB each",
            f"- peak GFLOP/s per device: {flops}",
            f"- memory bandwidth: {d.memory_bandwidth_bytes_per_s / 1e9:.3f} GB/s per device",
            f"- intra-host link: {intra.bandwidth_bytes_per_s / 1e9:.3f} GB/s, "
            f"latency {intra.latency_s * 1e6:.1f} us"]


# ---------------------------------------------------------------------------
# running one configuration

@dataclass
class Entry:
    """A configuration being measured: its step, its state, its figures."""
    config: Config
    row: dict
    step: Any = None
    state: Any = None
    passes: list[float] = field(default_factory=list)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def describe_plan(plan: Any) -> dict[str, Any]:
    """The plan's own dp/tp/pp/mb/schedule/remat (what ``Auto`` chose)."""
    shape = plan.stages[0].logical_mesh.shape
    return {"dp": shape[0], "tp": math.prod(shape[1:]), "pp": len(plan.stages),
            "mb": plan.num_micro_batches, "schedule": plan.schedule,
            "remat": any(s.remat for s in plan.stages),
            "note": "plan: " + "; ".join(str(s.logical_mesh) for s in plan.stages)}


def new_row(model: str, c: Config) -> dict:
    return {"model": model, "method": "auto" if c.auto else "manual", "config": c.label(),
            "dp": c.dp, "tp": c.tp, "pp": c.pp, "mb": c.mb, "remat": c.remat,
            "schedule": c.schedule, "status": "", "note": "", "predicted_s": None,
            "pass1_s": None, "pass2_s": None, "measured_s": None, "ratio": None,
            "pass_disagreement_pct": None, "plan_s": None, "first_call_s": None}


def prepare(model: Any, name: str, c: Config, cluster: Any, session: Any, state: Any,
            batch: Any, warmup: int) -> Entry:
    """Plan ``c`` (refused or not), compile and warm it up."""
    import jax
    import meshplan
    from meshplan.errors import MeshplanError
    e = Entry(c, new_row(name, c))
    step = meshplan.parallelize(model.train_step, method=c.method(), cluster=cluster,
                                batch_argnums=model.batch_argnums, donate_argnums=(0,),
                                session=session)
    t = time.perf_counter()
    try:
        plan = step.plan_for(state, batch)
    except MeshplanError as err:
        e.row["status"] = "refused: " + one_line(err)
        return e
    except Exception as err:  # a crash of the planner, not a refusal
        e.row["status"] = "error: " + one_line(err)
        return e
    e.row["plan_s"] = time.perf_counter() - t
    e.row["predicted_s"] = plan.predicted.iteration_s
    if c.auto:
        e.row.update(describe_plan(plan))
    try:
        t = time.perf_counter()
        s, _ = step(state, batch)
        jax.block_until_ready(s)
        e.row["first_call_s"] = time.perf_counter() - t
        for _ in range(warmup):
            s, _ = step(s, batch)
        jax.block_until_ready(s)
    except Exception as err:  # the runtime crashed on a plan it was given
        e.row["status"] = "error: " + one_line(err)
        return e
    e.step, e.state = step, s
    e.row["status"] = "ok"
    return e


def time_pass(e: Entry, batch: Any, repeats: int, steps: int, warmup: int) -> float:
    """One pass over ``e``: the fastest over ``repeats`` of the mean step
    time of ``steps`` steps, each ended by ``block_until_ready``."""
    import jax
    s = e.state
    for _ in range(warmup):
        s, _ = e.step(s, batch)
    jax.block_until_ready(s)
    means = []
    for _ in range(max(1, repeats)):
        times = []
        for _ in range(max(1, steps)):
            t = time.perf_counter()
            s, _ = e.step(s, batch)
            jax.block_until_ready(s)
            times.append(time.perf_counter() - t)
        means.append(statistics.fmean(times))
    e.state = s
    return min(means)


def finish(e: Entry) -> dict:
    """The row of ``e`` with its measured figures."""
    r = e.row
    if len(e.passes) == 2:
        p1, p2 = e.passes
        r.update(pass1_s=p1, pass2_s=p2, measured_s=(p1 + p2) / 2,
                 pass_disagreement_pct=pass_disagreement(p1, p2))
        r["ratio"] = r["predicted_s"] / r["measured_s"]
    return r


def run_model(name: str, configs: Sequence[Config], cluster: Any, args: argparse.Namespace,
              log: Any) -> list[dict]:
    """Both passes over one model's configurations."""
    import jax
    from meshplan import progress
    from meshplan.dp_search import Session
    model = build(name)
    state, batch = jax.device_get(model.init(0))
    session = Session.from_env(progress.Progress(progress.QUIET))
    entries = []
    for k, c in enumerate(configs):          # pass 1: plan, compile, time
        t = time.perf_counter()
        e = prepare(model, name, c, cluster, session, state, batch, warmup=2)
        if e.step is not None:
            e.passes.append(time_pass(e, batch, args.repeats, args.steps, warmup=0))
        entries.append(e)
        got = f"{e.passes[0] * 1e3:8.1f} ms" if e.passes else e.row["status"]
        log(f"[{name} pass 1 {k + 1}/{len(configs)}] {c.label():58} {got} "
            f"({time.perf_counter() - t:.1f} s)")
    for e in reversed(entries):              # pass 2: the opposite order
        if e.step is not None:
            e.passes.append(time_pass(e, batch, args.repeats, args.steps, warmup=1))
    rows = [finish(e) for e in entries]
    del entries
    gc.collect()
    return rows


# ---------------------------------------------------------------------------
# output

COLUMNS = ["model", "method", "dp", "tp", "pp", "mb", "remat", "schedule", "predicted_ms",
           "pass1_ms", "pass2_ms", "measured_ms", "ratio", "pass_disagreement_pct", "status",
           "plan_s", "first_call_s", "note"]


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def flat(r: dict) -> dict:
    """A row as the CSV and the table write it."""
    return {"model": r["model"], "method": r["method"], "dp": r["dp"], "tp": r["tp"],
            "pp": r["pp"], "mb": r["mb"], "remat": "yes" if r["remat"] else "no",
            "schedule": r["schedule"], "predicted_ms": _ms(r["predicted_s"]),
            "pass1_ms": _ms(r["pass1_s"]), "pass2_ms": _ms(r["pass2_s"]),
            "measured_ms": _ms(r["measured_s"]), "ratio": _num(r["ratio"]),
            "pass_disagreement_pct": _num(r["pass_disagreement_pct"], ".1f"),
            "status": r["status"], "plan_s": _num(r["plan_s"], ".1f"),
            "first_call_s": _num(r["first_call_s"], ".1f"), "note": r["note"]}


def table_lines(rows: Sequence[dict]) -> list[str]:
    head = ["model", "method", "dp", "tp", "pp", "mb", "remat", "schedule", "predicted ms",
            "measured ms (pass 1, pass 2)", "pred / meas", "passes differ %", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(
        "---:" if h in ("dp", "tp", "pp", "mb", "predicted ms", "pred / meas",
                        "passes differ %") else "---" for h in head) + "|"]
    for r in rows:
        f = flat(r)
        measured = (f"{f['measured_ms']} ({f['pass1_ms']}, {f['pass2_ms']})"
                    if f["measured_ms"] else "")
        status = f["status"] + (f" ({f['note']})" if f["note"] else "")
        lines.append("| " + " | ".join(str(x) for x in (
            f["model"], f["method"], f["dp"], f["tp"], f["pp"], f["mb"], f["remat"],
            f["schedule"], f["predicted_ms"], measured, f["ratio"],
            f["pass_disagreement_pct"], status.replace("|", "/"))) + " |")
    return lines


def summary_lines(name: str, s: dict) -> list[str]:
    lines = [f"### {name}", "",
             f"- configurations: {s['configurations']} ({s['measured']} measured, "
             f"{s['refused']} refused, {s['errors']} errors)",
             f"- MAPE of predicted vs measured: {_num(s['mape_pct'], '.1f')}%",
             f"- Spearman rank correlation: {_num(s['spearman'], '.3f')}",
             f"- median predicted / measured: {_num(s['median_ratio'])}",
             f"- passes disagree by {_num(s['pass_disagreement_median_pct'], '.1f')}% "
             f"(median), {_num(s['pass_disagreement_max_pct'], '.1f')}% (largest)"]
    if "fastest" in s:
        lines.append(f"- measured-fastest: {s['fastest']} at {s['fastest_ms']:.1f} ms")
        lines.append(f"- predicted-fastest: {s['predicted_fastest']}, measured "
                     f"{s['predicted_fastest_ratio']:.2f}x the measured-fastest")
    if "auto_ratio" in s:
        lines.append(f"- Auto(): measured {s['auto_ratio']:.2f}x the fastest, rank "
                     f"{s['auto_rank']} of {s['auto_of']}")
    return lines + [""]


def factor_lines(rows: Sequence[dict]) -> list[str]:
    """Geometric-mean predicted / measured by pp, micro-batches, tp and remat."""
    ok = [r for r in rows if r.get("measured_s") and r["method"] == "manual"]
    if not ok:
        return []
    lines = ["| model | factor | value: geomean predicted / measured (rows) |", "|---|---|---|"]
    for model in sorted({r["model"] for r in ok}):
        mine = [r for r in ok if r["model"] == model]
        for key in ("pp", "mb", "tp", "dp", "remat"):
            groups = ratio_by(mine, key)
            lines.append(f"| {model} | {key} | " + ", ".join(
                f"{k}: {g:.2f} ({n})" for k, (g, n) in groups.items()) + " |")
    return lines


def write(rows: Sequence[dict], summaries: dict[str, dict], head: list[str],
          out: pathlib.Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(flat(r) for r in rows)
    body = head + ["## Summary", ""]
    for name, s in summaries.items():
        body += summary_lines(name, s)
    body += ["## Predicted / measured by factor (Manual rows)", "",
             "A ratio below 1: the cost model predicts faster than measured.", ""]
    body += factor_lines(rows) + ["", "## Every configuration", ""] + table_lines(rows)
    text = "\n".join(body) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def header(args: argparse.Namespace, argv: Sequence[str], cluster: Any, how: str,
           wall_s: float) -> list[str]:
    import jax
    cmd = " ".join(["python benchmarks/measured_grid.py", *argv])
    sizes = "; ".join(f"`{m}` " + ", ".join(f"{k} {v}" for k, v in MODEL_SIZES[m].items())
                      for m in args.models)
    return [
        "# Predicted vs measured step time, 8 fake CPU devices", "",
        f"Generated by `{cmd}` on {datetime.date.today()} in {wall_s / 60:.1f} min, "
        f"{platform.machine()} host with {os.cpu_count()} cores shared by the 8 fake devices "
        f"(and with other work while measured: read the figures as indicative), "
        f"jax {jax.__version__}.", "",
        f"Models (float32): {sizes}. Each configuration is planned with "
        "`meshplan.parallelize(train_step, method=..., cluster=...)`, called once "
        "(compilation) and warmed up; each of two passes (opposite orders) keeps the fastest "
        f"of {args.repeats} repeats of the mean of {args.steps} steps, each ended by "
        "`block_until_ready`; measured = mean of the two passes. Predicted = "
        "`plan.predicted.iteration_s`. MAPE and Spearman are over every measured row of the "
        "model, Auto() included; Auto()'s rank is among the measured Manual rows and itself.",
        "", f"Cluster ({how}):", "", *cluster_lines(cluster), ""]


# ---------------------------------------------------------------------------

def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,moe",
                    help="comma-separated: gpt, moe, gpt-dropout")
    ap.add_argument("--quick", action="store_true",
                    help="two Manual configurations and Auto() per model, few repeats "
                         "(a smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per pass (default 5; "
                    "quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat "
                    "(default 2; quick 1)")
    ap.add_argument("--cluster", help="cluster JSON to plan with instead of calibrating")
    ap.add_argument("--save-cluster", help="write the calibrated cluster JSON here")
    ap.add_argument("--out", default=str(OUT), help="output path without suffix "
                    "(.md and .csv are written)")
    ap.add_argument("--repredict", metavar="CSV",
                    help="measure nothing: plan the configurations a run's CSV measured "
                         "with --cluster (this code's model) and print MAPE and Spearman "
                         "against that run's measurements")
    ap.add_argument("--agreement", nargs="+", metavar="CSV",
                    help="measure nothing: Spearman between the passes of each run's CSV "
                         "and between the measured times of every two runs")
    ap.add_argument("--sensitivity", action="store_true",
                    help="with --repredict: also with each physical term of the cluster "
                         "halved and doubled in turn; prints a table of MAPE and Spearman")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODEL_SIZES]
    if bad:
        ap.error(f"--models: unknown {', '.join(bad)}; use {', '.join(MODEL_SIZES)}")
    if args.cluster and args.save_cluster:
        ap.error("--save-cluster writes a calibrated cluster; with --cluster nothing is "
                 "calibrated")
    if args.repredict and not args.cluster:
        ap.error("--repredict plans with a given cluster: add --cluster FILE")
    if args.sensitivity and not args.repredict:
        ap.error("--sensitivity re-plans a recorded run: add --repredict CSV --cluster FILE")
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.steps = args.steps or (1 if args.quick else 2)
    return args


def repredict(path: str, models: Sequence[str], cluster: Any
              ) -> tuple[list[str], dict[str, tuple[float, float]]]:
    """Per model, MAPE and Spearman of this code's predictions on ``cluster``
    against the measurements recorded in a run's CSV (separates a change of
    the model from a change of the calibration or of the machine): the
    lines to print, and per model ``(MAPE %, Spearman)``."""
    import jax
    import meshplan
    from meshplan import progress
    from meshplan.dp_search import Session
    with open(path, newline="") as f:
        recorded = [r for r in csv.DictReader(f) if r.get("measured_ms")]
    session = Session.from_env(progress.Progress(progress.QUIET))
    out: list[str] = []
    scores: dict[str, tuple[float, float]] = {}
    for name in models:
        mine = [r for r in recorded if r["model"] == name]
        if not mine:
            continue
        model = build(name)
        state, batch = jax.eval_shape(lambda: model.init(0))
        pred, meas = [], []
        for r in mine:
            c = Config(auto=True) if r["method"] == "auto" else Config(
                int(r["dp"]), int(r["tp"]), int(r["pp"]), int(r["mb"]), r["remat"] == "yes",
                r["schedule"])
            step = meshplan.parallelize(model.train_step, method=c.method(), cluster=cluster,
                                        batch_argnums=model.batch_argnums, donate_argnums=(0,),
                                        session=session)
            pred.append(step.plan_for(state, batch).predicted.iteration_s * 1e3)
            meas.append(float(r["measured_ms"]))
            out.append(f"  {name} {c.label()}: predicted {pred[-1]:.1f} ms, measured "
                       f"{meas[-1]:.1f} ms, {pred[-1] / meas[-1]:.2f}")
        scores[name] = (mape(pred, meas), spearman(pred, meas))
        out.append(f"{name}: {len(mine)} rows, MAPE {scores[name][0]:.1f}%, "
                   f"Spearman {scores[name][1]:.3f}")
    return out, scores


def recorded_times(path: str) -> dict[tuple, tuple[float, float, float]]:
    """A run's CSV: per configuration (model, method, dp, tp, pp, mb, remat,
    schedule), its (pass 1, pass 2, measured) milliseconds; rows measured only."""
    with open(path, newline="") as f:
        return {(r["model"], r["method"], r["dp"], r["tp"], r["pp"], r["mb"], r["remat"],
                 r["schedule"]): (float(r["pass1_ms"]), float(r["pass2_ms"]),
                                  float(r["measured_ms"]))
                for r in csv.DictReader(f) if r.get("measured_ms")}


def agreement(paths: Sequence[str], models: Sequence[str]) -> list[str]:
    """How reproducible the measured ranking is, per model: Spearman between
    the two passes of each run, and between the measured times of every two
    runs over the configurations both measured (the ceiling a model's
    Spearman can be held to)."""
    runs = {p: recorded_times(p) for p in paths}
    out = []
    for name in models:
        for p, t in runs.items():
            mine = [v for k, v in t.items() if k[0] == name]
            out.append(f"{name} {p}: passes {spearman([v[0] for v in mine], [v[1] for v in mine]):.3f}"
                       f" ({len(mine)} rows)")
        for i, a in enumerate(paths):
            for b in paths[i + 1:]:
                both = [k for k in runs[a] if k in runs[b] and k[0] == name]
                rho = spearman([runs[a][k][2] for k in both], [runs[b][k][2] for k in both])
                out.append(f"{name} {a} vs {b}: {rho:.3f} ({len(both)} rows)")
    return out


# --sensitivity: the cluster's physical terms, each scaled in turn by these
# factors (which figure, were it mis-measured, moves the ranking)
SENSITIVITY_TERMS = ("device.peak_flops", "device.memory_bandwidth_bytes_per_s",
                     "device.achieved.kernel_launch_s", "device.achieved.program_dispatch_s",
                     "links.intra_host.bandwidth_bytes_per_s", "links.intra_host.latency_s")
SENSITIVITY_FACTORS = (0.5, 2.0)


def scaled_cluster(data: dict, term: str, factor: float) -> dict:
    """A copy of cluster JSON ``data`` with the number at the dotted path
    ``term`` (or every number of the mapping there, as ``peak_flops`` per
    dtype) multiplied by ``factor``.  ValueError names a path that is not
    there or holds no number."""
    import copy
    out = copy.deepcopy(data)
    *parents, key = term.split(".")
    node = out
    for k in parents:
        node = node.get(k) if isinstance(node, dict) else None
    value = node.get(key) if isinstance(node, dict) else None
    if isinstance(value, dict) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        node[key] = {k: v * factor for k, v in value.items()}
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        node[key] = value * factor
    else:
        raise ValueError(f"the cluster JSON has no number at {term!r}")
    return out


def sensitivity(path: str, models: Sequence[str], cluster_file: str,
                terms: Sequence[str] = SENSITIVITY_TERMS,
                factors: Sequence[float] = SENSITIVITY_FACTORS) -> list[str]:
    """A Markdown table: :func:`repredict`'s MAPE and Spearman per model with
    ``cluster_file`` as it is, then with each of ``terms`` scaled by each of
    ``factors`` (the others as they are)."""
    import json
    import meshplan
    data = json.loads(pathlib.Path(cluster_file).read_text())
    runs = [("(as calibrated)", 1.0)] + [(t, f) for t in terms for f in factors]
    lines = ["| term | factor | " + " | ".join(f"{m} MAPE % | {m} Spearman" for m in models)
             + " |", "|---|---:|" + "---:|---:|" * len(models)]
    for term, f in runs:
        d = data if f == 1.0 else scaled_cluster(data, term, f)
        cluster = meshplan.ClusterSpec.from_dict(d, source=f"{cluster_file} ({term} x {f:g})")
        _, scores = repredict(path, models, cluster)
        cells = [f"{scores[m][0]:.1f} | {scores[m][1]:.3f}" if m in scores else " | "
                 for m in models]
        lines.append(f"| {term} | {f:g} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    t0 = time.perf_counter()
    if args.agreement:
        print("\n".join(agreement(args.agreement, args.models)))
        return 0
    if args.repredict:
        cluster, _ = get_cluster(args)
        if args.sensitivity:
            sensitivity(args.repredict, args.models, args.cluster)
        else:
            print("\n".join(repredict(args.repredict, args.models, cluster)[0]))
        return 0

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t0:7.1f}s {msg}", flush=True)

    cluster, how = get_cluster(args)
    log(f"cluster {how}")
    rows: list[dict] = []
    summaries: dict[str, dict] = {}
    todo = run_list(args.models, args.quick)
    log(f"{len(todo)} configurations: " + ", ".join(
        f"{sum(m == name for m, _ in todo)} of {name}" for name in args.models))
    for name in args.models:
        mine = run_model(name, [c for m, c in todo if m == name], cluster, args, log)
        rows += mine
        summaries[name] = summarize(mine)
    wall = time.perf_counter() - t0
    text = write(rows, summaries, header(args, argv, cluster, how, wall), pathlib.Path(args.out))
    print(text)
    print(f"wrote {args.out}.md and .csv in {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
