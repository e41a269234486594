"""The ``meshplan`` command line.

Exit status 0 on success, 2 on bad input with one line on stderr.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import progress
from .errors import MeshplanError, ModelConfigError, step_failure
from .methods import normalize_argnums
from .units import human_bytes


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.endswith(": expected one argument"):
            # (argparse reads a value such as -1,2 as an option: say how to pass it)
            flag = message.split(":")[0].removeprefix("argument ").split("/")[-1]
            message += f" (a value that starts with '-' goes after '=': {flag}=VALUE)"
        self.exit(2, f"meshplan: error: {message} (see '{self.prog} --help')\n")


@dataclass(frozen=True)
class Target:
    """What to plan: a train step, example arguments, and where they came from."""
    name: str
    train_step: Callable
    args: tuple
    batch_argnums: tuple[int, ...]
    model_config: dict[str, Any] | None
    init: Callable[[int], tuple] | None = None


def _parse_model_args(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ModelConfigError(f"--model-arg expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def load_target(args: argparse.Namespace) -> Target:
    """The train step named by ``--model``/``--model-arg`` or ``--fn``."""
    if getattr(args, "fn", None):
        if args.model_arg:
            raise ModelConfigError(f"--model-arg sizes a built-in --model; --fn {args.fn} "
                                   "builds its own step: set its sizes in that function")
        return _load_fn(args.fn)
    from .models import build_model
    m = build_model(args.model, _parse_model_args(args.model_arg or []))
    return Target(name=m.preset or m.name, train_step=m.train_step, args=tuple(m.abstract_args),
                  batch_argnums=tuple(m.batch_argnums), model_config=dict(m.config), init=m.init)


def _import(name: str) -> Any:
    """A module by its dotted name, or by the path of its file (``dir/mod.py``)."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    if not os.path.isfile(name):
        raise ImportError(f"no file {name}")
    spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
    module = importlib.util.module_from_spec(spec)
    # (the file's directory first, as running the file would: its own imports)
    sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
    spec.loader.exec_module(module)
    return module


def _load_fn(spec: str) -> Target:
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ModelConfigError(f"--fn expects MODULE:FUNCTION, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ModelConfigError(f"--fn {spec}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # the user's module fails while importing
        raise ModelConfigError(f"--fn {spec}: importing module {module_name!r} failed: "
                               f"{type(e).__name__}: {e}") from e
    factory = getattr(module, func_name, None)
    if not callable(factory):
        what = "no function" if factory is None else f"a {type(factory).__name__}, no function,"
        raise ModelConfigError(f"--fn {spec}: module {module_name!r} has {what} {func_name!r}")
    try:
        result = factory()
    except Exception as e:  # the user's function fails (or needs arguments)
        raise ModelConfigError(f"--fn {spec}: calling {func_name}() failed: {type(e).__name__}: "
                               f"{e}; it must take no arguments and return (train_step, "
                               "example_args)") from e
    shape = ("must return (train_step, example_args) or (train_step, example_args, "
             "batch_argnums), with example_args a tuple or list of the step's arguments")
    if not (isinstance(result, tuple) and len(result) in (2, 3) and callable(result[0])
            and isinstance(result[1], (tuple, list))):
        raise ModelConfigError(f"--fn {spec}: the function {shape}; it returned "
                               f"{_describe(result)}")
    try:
        batch_argnums = normalize_argnums(result[2] if len(result) == 3 else (1,))
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"--fn {spec}: {e}") from None
    return Target(name=func_name, train_step=result[0], args=tuple(result[1]),
                  batch_argnums=batch_argnums, model_config=None)


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def _add_target_args(p: argparse.ArgumentParser, fn: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="built-in model or preset (mlp, gpt, moe, wresnet, gpt-1.3b, ...)")
    if fn:   # (run needs a built-in model: it makes concrete data with the model's init)
        g.add_argument("--fn", help="MODULE:FUNCTION returning (train_step, example_args)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size of the built-in model (repeatable)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from .trace import trace
    if args.json:
        _check_out(args.json, "--json")
    target = load_target(args)
    with args.session.progress.step(f"tracing {target.name}"):
        graph = trace(target.train_step, *target.args, batch_argnums=target.batch_argnums,
                      name=target.name, warn=False)     # (printed below)
    s = graph.summary(top=args.top)
    if target.model_config is not None:
        s["model_config"] = target.model_config
    print(f"{target.name}: {s['num_ops']} ops, {s['total_flops']:.4g} FLOPs per step "
          f"({s['matmul_flops']:.4g} in matmuls/convolutions)")
    if target.model_config:
        print("  config: " + ", ".join(f"{k}={v}" for k, v in target.model_config.items()))
    print(f"  parameters:      {s['num_params']:,} ({human_bytes(s['param_bytes'])})")
    print(f"  optimizer state: {human_bytes(s['opt_state_bytes'])}")
    print(f"  other state:     {human_bytes(s['state_bytes'])}")
    print(f"  batch:           {human_bytes(s['batch_bytes'])}")
    print(f"  intermediates:   {human_bytes(s['activation_bytes'])} (sum of all, before liveness)")
    print(f"  fingerprint:     {s['fingerprint']}")
    print("  ops by primitive: " + ", ".join(
        f"{k} {v}" for k, v in list(s["ops_by_primitive"].items())[:12]))
    print("  biggest ops by FLOPs:")
    for b in s["biggest_ops"]:
        shapes = " ".join("x".join(map(str, sh)) or "()" for sh in b["output_shapes"])
        print(f"    n{b['node']:<6} {b['primitive']:<22} {b['flops']:.3g} FLOPs -> {shapes}  {b['scope']}")
    for w in s["warnings"]:
        print(f"  warning: {w}")
    from .trace.unstack import layer_counts, scanned_leaf_shapes
    stacked = scanned_leaf_shapes(graph)
    if stacked:
        print(f"  note: a lax.scan iterates over {layer_counts(stacked)} stacked layers; planning "
              "unrolls it (each layer's parameters become their own inputs)")
    if args.json:
        _write_text(args.json, json.dumps(s, indent=2) + "\n")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    spec = _cluster(args.path)
    if args.cluster_cmd == "validate":
        unit = "TPU slice(s)" if spec.tpu is not None else "host(s)"
        print(f"{args.path}: ok ({spec.name}: {spec.num_hosts} {unit} x "
              f"{spec.devices_per_host} {spec.device.kind})")
    else:
        print(spec.describe())
    return 0


def _cluster(arg: str):
    from .cluster import ClusterSpec, load_cluster
    return ClusterSpec.local() if arg == "local" else load_cluster(arg)


# which methods take each method flag (the others choose it themselves)
APPLIES = {"dp": ("manual",), "tp": ("manual",), "pp": ("manual", "pipeshard"),
           "micro_batches": ("auto", "pipeshard", "manual"),
           "schedule": ("auto", "pipeshard", "manual"),
           "max_stages": ("auto", "pipeshard"), "tp_within_host": ("auto", "pipeshard"),
           "offload": ("auto", "shard", "data", "manual")}


def _method(args: argparse.Namespace):
    from . import methods as M
    name = args.method
    if args.mesh and name != "shard":
        raise ModelConfigError(f"--mesh applies to --method shard only (got --method {name}); "
                               "use --dp/--tp/--pp with --method manual")
    if args.remat is not None and name not in ("manual", "shard"):
        raise ModelConfigError(f"--remat applies to --method manual and shard only (got --method "
                               f"{name}); the other methods choose recomputation per stage")
    remat = {"always": "full", "never": "none"}.get(args.remat, args.remat)
    given = [k for k, users in APPLIES.items()
             if getattr(args, k, None) not in (None, "auto", False) and name not in users]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        users = sorted({u for k in given for u in APPLIES[k]} - {name})
        # (manual is told its shape, where the searches are bounded)
        why = ("give its shape with --dp, --tp and --pp" if name == "manual"
               else f"--method {name} chooses {'it' if len(given) == 1 else 'them'} itself")
        raise ModelConfigError(f"{flags} {'applies' if len(given) == 1 else 'apply'} to "
                               f"--method {_either(users)} only (got --method {name}); {why}")
    mb, sched = _counts(args.micro_batches), _names(args.schedule)
    common = dict(time_limit=args.time_limit, memory_fraction=args.memory_fraction)
    if getattr(args, "offload", None) is not None and name != "pipeshard":
        common["offload"] = args.offload
    search = dict(num_micro_batches=mb, schedule=sched, max_stages=args.max_stages,
                  tp_within_host=args.tp_within_host)
    if name == "shard":
        mesh = _parse_mesh(args.mesh) if args.mesh else None
        return M.ShardParallel(mesh_shape=mesh, remat=remat or "none", **common)
    if name == "data":
        return M.DataParallel(**common)
    if name == "manual":
        if not isinstance(mb, (int, type(None))) or not isinstance(sched, str):
            raise ModelConfigError("--method manual takes one --micro-batches count and one "
                                   "--schedule; lists are for --method auto and pipeshard")
        return M.Manual(dp=args.dp or 1, tp=args.tp or 1, pp=args.pp or 1,
                        num_micro_batches=mb or 1,
                        schedule=sched if sched != "auto" else "1f1b",
                        remat=None if remat in (None, "auto") else remat,
                        **common)
    if name == "pipeshard":
        return M.PipeshardParallel(stages=args.pp or "auto", **search, **common)
    return M.Auto(**search, **common)


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _counts(text: str | None) -> int | tuple[int, ...] | None:
    """``--micro-batches``: one count, or counts to search (``4,8,16``)."""
    if text is None:
        return None
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(c < 1 for c in counts):
        raise ModelConfigError(f"--micro-batches expects a positive integer or a comma-separated "
                               f"list of them (e.g. 4,8,16), got {text!r}")
    return counts[0] if len(counts) == 1 else counts


def _names(text: str) -> str | tuple[str, ...]:
    """``--schedule``: one schedule, or schedules to search (``gpipe,1f1b``)."""
    from .methods import SCHEDULES
    names = tuple(x.strip() for x in text.split(","))
    if not all(n in SCHEDULES for n in names) or (len(names) > 1 and "auto" in names):
        raise ModelConfigError(f"--schedule expects auto, one of {', '.join(SCHEDULES[1:])}, or "
                               f"a comma-separated list of them, got {text!r}")
    return names[0] if len(names) == 1 else names


def _parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().replace("*", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise ModelConfigError(f"--mesh expects sizes like 2x4, got {text!r}")
    return shape


def cmd_plan(args: argparse.Namespace) -> int:
    from . import planning
    if args.emit_out and not args.emit:
        raise ModelConfigError("--emit-out names the file for --emit python; add --emit python")
    # --json -: the plan JSON is what goes to stdout (the plan's text to stderr)
    json_out = args.json == "-"
    if json_out and args.emit and not args.emit_out:
        raise MeshplanError("--json - and --emit python both write to stdout; give one of them "
                            "a file: --json plan.json or --emit-out step.py")
    for flag, path, example in (("--json", None if json_out else args.json, "plan.json"),
                                ("--timeline", args.timeline, "timeline.png"),
                                ("--emit-out", args.emit_out, "shard_plan.py")):
        if path:    # (before minutes of planning, not after)
            _check_out(path, flag, example)
    if args.timeline and os.path.splitext(args.timeline)[1].lower() not in _IMAGES:
        raise MeshplanError(f"--timeline {args.timeline}: name an image file ending in one of "
                            f"{', '.join(sorted(_IMAGES))}")
    target = load_target(args)
    cluster = _cluster(args.cluster)
    method = _method(args)
    traced = planning.trace_function(target.train_step, target.args, target.batch_argnums,
                                     target.name, args.session)
    plan = planning.plan_function(traced, cluster, method, args.session,
                                  explain=args.explain).plan
    snippet = None
    if args.emit:
        if traced.unstacked is not None:
            raise MeshplanError(
                "--emit python: this step's lax.scan over stacked layers was unrolled for "
                "planning, so the plan lays out per-layer arguments that the step as written "
                "never sees; run it with meshplan run (or meshplan.parallelize), or write the "
                "step without the scan for a plain jax.jit")
        from .tools.snippet import python_snippet
        snippet = python_snippet(plan, len(target.args))
    # --emit python without --emit-out: the snippet is all that goes to stdout
    say = print if (snippet is None or args.emit_out) and not json_out else _to_stderr
    if snippet is not None and not args.emit_out:
        print(snippet, end="")
        if args.explain:
            say(plan.explain())
    else:
        say(str(plan))
        if args.explain:
            say(plan.explain())
    if json_out:
        print(plan.to_json())
    elif args.json:
        _write_text(args.json, plan.to_json())
        say(f"plan written to {args.json}")
    if args.timeline:
        from .tools.timeline import breakdown, draw
        blocks = draw(plan, args.timeline)
        say(f"timeline written to {args.timeline}: {breakdown(plan, blocks)}")
    if snippet is not None and args.emit_out:
        _write_text(args.emit_out, snippet)
        say(f"python snippet written to {args.emit_out}")
    return 0


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    """Plan (or load) a plan, run it on the local devices and compare with the
    unparallelized step."""
    import jax
    import numpy as np
    from .api import parallelize
    from .plan import Plan
    target = load_target(args)
    if target.init is None:
        raise ModelConfigError("meshplan run needs a built-in model (--model) with concrete data")
    if args.plan:
        given = [f"--{k.replace('_', '-')}" for k, default in _PLANNING_DEFAULTS.items()
                 if getattr(args, k, default) != default]
        if given:
            raise ModelConfigError(f"--plan runs the saved plan as it is; drop {', '.join(given)} "
                                   "(or drop --plan to plan with them)")
        try:
            text = open(args.plan, encoding="utf-8").read()
        except OSError as e:
            raise ModelConfigError(f"cannot read plan {args.plan}: {e.strerror}") from e
        except UnicodeDecodeError:
            raise ModelConfigError(f"{args.plan} is not a plan: not a text file; give the JSON "
                                   "that meshplan plan --json wrote") from None
        step = parallelize(target.train_step, plan=Plan.from_json(text), donate_argnums=(0,))
    else:
        from .cluster import ClusterSpec
        step = parallelize(target.train_step, cluster=ClusterSpec.local(), method=_method(args),
                           batch_argnums=target.batch_argnums, session=args.session,
                           donate_argnums=(0,))     # (the state: a copy of our own)
    state, batch = target.init(0)
    ref_state = state
    par_state = jax.tree.map(lambda x: np.array(x), state)
    reference = jax.jit(target.train_step)
    print(f"running {target.name} for {args.steps} step(s) on {len(jax.devices())} "
          f"{jax.devices()[0].platform} device(s)")
    for k in range(args.steps):
        ref_state, ref_metrics = reference(ref_state, batch)
        par_state, metrics = step(par_state, batch)
        print(f"  step {k + 1}: loss {float(metrics['loss']):.6f} "
              f"(unparallelized {float(ref_metrics['loss']):.6f})")
    print(step.plan)
    # Per tensor: ||a - b|| / max(||b||, floor), the floor being one optimizer
    # step (learning rate) per element, so tensors near zero are judged by the
    # size of an update rather than their own (Adam turns rounding noise of
    # vanishing gradients into update-sized differences).
    lr = float((target.model_config or {}).get("learning_rate", 1e-3))
    worst = 0.0
    for a, b in zip(jax.tree.leaves(par_state), jax.tree.leaves(ref_state)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        floor = lr * np.sqrt(max(b.size, 1))
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor)))
    loss_rel = abs(float(metrics["loss"]) - float(ref_metrics["loss"])) / max(
        abs(float(ref_metrics["loss"])), 1e-12)
    ok = loss_rel <= 1e-5 and worst <= args.tolerance
    print(f"loss relative error {loss_rel:.2e}; largest per-tensor relative error of the "
          f"new state {worst:.2e} (tolerance {args.tolerance:g}): {'OK' if ok else 'MISMATCH'}")
    if not ok:
        raise MeshplanError("the parallel step does not match the unparallelized step")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .tools.calibrate import Options, calibrate
    _check_out(args.out, "--out", "cluster.json")
    result = calibrate(name=args.name, options=Options.quick() if args.quick else Options(),
                       reporter=args.session.progress)
    _write_text(args.out, result.cluster.to_json() + "\n")
    print(result.cluster.describe())
    print(f"cluster written to {args.out}")
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


# the image formats a timeline may be drawn in (matplotlib's common ones)
_IMAGES = frozenset({".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff",
                     ".webp"})


def _check_out(path: str, flag: str, example: str = "out.json") -> None:
    """Refuse an output file that cannot be written, before the work."""
    if path == "-":
        raise MeshplanError(f"{flag} -: this output is not written to stdout; name a file such "
                            f"as {example}")
    if os.path.isdir(path):
        raise MeshplanError(f"{flag} {path} is a directory; give a file name such as "
                            f"{os.path.join(path, example)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise MeshplanError(f"cannot write {path}: folder {folder} does not exist or is not "
                            "writable")


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise MeshplanError(f"cannot write {path}: {e.strerror}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    parse.__name__ = kind.__name__   # argparse names the type in its messages
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


# the planning flags and their defaults (``meshplan run --plan`` takes none of
# them; the parser takes its defaults from here)
_PLANNING_DEFAULTS = {"method": "auto", "mesh": None, "dp": None, "tp": None, "pp": None,
                      "micro_batches": None, "schedule": "auto", "max_stages": None,
                      "memory_fraction": 0.9, "tp_within_host": False, "remat": None,
                      "offload": None, "time_limit": 60.0}


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["auto", "shard", "pipeshard", "data", "manual"],
                   default=_PLANNING_DEFAULTS["method"])
    p.add_argument("--mesh", help="logical mesh for --method shard, e.g. 2x4")
    p.add_argument("--dp", type=_positive(int))
    p.add_argument("--tp", type=_positive(int))
    p.add_argument("--pp", type=_positive(int))
    p.add_argument("--micro-batches", dest="micro_batches", metavar="N[,N...]",
                   help="micro-batches: one count, or (auto, pipeshard) the counts to search")
    p.add_argument("--schedule", default=_PLANNING_DEFAULTS["schedule"], metavar="NAME[,NAME...]",
                   help="auto, gpipe, 1f1b, interleaved or zb-h1; auto and pipeshard take a "
                        "list to search")
    p.add_argument("--max-stages", type=_positive(int), dest="max_stages",
                   help="auto, pipeshard: search at most this many pipeline stages")
    p.add_argument("--memory-fraction", type=_fraction, dest="memory_fraction",
                   default=_PLANNING_DEFAULTS["memory_fraction"],
                   help="share of each device's memory the plan may use (default 0.9)")
    p.add_argument("--tp-within-host", action="store_true", dest="tp_within_host",
                   help="auto, pipeshard: only the first (data) mesh axis may cross hosts, so "
                        "tensor parallelism stays on a host's fast links")
    p.add_argument("--remat", choices=["auto", "none", "selective", "full", "always", "never"],
                   default=None,
                   help="--method manual: recompute activations in every stage (full; alias "
                        "always), only the attention-score region in every stage (selective), "
                        "in none (none; alias never), or where needed to fit (auto, the default: "
                        "per stage none, selective, its first layers or all of them fully); "
                        "--method shard: none, selective or full, none by default, auto the "
                        "fastest of them that fits")
    p.add_argument("--offload", choices=["none", "optimizer", "auto"],
                   help="auto, shard, data, manual: keep the optimizer state in host memory "
                        "between steps (optimizer; one-stage plans), only where the plan does "
                        "not fit without it (auto; the default but for manual), or never (none)")
    p.add_argument("--time-limit", type=_positive(float), dest="time_limit",
                   default=_PLANNING_DEFAULTS["time_limit"],
                   help="seconds per ILP solve (default 60)")


def _verbosity_parent(default: Any) -> argparse.ArgumentParser:
    """--quiet/--verbose, accepted before and after the subcommand."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_const", dest="verbosity", const=progress.QUIET,
                   default=default, help="no progress output")
    g.add_argument("-v", "--verbose", action="store_const", dest="verbosity",
                   const=progress.VERBOSE, default=default,
                   help="report every planning step with its time, also when stderr is not a "
                        "terminal")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="meshplan", description="Automatic parallelization planner for JAX.",
                parents=[_verbosity_parent(progress.NORMAL)])
    flags = [_verbosity_parent(argparse.SUPPRESS)]
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pi = sub.add_parser("inspect", parents=flags, help="trace a model and print a graph summary")
    _add_target_args(pi)
    pi.add_argument("--json", metavar="OUT.json", help="also write the summary as JSON")
    pi.add_argument("--top", type=_positive(int), default=10, help="how many of the biggest ops to list")
    pi.set_defaults(func=cmd_inspect, parser=pi)

    pp = sub.add_parser("plan", parents=flags, help="plan a model for a cluster and print the plan")
    _add_target_args(pp)
    pp.add_argument("--cluster", required=True, help="cluster JSON file, or 'local'")
    _add_method_args(pp)
    pp.add_argument("--json", metavar="OUT.json",
                    help="write the plan JSON ('-': to stdout, the plan's text to stderr)")
    pp.add_argument("--timeline", metavar="OUT.png", help="draw the pipeline schedule")
    pp.add_argument("--emit", choices=["python"],
                    help="python: a standalone snippet (mesh, NamedShardings, jax.jit) of a "
                         "one-stage plan, printed instead of the plan (or see --emit-out)")
    pp.add_argument("--emit-out", metavar="OUT.py", dest="emit_out",
                    help="write the --emit snippet to OUT.py and print the plan as usual")
    pp.add_argument("--explain", action="store_true",
                    help="also plan and list the alternatives (data parallel, ZeRO-3, intra-op "
                         "only, other stage counts, a Megatron-style grid) and what bound the choice")
    pp.set_defaults(func=cmd_plan, parser=pp)

    pr = sub.add_parser("run", parents=flags, help="plan a built-in model, run it on the local devices and "
                                    "compare with the unparallelized step")
    _add_target_args(pr, fn=False)
    _add_method_args(pr)
    pr.add_argument("--plan", help="run this saved plan instead of planning")
    pr.add_argument("--steps", type=_positive(int), default=3)
    pr.add_argument("--tolerance", type=_positive(float), default=1e-3,
                    help="largest accepted per-tensor relative error of the new state")
    pr.set_defaults(func=cmd_run, parser=pr)

    pc = sub.add_parser("cluster", parents=flags, help="validate or show a cluster JSON file")
    csub = pc.add_subparsers(dest="cluster_cmd", required=True, parser_class=_Parser)
    for name, text in (("validate", "check a cluster file"), ("show", "describe a cluster file")):
        c = csub.add_parser(name, help=text)
        c.add_argument("path", help="a cluster JSON file, or local (the devices jax sees)")
        c.set_defaults(func=cmd_cluster, parser=c)

    pk = sub.add_parser("calibrate", parents=flags,
                        help="measure the local devices into a cluster JSON")
    pk.add_argument("--out", required=True, metavar="PATH", help="cluster JSON to write")
    pk.add_argument("--name", help="cluster name (default calibrated-PLATFORM-HOSTSxDEVICES)")
    pk.add_argument("--quick", action="store_true",
                    help="small sizes and few repetitions: seconds, rough figures")
    pk.set_defaults(func=cmd_calibrate, parser=pk)
    return p


def _show_warning(seen: set[str]) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: meshplan's own warnings
    as one line each, each text once however often the passes raise it."""
    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = " ".join(str(message).split())
        if text in seen:
            return
        seen.add(text)
        if text.startswith("meshplan: "):
            text = "meshplan: warning: " + text.removeprefix("meshplan: ")
        else:
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        print(text, file=file or sys.stderr)
    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # (named by the subcommand, whose --help lists what it takes)
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    for name in ("json", "timeline", "emit_out", "out", "plan", "cluster", "fn"):
        if getattr(args, name, None) == "":     # (--json= would write nothing, silently)
            getattr(args, "parser", parser).error(
                f"--{name.replace('_', '-')} needs a file name, got an empty one")
    reporter = progress.Progress(args.verbosity)
    try:
        from .dp_search import Session
        args.session = Session.from_env(reporter)   # configuration read once, here
        with reporter.interruptible(), warnings.catch_warnings():
            warnings.filterwarnings("always", message="meshplan: ")
            warnings.showwarning = _show_warning(set())
            return int(args.func(args) or 0)
    except MeshplanError as e:
        print("meshplan: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`meshplan ... | head`): stop quietly; point
        # stdout at /dev/null so that the interpreter's final flush is quiet too
        # (before Exception, which it is)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        line = step_failure(e)      # (the user's --fn step failing as it is traced)
        if line is None:
            raise
        print("meshplan: error: " + line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
