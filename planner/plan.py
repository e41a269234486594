"""Plan: what the planner decided, as immutable data that round-trips to JSON.

The JSON layout is a contract (see DESIGN.md "Plan JSON"); keys may be added,
never renamed.  A PartitionSpec is written per tensor dimension as ``null``
(not split), a mesh-axis name, or a list of names.

Keys of ``params`` / ``batch``: the pytree path of the leaf as
``jax.tree_util.keystr`` writes it.  When a section draws its leaves from a
single argument (the usual ``step(state, batch)``), paths are inside that
argument (``['params']['w1']``); when several arguments feed one section, the
path starts with the argument's position among them (``[0]['w1']``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .alternatives import Alternative, describe_plan, explain_text
from .cluster import ClusterSpec
from .errors import PlanFormatError

PLAN_FORMAT = "meshplan.plan/1"

# One element per tensor dimension: None, an axis name, or a tuple of axis names.
DimSpec = None | str | tuple[str, ...]
Spec = tuple[DimSpec, ...]


@dataclass(frozen=True)
class LogicalMesh:
    axes: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"mesh axes {self.axes} and shape {self.shape} differ in length")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axes.index(name)]

    def to_dict(self) -> dict[str, Any]:
        return {"axes": list(self.axes), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LogicalMesh":
        return cls(tuple(d["axes"]), tuple(int(s) for s in d["shape"]))

    def __str__(self) -> str:
        return " x ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))


def spec_to_json(spec: Spec) -> list[Any]:
    return [list(d) if isinstance(d, tuple) else d for d in spec]


def spec_from_json(data: Sequence[Any]) -> Spec:
    return tuple(tuple(d) if isinstance(d, list) else d for d in data)


def spec_str(spec: Spec) -> str:
    def one(d: DimSpec) -> str:
        if d is None:
            return "None"
        if isinstance(d, tuple):
            return "(" + ", ".join(repr(x) for x in d) + ")"
        return repr(d)
    return "P(" + ", ".join(one(d) for d in spec) + ")"


def spec_axes(spec: Spec) -> tuple[str, ...]:
    out: list[str] = []
    for d in spec:
        if isinstance(d, tuple):
            out.extend(d)
        elif d is not None:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class Predicted:
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s,
                "memory_bytes": int(self.memory_bytes)}


@dataclass(frozen=True)
class PlanPredicted:
    """Predicted figures of a whole plan.  ``tflops_per_device`` counts model
    FLOPs (the step's own, without recomputation, as MFU does);
    ``hardware_tflops_per_device`` counts what the devices execute, the
    forward passes recomputation repeats included (as HFU does)."""
    iteration_s: float = 0.0
    tflops_per_device: float = 0.0
    peak_memory_bytes: int = 0
    comm_bytes_per_device: int = 0
    hardware_tflops_per_device: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "tflops_per_device": self.tflops_per_device,
                "peak_memory_bytes": int(self.peak_memory_bytes),
                "comm_bytes_per_device": int(self.comm_bytes_per_device),
                "hardware_tflops_per_device": self.hardware_tflops_per_device}


SpecTable = tuple[tuple[str, Spec], ...]


@dataclass(frozen=True)
class Stage:
    layers: tuple[int, int]
    devices: tuple[int, ...]
    submesh: tuple[int, int]
    logical_mesh: LogicalMesh
    remat: bool = False
    params: SpecTable = ()          # non-batch argument leaves -> spec
    predicted: Predicted = Predicted()
    # Extras the runtime uses (more keys are allowed by the format):
    outputs: SpecTable = ()         # output leaf path (keystr of the output) -> spec
    constraints: tuple[tuple[int, Spec], ...] = ()   # graph tensor id -> spec
    strategies: tuple[tuple[int, str], ...] = ()     # graph node id -> chosen strategy name
    # Operands the plan reshards before their reader takes them:
    # (first result tensor id of the reader, operand position, layout read).
    read_constraints: tuple[tuple[int, int, Spec], ...] = ()

    def param_spec(self, path: str) -> Spec | None:
        return dict(self.params).get(path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "devices": list(self.devices),
            "submesh": list(self.submesh),
            "logical_mesh": self.logical_mesh.to_dict(),
            "remat": self.remat,
            "params": {p: spec_to_json(s) for p, s in self.params},
            "predicted": self.predicted.to_dict(),
            "outputs": {p: spec_to_json(s) for p, s in self.outputs},
            "constraints": [[t, spec_to_json(s)] for t, s in self.constraints],
            "strategies": [[n, s] for n, s in self.strategies],
            "read_constraints": [[t, p, spec_to_json(s)] for t, p, s in self.read_constraints],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stage":
        return cls(
            layers=(int(d["layers"][0]), int(d["layers"][1])),
            devices=tuple(int(x) for x in d["devices"]),
            submesh=(int(d["submesh"][0]), int(d["submesh"][1])),
            logical_mesh=LogicalMesh.from_dict(d["logical_mesh"]),
            remat=bool(d.get("remat", False)),
            params=tuple((p, spec_from_json(s)) for p, s in d["params"].items()),
            predicted=Predicted(**d["predicted"]),
            outputs=tuple((p, spec_from_json(s)) for p, s in d.get("outputs", {}).items()),
            constraints=tuple((int(t), spec_from_json(s)) for t, s in d.get("constraints", [])),
            strategies=tuple((int(n), str(s)) for n, s in d.get("strategies", [])),
            read_constraints=tuple((int(t), int(p), spec_from_json(s))
                                   for t, p, s in d.get("read_constraints", [])),
        )


@dataclass(frozen=True)
class Plan:
    graph_fingerprint: str
    cluster: ClusterSpec
    method: str
    stages: tuple[Stage, ...]
    num_micro_batches: int = 1
    schedule: str = "none"
    batch: SpecTable = ()
    predicted: PlanPredicted = PlanPredicted()
    function: str = ""
    batch_argnums: tuple[int, ...] = (1,)
    # How the keys of params/batch map to arguments: argnum -> prefix used ("" when one arg).
    arg_prefixes: tuple[tuple[int, str], ...] = ()
    notes: tuple[str, ...] = ()
    # Pipeline plans: the layer of every operation of the step traced at
    # micro-batch size (the runtime's operation -> stage map; ``Stage.layers``
    # gives each layer's stage).  Empty for one-stage plans and old files.
    layer_of_node: tuple[int, ...] = ()
    # [explain] the plans this one was chosen over (empty unless asked for)
    alternatives: tuple[Alternative, ...] = ()

    def key_prefixes(self, num_args: int) -> dict[int, str]:
        """argnum -> the prefix of its leaves' keys in ``params``/``batch``,
        for a call with ``num_args`` arguments (the recorded ones win)."""
        return (dict(section_prefixes(range(num_args), self.batch_argnums))
                | dict(self.arg_prefixes))

    @property
    def logical_mesh(self) -> LogicalMesh:
        return self.stages[0].logical_mesh

    # ---- JSON -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "graph_fingerprint": self.graph_fingerprint,
            "function": self.function,
            "cluster": self.cluster.to_dict(),
            "method": self.method,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule,
            "batch_argnums": list(self.batch_argnums),
            "arg_prefixes": [[a, p] for a, p in self.arg_prefixes],
            "batch": {p: spec_to_json(s) for p, s in self.batch},
            "stages": [s.to_dict() for s in self.stages],
            "predicted": self.predicted.to_dict(),
            "notes": list(self.notes),
            **({"layer_of_node": _rle(self.layer_of_node)} if self.layer_of_node else {}),
            **({"alternatives": [a.to_dict() for a in self.alternatives]}
               if self.alternatives else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanFormatError("a plan must be a JSON object")
        fmt = d.get("format")
        if fmt != PLAN_FORMAT:
            raise PlanFormatError(
                f"plan format {fmt!r} is not supported by this meshplan (it reads {PLAN_FORMAT!r}); "
                "re-create the plan with this version of meshplan")
        try:
            return cls(
                graph_fingerprint=str(d["graph_fingerprint"]),
                function=str(d.get("function", "")),
                cluster=ClusterSpec.from_dict(d["cluster"]),
                method=str(d["method"]),
                num_micro_batches=int(d["num_micro_batches"]),
                schedule=str(d["schedule"]),
                batch_argnums=tuple(int(x) for x in d.get("batch_argnums", (1,))),
                arg_prefixes=tuple((int(a), str(p)) for a, p in d.get("arg_prefixes", [])),
                batch=tuple((p, spec_from_json(s)) for p, s in d["batch"].items()),
                stages=tuple(Stage.from_dict(s) for s in d["stages"]),
                predicted=PlanPredicted(**d["predicted"]),
                notes=tuple(d.get("notes", ())),
                layer_of_node=_unrle(d.get("layer_of_node", [])),
                alternatives=tuple(Alternative.from_dict(a) for a in d.get("alternatives", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PlanFormatError):
                raise
            raise PlanFormatError(f"malformed plan JSON: {type(e).__name__}: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(data)

    # ---- printing -----------------------------------------------------------
    def explain(self) -> str:
        """The alternatives this plan was chosen over, fastest first, and the
        constraint that bound the choice (or how to get them, when the plan
        was made without ``explain=True``)."""
        work = sum(s.predicted.compute_s + s.predicted.comm_s for s in self.stages)
        share = sum(s.predicted.comm_s for s in self.stages) / work if work else 0.0
        return explain_text(describe_plan(self), self.predicted.iteration_s,
                            self.predicted.peak_memory_bytes, share, self.alternatives)

    def __str__(self) -> str:
        p = self.predicted
        lines = [
            f"Plan for {self.function or 'train step'} on {self.cluster.name} "
            f"({self.cluster.num_devices} devices), method {self.method}",
            f"  predicted: {p.iteration_s * 1e3:.3f} ms/iteration, {p.tflops_per_device:.2f} TFLOP/s "
            f"per device (model FLOPs; {p.hardware_tflops_per_device:.2f} with recomputation), "
            f"peak memory {p.peak_memory_bytes / 2**30:.2f} GiB/device, "
            f"communication {p.comm_bytes_per_device / 2**20:.1f} MiB/device",
            f"  micro-batches {self.num_micro_batches}, schedule {self.schedule}",
        ]
        for k, s in enumerate(self.stages):
            pr = s.predicted
            lines.append(
                f"  stage {k}: layers {s.layers[0]}..{s.layers[1]}, devices {_ranges(s.devices)} "
                f"(submesh {s.submesh[0]}x{s.submesh[1]}), mesh {s.logical_mesh}"
                f"{', remat' if s.remat else ''}; compute {pr.compute_s * 1e3:.3f} ms, "
                f"comm {pr.comm_s * 1e3:.3f} ms, memory {pr.memory_bytes / 2**30:.3f} GiB")
            for path, spec in s.params:
                lines.append(f"    {path:<48} {spec_str(spec)}")
        if self.batch:
            lines.append("  batch:")
            for path, spec in self.batch:
                lines.append(f"    {path:<48} {spec_str(spec)}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _rle(values: Sequence[int]) -> list[list[int]]:
    """``[[value, run length], ...]`` (layers come in long runs)."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def _unrle(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    out: list[int] = []
    for v, n in runs:
        if int(n) < 0:
            raise ValueError(f"negative run length {n} in layer_of_node")
        out.extend([int(v)] * int(n))
    return tuple(out)


def _ranges(ids: Iterable[int]) -> str:
    ids = sorted(ids)
    if not ids:
        return "-"
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def arg_prefixes(argnums: Sequence[int]) -> tuple[tuple[int, str], ...]:
    """How leaves of several arguments are keyed in one section (see module doc)."""
    argnums = sorted(argnums)
    if len(argnums) <= 1:
        return tuple((a, "") for a in argnums)
    return tuple((a, f"[{k}]") for k, a in enumerate(argnums))


def section_prefixes(argnums: Iterable[int], batch_argnums: Sequence[int]
                     ) -> tuple[tuple[int, str], ...]:
    """The key prefix of each argument: non-batch arguments are numbered among
    themselves (the stages' ``params``), batch arguments among themselves
    (``batch``).  The one rule every reader and writer of plan tables uses."""
    argnums = set(argnums)
    return (arg_prefixes([a for a in argnums if a not in batch_argnums])
            + arg_prefixes([a for a in argnums if a in batch_argnums]))
