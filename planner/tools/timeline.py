"""The pipeline schedule of a plan, simulated and drawn.

``simulate(plan)`` lays out every forward and backward block of every
micro-batch on every stage in the order the schedule runs them
(:func:`meshplan.schedule.group_order`, the runtime's order too: GPipe all
forwards, then all backwards; 1F1B warm-up forwards, then one forward / one
backward; interleaved 1F1B per device group over its model chunks; ZB-H1
with its weight-gradient ``W`` blocks) with each block starting when its
devices are free and its input has arrived.
``draw(plan, path)`` saves the picture (device groups x time; an
interleaved plan's second chunk is drawn lighter).
"""
from __future__ import annotations

import textwrap

from ..cost_model.pipeline import host_binds, schedule_programs
from ..plan import Plan
from ..units import human_time
from ..schedule import Block, group_order, schedule_order

__all__ = ["Block", "schedule_order", "simulate", "draw", "breakdown", "FORWARD_SHARE"]

FORWARD_SHARE = 1 / 3   # forward ~ 1/3 of forward+backward time (2 matmuls of 6)


def stage_latency(stage) -> float:
    """One micro-batch's forward and backward on ``stage`` as the search
    costed it (plans from before it was recorded: compute and comm only)."""
    pr = stage.predicted
    return pr.latency_s if pr.latency_s is not None else pr.compute_s + pr.comm_s


def simulate(plan: Plan) -> list[Block]:
    """The plan's blocks (``Block.stage``: the virtual stage) as its schedule runs them."""
    n, m = len(plan.stages), plan.num_micro_batches
    groups = plan.device_groups
    p = len(set(groups))
    # (an evaluation step's stages run their forward alone)
    forward_only = plan.programs[0] == 1
    share = 1.0 if forward_only else FORWARD_SHARE
    t_f = [stage_latency(s) * share for s in plan.stages]
    t_b = [stage_latency(s) * (1 - FORWARD_SHARE) for s in plan.stages]
    t_w = [0.0] * n
    if plan.schedule == "zb-h1":
        # the backward's two halves (input and weight gradients: a matmul
        # each); the first stage's backward stays one program (no W)
        t_w = [0.0] + [t / 2 for t in t_b[1:]]
        t_b = t_b[:1] + [t / 2 for t in t_b[1:]]
    orders = [[o for o in group_order(plan.schedule, g, p, m, plan.chunks)
               if o[0] == "F" or not forward_only] for g in range(p)]
    pos = [0] * p
    free = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    blocks: list[Block] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for g in range(p):
            while pos[g] < len(orders[g]):
                kind, k, i = orders[g][pos[g]]
                if kind == "F":
                    dep = done.get(("F", k - 1, i), None) if k > 0 else 0.0
                elif kind == "W":
                    dep = done.get(("B", k, i))
                else:
                    dep = done.get(("B", k + 1, i), None) if k < n - 1 else done.get(("F", k, i))
                if dep is None:
                    break
                start = max(free[g], dep)
                end = start + {"F": t_f, "B": t_b, "W": t_w}[kind][k]
                done[(kind, k, i)] = end
                free[g] = end
                if kind != "W" or t_w[k]:
                    blocks.append(Block(k, i, kind, start, end))
                pos[g] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlock")  # cannot happen for these orders
    return blocks


def breakdown(plan: Plan, blocks: list[Block]) -> str:
    """How the predicted iteration time splits into the blocks drawn and
    the terms not drawn, in one line."""
    drawn = max((b.end for b in blocks), default=0.0)
    a = plan.cluster.device.achieved
    # (each stage's programs once a step -- a train step's update -- unless
    # the whole step is one program)
    one_program = len(plan.stages) == 1 and plan.num_micro_batches == 1
    update = 0.0 if one_program else plan.programs[1] * sum(
        a.dispatch_s(len(st.devices)) for st in plan.stages)
    rest = plan.predicted.iteration_s - drawn - update
    text = (f"predicted {human_time(plan.predicted.iteration_s)} = blocks drawn "
            f"{human_time(drawn)}" + (f" + update programs {human_time(update)}"
                                      if plan.programs[1] else ""))
    if host_binds(plan.predicted.iteration_s, plan.predicted.host_s):
        programs = schedule_programs(len(plan.stages), plan.num_micro_batches, plan.schedule,
                                     plan.programs)
        buffers = (f" and their array buffers at {human_time(a.pipeline_buffer_s)} each"
                   if a.pipeline_buffer_s else "")
        text += (f" + {human_time(rest)}: the host hands over the step's {programs} stage "
                 f"programs at {human_time(a.pipeline_program_s)} each{buffers}, longer "
                 "than the devices' work")
    elif abs(rest) > 1e-4 * plan.predicted.iteration_s:
        model = ("the shared-compute formula (the devices share one host)"
                 if a.shared_host_compute else "the interleaved formula"
                 if plan.schedule == "interleaved" else "the ZB-H1 walk of the stages' FLOP "
                 "shares" if plan.schedule == "zb-h1" else "the stage search's formula")
        text += (f" {'+' if rest > 0 else '-'} {human_time(abs(rest))} by which {model} "
                 "differs from this simulated schedule")
    return text


def draw(plan: Plan, path: str, executed: list[Block] | None = None) -> list[Block]:
    """Save a picture of the schedule to ``path`` (PNG); returns the blocks.
    ``executed`` (e.g. ``step.last_timeline`` of a pipeline run) is drawn
    below the planned schedule, on its own time axis."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is a test/plot extra
        from ..errors import MeshplanError
        raise MeshplanError("--timeline needs matplotlib: pip install 'meshplan[plot]'") from e
    blocks = simulate(plan)
    groups = plan.device_groups
    p = len(set(groups))
    panels = [(blocks, "time (ms, predicted)")]
    if executed:
        panels.append((list(executed), "time (ms, executed: start of the call = 0)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, (0.6 * p + 1.5) * len(panels)),
                             squeeze=False)
    scale = 1e3
    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#c44e52", "A": "#55a868"}
    names = {"F": "forward", "B": "backward (recomputation included)",
             "W": "weight gradients (zb-h1)", "A": "update"}
    if plan.schedule == "zb-h1":
        names["B"] = "input gradients (the first stage: its whole backward)"
    for ax, (bl, label) in zip(axes[:, 0], panels):
        right = max((x.end for x in bl), default=0.0) * scale
        for b in bl:
            row = groups[b.stage]
            ax.barh(row, (b.end - b.start) * scale, left=b.start * scale, height=0.8,
                    color=colors.get(b.kind, "#8c8c8c"), edgecolor="white", linewidth=0.5,
                    alpha=1.0 if b.stage < p else 0.55)
            if (b.end - b.start) * scale > 0.02 * right:
                text = b.kind if b.micro_batch < 0 else f"{b.kind}{b.micro_batch}"
                ax.text((b.start + b.end) / 2 * scale, row, text,
                        ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"stage {k}\n{s.logical_mesh}" if plan.chunks == 1 else
                            f"devices of stages {', '.join(str(j) for j in range(k, len(groups), p))}"
                            for k, s in enumerate(plan.stages[:p])], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        kinds = sorted({b.kind for b in bl}, key=lambda k: "FBWA".find(k))
        handles = [Patch(color=colors.get(k, "#8c8c8c"), label=names.get(k, k)) for k in kinds]
        if plan.chunks > 1:
            handles.append(Patch(color="#8c8c8c", alpha=0.55, label="later model chunks (lighter)"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    schedule = {"none": "one stage, no pipeline",
                "interleaved": f"interleaved 1F1B ({plan.chunks} chunks per device group)",
                "zb-h1": "zero-bubble ZB-H1 (Qi et al. 2023)"}.get(plan.schedule, plan.schedule)
    axes[0, 0].set_title(f"{plan.function}: {schedule}, {plan.num_micro_batches} micro-batches\n"
                         f"{textwrap.fill(breakdown(plan, blocks), 110)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return blocks
