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
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .alternatives import Alternative, comm_share, describe_plan, explain_text
from .cluster import ClusterSpec
from .errors import PlanFormatError
from .methods import SCHEDULES
from .recompute import FULL, RECOMPUTE, SELECTIVE, recompute_name

# what a stage may keep in host memory between steps (meshplan.offload)
OFFLOAD_KINDS = ("none", "optimizer")
# (the spec vocabulary lives in .specs, which the jax binding reads too; re-exported)
from .specs import DimSpec, Spec, spec_axes, spec_from_json, spec_str, spec_to_json  # noqa: F401
from .units import human_bytes, human_rate, human_time

PLAN_FORMAT = "meshplan.plan/1"


@dataclass(frozen=True)
class LogicalMesh:
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    # TPU: the torus dimensions in the order the devices run over them, fastest
    # first (meshplan.cost_model.torus); () is the chips' numbering order
    torus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"mesh axes {self.axes} and shape {self.shape} differ in length")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axes.index(name)]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"axes": list(self.axes), "shape": list(self.shape)}
        if self.torus:
            d["torus"] = list(self.torus)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LogicalMesh":
        mesh = cls(tuple(str(a) for a in d["axes"]), tuple(int(s) for s in d["shape"]),
                   tuple(int(t) for t in d.get("torus", ())))
        if any(s < 1 for s in mesh.shape):
            raise PlanFormatError(f"malformed plan JSON: logical mesh shape {list(mesh.shape)}: "
                                  "every axis needs a size of 1 or more")
        if len(set(mesh.axes)) != len(mesh.axes):
            raise PlanFormatError(f"malformed plan JSON: logical mesh axes {list(mesh.axes)} "
                                  "repeat a name; name each axis once")
        return mesh

    def __str__(self) -> str:
        text = " x ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        return text + (f" (torus dims {'/'.join('xyzw'[t] for t in self.torus)})"
                       if self.torus else "")


@dataclass(frozen=True)
class MemoryBreakdown:
    """What a stage's memory per device holds; the parts add up to its
    ``memory_bytes``.  ``params`` counts other carried state (batch-norm
    statistics) too; ``activations``: the forward values kept for the
    backward of every micro-batch in flight (and the batch); ``temporaries``:
    the rest of the working set at the peak."""
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    # state kept in host memory between steps (offloaded): not part of the total
    offloaded: int = 0

    @classmethod
    def of(cls, total: float, *, params: float, grads: float, optimizer: float,
           activations: float) -> "MemoryBreakdown":
        """The breakdown of ``total`` bytes with these parts, the rest as
        temporaries.  (Each part rounded down, so the rest is at least the
        exact rest rounded down.)"""
        p, g, o, a = int(params), int(grads), int(optimizer), int(activations)
        return cls(p, g, o, a, int(total) - p - g - o - a)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries

    def parts(self) -> tuple[tuple[str, int], ...]:
        return (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                ("activations", self.activations), ("temporaries", self.temporaries))

    def to_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.parts()} | (
            {"offloaded": int(self.offloaded)} if self.offloaded else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MemoryBreakdown":
        return cls(**{k: int(d.get(k, 0)) for k, _ in cls().parts()},
                   offloaded=int(d.get("offloaded", 0)))

    def __str__(self) -> str:
        host = f" (+ {human_bytes(self.offloaded)} in host memory)" if self.offloaded else ""
        return (f"{human_bytes(self.total)} = "
                + " + ".join(f"{k} {human_bytes(v)}" for k, v in self.parts()) + host)


@dataclass(frozen=True)
class Predicted:
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0
    memory: MemoryBreakdown | None = None    # (absent from older plan files)
    # pipeline stages: one micro-batch's forward and backward as the stage
    # search costed it (compute and comm, recomputation, sends, program
    # dispatch, gradient accumulation); what the timeline draws
    latency_s: float | None = None
    # pipeline stages: the collectives' result bytes per device of one
    # iteration of the stage (all micro-batches), as comm_bytes_per_device counts them
    comm_bytes: int | None = None
    # offloaded state: its moves between host and device memory per iteration
    host_transfer_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s,
                "memory_bytes": int(self.memory_bytes),
                **({"memory": self.memory.to_dict()} if self.memory is not None else {}),
                **({"latency_s": self.latency_s} if self.latency_s is not None else {}),
                **({"comm_bytes": int(self.comm_bytes)} if self.comm_bytes is not None else {}),
                **({"host_transfer_s": self.host_transfer_s}
                   if self.host_transfer_s is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Predicted":
        mem = d.get("memory")
        return cls(**{k: v for k, v in d.items() if k != "memory"},
                   memory=None if mem is None else MemoryBreakdown.from_dict(mem))


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
    # a pipelined step: the host's time to hand its stage programs over, the
    # least iteration_s can be (cost_model.pipeline.pipeline_host_s); 0 for
    # one program (written only when non-zero)
    host_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "tflops_per_device": self.tflops_per_device,
                "peak_memory_bytes": int(self.peak_memory_bytes),
                "comm_bytes_per_device": int(self.comm_bytes_per_device),
                "hardware_tflops_per_device": self.hardware_tflops_per_device,
                **({"host_s": self.host_s} if self.host_s else {})}


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
    # none, selective or full (meshplan.recompute).  remat stays True for
    # selective and full, so that old readers keep working; where the two
    # disagree (a file or a replace() that set remat alone) remat wins
    recompute: str = ""
    # with recompute "full": only the stage's first ``recompute_layers``
    # layers recompute, the later ones keep their activations (Mist's
    # per-stage count); 0: all of them
    recompute_layers: int = 0
    # with several micro-batches, the narrowed copies of its parameters (a
    # float32 weight's bfloat16 copy) are made once a step and kept; False:
    # every micro-batch casts them again (less memory, more time)
    keep_casts: bool = True
    # "optimizer": the leaves named by host_params (inputs) and host_outputs
    # (their new values) live in host memory between steps (meshplan.offload)
    offload: str = "none"
    host_params: tuple[str, ...] = ()
    host_outputs: tuple[str, ...] = ()
    # interleaved plans: the device group (physical stage) this virtual stage
    # runs on, stages of one group sharing its devices; -1: its own devices
    device_group: int = -1
    # with several micro-batches: the mesh axes over which the gradient sums
    # wait unreduced for the step's last micro-batch, reduced once a step
    # (the runtime keeps partial sums over them); () each micro-batch's
    # gradients are reduced; None: not recorded (the runtime decides)
    deferred_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_KINDS:
            raise PlanFormatError(f"stage offload {self.offload!r}: use one of "
                                  f"{', '.join(OFFLOAD_KINDS)}")
        r = self.recompute
        if r and r not in RECOMPUTE:
            raise PlanFormatError(f"stage recompute {r!r}: use one of {', '.join(RECOMPUTE)}")
        if not r or (r != "none") != bool(self.remat):
            r = recompute_name(bool(self.remat))
        object.__setattr__(self, "recompute", r)
        object.__setattr__(self, "remat", bool(self.remat))
        n, size = self.recompute_layers, self.layers[1] - self.layers[0] + 1
        if n and (r != FULL or not 0 < n < size):
            raise PlanFormatError(
                f"stage recompute_layers {n}: give a count below the stage's {size} layers, "
                "with recompute \"full\" (0: all of them)")

    def param_spec(self, path: str) -> Spec | None:
        return dict(self.params).get(path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "devices": list(self.devices),
            "submesh": list(self.submesh),
            "logical_mesh": self.logical_mesh.to_dict(),
            "remat": self.remat,
            "recompute": self.recompute,
            **({"recompute_layers": self.recompute_layers} if self.recompute_layers else {}),
            **({} if self.keep_casts else {"keep_casts": False}),
            "params": {p: spec_to_json(s) for p, s in self.params},
            "predicted": self.predicted.to_dict(),
            "outputs": {p: spec_to_json(s) for p, s in self.outputs},
            "constraints": [[t, spec_to_json(s)] for t, s in self.constraints],
            "strategies": [[n, s] for n, s in self.strategies],
            "read_constraints": [[t, p, spec_to_json(s)] for t, p, s in self.read_constraints],
            **({"offload": self.offload,
                "host_memory": {"params": list(self.host_params),
                                "outputs": list(self.host_outputs)}}
               if self.offload != "none" else {}),
            **({"device_group": self.device_group} if self.device_group >= 0 else {}),
            **({"deferred_axes": list(self.deferred_axes)}
               if self.deferred_axes is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stage":
        return cls(
            layers=(int(d["layers"][0]), int(d["layers"][1])),
            devices=tuple(int(x) for x in d["devices"]),
            submesh=(int(d["submesh"][0]), int(d["submesh"][1])),
            logical_mesh=LogicalMesh.from_dict(d["logical_mesh"]),
            remat=_flag(d.get("remat", False), "remat"),
            recompute=str(d.get("recompute", "")),
            recompute_layers=int(d.get("recompute_layers", 0)),
            keep_casts=_flag(d.get("keep_casts", True), "keep_casts"),
            params=_specs(d["params"], "params"),
            predicted=Predicted.from_dict(d["predicted"]),
            outputs=_specs(d.get("outputs", {}), "outputs"),
            constraints=tuple((int(t), spec_from_json(s)) for t, s in d.get("constraints", [])),
            strategies=tuple((int(n), str(s)) for n, s in d.get("strategies", [])),
            read_constraints=tuple((int(t), int(p), spec_from_json(s))
                                   for t, p, s in d.get("read_constraints", [])),
            offload=str(d.get("offload", "none")),
            host_params=tuple(str(k) for k in d.get("host_memory", {}).get("params", ())),
            host_outputs=tuple(str(k) for k in d.get("host_memory", {}).get("outputs", ())),
            device_group=int(d.get("device_group", -1)),
            deferred_axes=(None if d.get("deferred_axes") is None
                           else tuple(str(a) for a in d["deferred_axes"])),
        )


def _malformed(e: Exception, where: str) -> PlanFormatError:
    """A hand edit's damage in words: a key missing, or a value of another type."""
    if isinstance(e, KeyError):
        what = f"the key {e.args[0]!r} is missing"
    elif isinstance(e, (TypeError, AttributeError)):
        what = f"a value has the wrong type ({e})"
    else:
        what = str(e)
    return PlanFormatError(f"malformed plan JSON{where}: {what}; restore it as meshplan wrote "
                           "it, or re-plan")


def _stage(k: int, d: Any) -> "Stage":
    """Stage ``k`` of a plan JSON, its damage located."""
    try:
        return Stage.from_dict(d)
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _malformed(e, f" in stages[{k}]") from e


def _specs(table: Mapping[str, Any], section: str) -> SpecTable:
    """A JSON spec table, a bad entry named by its key."""
    out = []
    for key, spec in table.items():
        try:
            out.append((str(key), spec_from_json(spec)))
        except ValueError as e:
            raise PlanFormatError(f"malformed plan JSON: {section} {key}: {e}") from None
    return tuple(out)


def _flag(v: Any, name: str) -> bool:
    """A JSON true or false (not "yes", which bool() would take)."""
    if not isinstance(v, bool):
        raise PlanFormatError(f"malformed plan JSON: {name} must be true or false, got {v!r}")
    return v


def _whole(v: Any, name: str) -> int:
    """A JSON integer (not 2.5, "2" or true, which int() would take)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanFormatError(f"malformed plan JSON: {name} must be an integer, got {v!r}")
    return v


# the schedules a plan names: one stage's "none", and those a method may ask for
PLAN_SCHEDULES = ("none",) + tuple(s for s in SCHEDULES if s != "auto")


def _check_structure(plan: "Plan") -> None:
    """Refuse a plan (a hand edit) whose stages, devices or micro-batch
    count no runtime can follow."""
    bad = "malformed plan JSON: "
    if not plan.stages:
        raise PlanFormatError(bad + "the plan has no stages; re-plan")
    if plan.num_micro_batches < 1:
        raise PlanFormatError(bad + f"num_micro_batches is {plan.num_micro_batches}; give 1 or "
                              "more")
    if len(plan.stages) == 1 and plan.num_micro_batches > 1 and not plan.layer_of_node:
        # (a one-program plan: its tensor ids name the whole batch's graph)
        raise PlanFormatError(bad + f"num_micro_batches is {plan.num_micro_batches}, but this "
                              "one-stage plan was made for one program of the whole batch; "
                              "set it to 1, or re-plan with num_micro_batches="
                              f"{plan.num_micro_batches}")
    if plan.schedule not in PLAN_SCHEDULES:
        raise PlanFormatError(bad + f"schedule {plan.schedule!r} is none of "
                              f"{', '.join(PLAN_SCHEDULES)}")
    held: dict[int, int] = {}
    for k, st in enumerate(plan.stages):
        first, last = st.layers
        if first > last:
            raise PlanFormatError(bad + f"stage {k} has layers {first}..{last}; give the first "
                                  "layer, then the last")
        for l in range(first, last + 1):
            if l in held:
                raise PlanFormatError(bad + f"layer {l} is in stages {held[l]} and {k}; give "
                                      "each layer to one stage")
            held[l] = k
        twice = sorted(x for x, n in Counter(st.devices).items() if n > 1)
        if twice:
            raise PlanFormatError(bad + f"stage {k} lists device {twice[0]} twice; each device "
                                  "once")
        if len(st.devices) != st.logical_mesh.size:
            raise PlanFormatError(bad + f"stage {k} has {len(st.devices)} devices for its mesh "
                                  f"{st.logical_mesh} of {st.logical_mesh.size}; give as many")
        if st.submesh[0] * st.submesh[1] != len(st.devices):
            raise PlanFormatError(bad + f"stage {k} has submesh {st.submesh[0]}x{st.submesh[1]} "
                                  f"for its {len(st.devices)} devices; give hosts x devices per "
                                  "host of them")


def _remat_note(s: Stage) -> str:
    off = f", {s.offload} state offloaded to host" if s.offload != "none" else ""
    if not s.keep_casts:
        off += ", weights cast per micro-batch"
    if not s.remat:
        return off
    if s.recompute_layers:
        return f", remat (first {s.recompute_layers} layers)" + off
    return (", remat (selective)" if s.recompute == SELECTIVE else ", remat") + off


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
    # an ILP behind this plan, or behind a plan it was chosen over, stopped
    # at its time limit (its best incumbent was used): why two runs may
    # differ; in the JSON only when true
    ilp_time_limit_hit: bool = False
    # the data-parallel gradient sums are reduced every micro-batch (ZeRO-2's
    # way: less memory) rather than once a step; in the JSON only when true
    reduce_grads_each_micro_batch: bool = False
    # the programs each stage runs per micro-batch and per step: a train
    # step's forward and backward, then its update (2, 1); an evaluation
    # step's forward alone (1, 0) (graph.stage_program_counts); in the JSON
    # only where not (2, 1)
    programs: tuple[int, int] = (2, 1)
    # every argument leaf the plan was made for, by its position and path
    # ("argument 1['x']"), and its dtype and shape as traced ("float32[16,4]"):
    # what a call with other arguments is told differs; in the JSON only where
    # recorded (older files hold none)
    arguments: tuple[tuple[str, str], ...] = ()

    def key_prefixes(self, num_args: int) -> dict[int, str]:
        """argnum -> the prefix of its leaves' keys in ``params``/``batch``,
        for a call with ``num_args`` arguments (the recorded ones win)."""
        return (dict(section_prefixes(range(num_args), self.batch_argnums))
                | dict(self.arg_prefixes))

    def shardings(self, *args: Any, step: Any = None, devices: Any = None) -> Any:
        """``(mesh, in_shardings, out_shardings)`` for a plain
        ``jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings)``.

        ``args`` are the step's arguments as it takes them (arrays or
        ``jax.ShapeDtypeStruct``s); ``in_shardings`` is a tuple with one
        pytree of ``NamedSharding`` per argument, shaped like it (leaves the
        plan does not name are replicated).  The plan does not know the
        output's pytree structure: pass ``step`` (it is only
        ``jax.eval_shape``-d) to get ``out_shardings`` shaped like the step's
        output, ``None`` at leaves the plan leaves to jit; without ``step``
        ``out_shardings`` is ``None`` (jit chooses every output's layout).
        ``devices``: the pool the plan's device ids index (default
        ``jax.devices()`` sorted by id).

        A pipeline plan gives a tuple with one such triple per stage, each on
        its stage's devices: the stage's parameters and state on its mesh,
        ``None`` for leaves other stages hold, batch leaves laid out as one
        micro-batch is on that stage (the plan's batch spec when it divides
        the micro-batch there, else replicated), outputs left to jit.  These
        describe where the pipeline keeps its values; a pipeline cannot run
        as one plain ``jax.jit`` (use :func:`meshplan.parallelize` for that).

        Arguments the plan was not made for (too few, leaves it names
        missing, shapes its specs do not divide) raise
        :class:`meshplan.errors.StalePlanError`.
        """
        from .shardings import plan_shardings     # (jax binding, see that module)
        return plan_shardings(self, args, step=step, devices=devices)

    @property
    def logical_mesh(self) -> LogicalMesh:
        return self.stages[0].logical_mesh

    @property
    def device_groups(self) -> tuple[int, ...]:
        """The device group of every stage: ``Stage.device_group`` where set
        (interleaved plans: virtual stage k on group k mod p), else its index."""
        return tuple(s.device_group if s.device_group >= 0 else k
                     for k, s in enumerate(self.stages))

    @property
    def chunks(self) -> int:
        """Model chunks per device group (1 but for interleaved plans)."""
        groups = len(set(self.device_groups))
        return len(self.stages) // groups if groups else 1

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
            **({"ilp_time_limit_hit": True} if self.ilp_time_limit_hit else {}),
            **({"reduce_grads_each_micro_batch": True} if self.reduce_grads_each_micro_batch
               else {}),
            **({"programs": list(self.programs)} if self.programs != (2, 1) else {}),
            **({"arguments": dict(self.arguments)} if self.arguments else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanFormatError("a plan must be a JSON object")
        fmt = d.get("format")
        if isinstance(fmt, str) and fmt.startswith("meshplan.cluster/"):
            raise PlanFormatError("this is a cluster file, not a plan: give the JSON that "
                                  "meshplan plan --json (or Plan.to_json) wrote")
        if fmt != PLAN_FORMAT:
            raise PlanFormatError(
                f"plan format {fmt!r} is not supported by this meshplan (it reads {PLAN_FORMAT!r}); "
                "re-create the plan with this version of meshplan")
        try:
            plan = cls(
                graph_fingerprint=str(d["graph_fingerprint"]),
                function=str(d.get("function", "")),
                cluster=ClusterSpec.from_dict(d["cluster"]),
                method=str(d["method"]),
                num_micro_batches=_whole(d["num_micro_batches"], "num_micro_batches"),
                schedule=str(d["schedule"]),
                batch_argnums=tuple(int(x) for x in d.get("batch_argnums", (1,))),
                arg_prefixes=tuple((int(a), str(p)) for a, p in d.get("arg_prefixes", [])),
                batch=_specs(d["batch"], "batch"),
                stages=tuple(_stage(k, s) for k, s in enumerate(d["stages"])),
                predicted=PlanPredicted(**d["predicted"]),
                notes=tuple(d.get("notes", ())),
                layer_of_node=_unrle(d.get("layer_of_node", [])),
                alternatives=tuple(Alternative.from_dict(a) for a in d.get("alternatives", [])),
                ilp_time_limit_hit=bool(d.get("ilp_time_limit_hit", False)),
                reduce_grads_each_micro_batch=bool(d.get("reduce_grads_each_micro_batch", False)),
                programs=_programs(d.get("programs", (2, 1))),
                arguments=tuple((str(k), str(v)) for k, v in d.get("arguments", {}).items()),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, PlanFormatError):
                raise
            raise _malformed(e, "") from e
        _check_structure(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanFormatError(f"Plan.from_json takes the plan's JSON text, not "
                                  f"{type(text).__name__}")
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
        return explain_text(describe_plan(self), self.predicted.iteration_s,
                            self.predicted.peak_memory_bytes, comm_share(self),
                            self.alternatives)

    def __str__(self) -> str:
        p = self.predicted
        lines = [
            f"Plan for {self.function or 'train step'} on {self.cluster.name} "
            f"({self.cluster.num_devices} devices), method {self.method}",
            f"  predicted: {human_time(p.iteration_s)}/iteration, "
            f"{human_rate(p.tflops_per_device * 1e12)} per device (model FLOPs; "
            f"{human_rate(p.hardware_tflops_per_device * 1e12)} with recomputation), "
            f"peak memory {human_bytes(p.peak_memory_bytes)}/device, "
            f"communication {human_bytes(p.comm_bytes_per_device)}/device",
            f"  micro-batches {self.num_micro_batches}, schedule {self.schedule}",
        ]
        for k, s in enumerate(self.stages):
            pr = s.predicted
            lines.append(
                f"  stage {k}: layers {s.layers[0]}..{s.layers[1]}, devices {_ranges(s.devices)} "
                f"(submesh {s.submesh[0]}x{s.submesh[1]}"
                f"{f', device group {s.device_group}' if s.device_group >= 0 else ''}), "
                f"mesh {s.logical_mesh}"
                f"{_remat_note(s)}; compute {human_time(pr.compute_s)}, "
                f"comm {human_time(pr.comm_s)}, memory "
                f"{pr.memory or human_bytes(pr.memory_bytes)}")
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


def _programs(v: Any) -> tuple[int, int]:
    ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v)
    if not ok or v[0] < 1 or v[1] < 0:
        raise ValueError(f"programs {v!r}: give [per micro-batch, per step], ints, at least one "
                         "program per micro-batch and none or more per step")
    return int(v[0]), int(v[1])


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


def argument_differences(planned: Sequence[tuple[str, str]],
                         called: Sequence[tuple[str, str]], most: int = 3) -> list[str]:
    """What differs between the argument leaves a plan was made for and a
    call's (``Plan.arguments`` of each), each in a few words: up to
    ``most`` leaves of another shape or dtype, then the leaves one side
    lacks, counted."""
    want, got = dict(planned), dict(called)
    changed = [f"{k} is {got[k]} where the plan has {v}" for k, v in want.items()
               if k in got and got[k] != v]
    out = changed[:most] + ([f"{len(changed) - most} more leaves differ"]
                            if len(changed) > most else [])
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing:
        out.append(f"{len(missing)} of the plan's {len(want)} leaves are missing (e.g. "
                   f"{missing[0]})")
    if extra:
        out.append(f"{len(extra)} leaves are not in the plan (e.g. {extra[0]})")
    return out


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
