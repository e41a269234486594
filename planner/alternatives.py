"""The alternatives a plan was chosen over (``meshplan plan --explain``,
``meshplan.plan(..., explain=True)``): plain data kept in the plan, and the
text :meth:`meshplan.Plan.explain` prints from it.

Computed by :mod:`meshplan.explain`; this module only holds and formats them
(a data type: it imports nothing but the standard library).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

HOW_TO = ("no alternatives recorded: plan with explain=True (meshplan.plan(..., explain=True)) "
          "or `meshplan plan ... --explain` to see what the plan was chosen over")


@dataclass(frozen=True)
class Alternative:
    """One plan the chosen plan was compared with.  ``iteration_s`` and
    ``peak_memory_bytes`` are None when unknown (e.g. a plan that does not fit
    on any logical mesh); ``fits``: within the devices' memory budget;
    ``why``: why it was not chosen."""
    method: str                        # short label: data, zero3, intra, pipeline-4, grid
    description: str                   # what it is, e.g. "dp=2 tp=8 pp=1, 16 micro-batches"
    iteration_s: float | None
    peak_memory_bytes: int | None
    fits: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "description": self.description,
                "iteration_s": self.iteration_s,
                "peak_memory_bytes": (None if self.peak_memory_bytes is None
                                      else int(self.peak_memory_bytes)),
                "fits": self.fits, "why": self.why}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Alternative":
        t, m = d.get("iteration_s"), d.get("peak_memory_bytes")
        return cls(str(d["method"]), str(d["description"]), None if t is None else float(t),
                   None if m is None else int(m), bool(d["fits"]), str(d["why"]))

    def __str__(self) -> str:
        return (f"{self.method}: {self.description}; {_time(self.iteration_s)}, "
                f"{_bytes(self.peak_memory_bytes)}/device, "
                f"{'fits' if self.fits else 'does not fit'}: {self.why}")


def describe_plan(p: Any) -> str:
    """A :class:`meshplan.Plan` in one phrase: stages, meshes, micro-batches, schedule."""
    meshes = sorted({str(s.logical_mesh) for s in p.stages})
    text = (f"{len(p.stages)} stage(s), mesh {', '.join(meshes)}, "
            f"{p.num_micro_batches} micro-batch(es)")
    if len(p.stages) > 1:
        text += f", {p.schedule}"
    return text + (", remat" if any(s.remat for s in p.stages) else "")


def comm_share(p: Any) -> float:
    """The share of a :class:`meshplan.Plan`'s stage time spent communicating."""
    work = sum(s.predicted.compute_s + s.predicted.comm_s for s in p.stages)
    return sum(s.predicted.comm_s for s in p.stages) / work if work else 0.0


def explain_text(chosen_label: str, chosen_s: float, chosen_bytes: int, comm_share: float,
                 alternatives: Sequence[Alternative]) -> str:
    """The table of ``alternatives`` and the chosen plan, fastest first, and
    the line naming the binding constraint."""
    if not alternatives:
        return HOW_TO
    rows = [(chosen_s, "*", "chosen", chosen_label, chosen_s, chosen_bytes, "yes", "")]
    for a in alternatives:
        key = math.inf if a.iteration_s is None else a.iteration_s
        rows.append((key, " ", a.method, a.description, a.iteration_s, a.peak_memory_bytes,
                     "yes" if a.fits else "NO", a.why))
    rows.sort(key=lambda r: (r[0], r[1] != "*"))
    w_m = max(len(r[2]) for r in rows)
    w_d = min(max(len(r[3]) for r in rows), 60)
    lines = ["Alternatives considered (predicted; * = chosen), fastest first:",
             f"    {'method':<{w_m}}  {'plan':<{w_d}}  {'time/iter':>10}  {'peak mem':>10}  fits  why"]
    for _, mark, method, desc, t, b, fits, why in rows:
        lines.append(f"  {mark} {method:<{w_m}}  {desc:<{w_d}}  {_time(t):>10}  "
                     f"{_bytes(b):>10}  {fits:<4}  {why}".rstrip())
    lines.append(binding_line(chosen_s, comm_share, alternatives))
    faster = [a for a in alternatives if a.fits and a.iteration_s is not None
              and a.iteration_s < chosen_s * (1 - 1e-9)]
    if faster:
        a = min(faster, key=lambda a: a.iteration_s)  # type: ignore[arg-type,return-value]
        lines.append(f"Note: {a.method} ({a.description}) fits and is predicted "
                     f"{1 - a.iteration_s / chosen_s:.1%} faster than the chosen plan")
    return "\n".join(lines)


def binding_line(chosen_s: float, comm_share: float,
                 alternatives: Sequence[Alternative]) -> str:
    """Memory when a faster alternative does not fit, else the chosen plan's
    balance of communication and compute."""
    faster = [a for a in alternatives if not a.fits and a.iteration_s is not None
              and a.iteration_s < chosen_s]
    if faster:
        a = min(faster, key=lambda a: a.iteration_s)  # type: ignore[arg-type,return-value]
        return (f"Binding constraint: memory ({a.method}, {a.description}, would take "
                f"{_time(a.iteration_s)} but {a.why})")
    kind = "communication" if comm_share >= 0.5 else "compute"
    return (f"Binding constraint: {kind} (no faster alternative is held back by memory; the "
            f"chosen plan spends {comm_share:.0%} of its stage time communicating)")


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
