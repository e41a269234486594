"""A pipeline plan's programs as ``jax.stages`` objects, and its memory per stage.

:func:`lower_pipeline` lowers every stage program of a
:class:`~meshplan.runtime.pipeline.PipelineExecutable` exactly as the driver
calls it: each input with the sharding it has when the program runs (an
argument on its planned layout, a running sum on its layout, a value of
another stage where the transfer puts it).  Where a value lands depends on
the layout its producer's compiled program gave it, so the programs are
lowered *and compiled* in dispatch order (one micro-batch's forwards and
backwards, then the updates); nothing runs and the arguments may be
``jax.ShapeDtypeStruct`` s.

:func:`stage_memory` reads, per stage, what one call keeps alive on a
device -- the stage's state (with the parameter copies its R task casts),
its running sums, the activations in flight (what its backward reads from
the forward, times the micro-batches the schedule keeps) -- plus the
largest arena of intermediates of its programs
(``memory_analysis().temp_size_in_bytes``; their outputs are the
activations and sums already counted, or values sent on) -- or, where it is
more, what its update programs make beside the state they do not take over
(outputs not aliased to a donated input: the caller keeps the old state).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import jax
from jax.sharding import NamedSharding

from meshplan.errors import MeshplanError
from meshplan.graph import packed_bytes
from meshplan.schedule import peak_kept

from .pipeline_split import CONCAT

if TYPE_CHECKING:
    from .pipeline import PipelineExecutable

__all__ = ("PipelineLowered", "PipelineCompiled", "lower_pipeline", "StageMemory",
           "stage_memory", "program_memory",)


@dataclasses.dataclass(frozen=True)
class PipelineCompiled:
    """The compiled stage programs: ``compiled[key]`` is the
    ``jax.stages.Compiled`` of task ``key`` (``("F", s)``, ``("B", s)``,
    ``("A", s, level)``) and, with several micro-batches, of the means of
    stage ``s``'s running sums (``("M", s)``)."""
    compiled: Mapping[tuple, Any]
    num_stages: int
    num_micro_batches: int
    # per program, its inputs as lowered (ShapeDtypeStructs with shardings)
    inputs: Mapping[tuple, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: tuple) -> Any:
        return self.compiled[key]

    def items(self) -> Iterator[tuple[tuple, Any]]:
        return iter(self.compiled.items())

    def stage(self, s: int) -> dict[tuple, Any]:
        """The programs of stage ``s``."""
        return {k: c for k, c in self.compiled.items() if k[1] == s}

    def runs(self, key: tuple) -> int:
        """How often one call runs program ``key`` (forwards and backwards
        once per micro-batch; draws, casts and statistics ahead, means and updates once)."""
        return 1 if key[0] in ("A", "M", "R") else self.num_micro_batches

    def as_text(self) -> str:
        return "\n\n".join(f"// {_name(k)}\n{c.as_text()}" for k, c in self.compiled.items())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise MeshplanError(
            "a pipeline's compiled programs run one per stage and micro-batch, driven by the "
            "parallelized step: call the step itself; compiled[key], .stage(s) and .items() "
            "give each program's jax.stages.Compiled (memory_analysis(), cost_analysis())")

    def __getattr__(self, name: str) -> Any:
        raise _per_program(self, name, jax.stages.Compiled)


@dataclasses.dataclass(frozen=True)
class PipelineLowered:
    """What ``step.lower(*args)`` gives for a pipeline plan: the
    ``jax.stages.Lowered`` of every stage program (``lowered[key]``);
    :meth:`compile` gives their ``Compiled`` s."""
    lowered: Mapping[tuple, Any]
    _compiled: PipelineCompiled

    def __getitem__(self, key: tuple) -> Any:
        return self.lowered[key]

    def items(self) -> Iterator[tuple[tuple, Any]]:
        return iter(self.lowered.items())

    def stage(self, s: int) -> dict[tuple, Any]:
        return {k: v for k, v in self.lowered.items() if k[1] == s}

    def compile(self) -> PipelineCompiled:
        # (compiled while lowering: a program's input layouts follow the
        # compiled outputs of the programs before it)
        return self._compiled

    def as_text(self) -> str:
        return "\n\n".join(f"// {_name(k)}\n{v.as_text()}" for k, v in self.lowered.items())

    def __getattr__(self, name: str) -> Any:
        raise _per_program(self, name, jax.stages.Lowered)


# what jax.stages tells of one program: each stage program has its own
_PER_PROGRAM = frozenset({"memory_analysis", "cost_analysis", "compiler_ir", "input_shardings",
                          "output_shardings", "input_formats", "output_formats",
                          "runtime_executable"})


def _per_program(obj: Any, name: str, single: type) -> AttributeError:
    """The error for an attribute of one jax program asked of a pipeline's
    set of them (``memory_analysis`` of the whole): it says where each is."""
    what = type(obj).__name__
    if name not in _PER_PROGRAM or not hasattr(single, name):
        # (in_tree, args_info...: the whole step's arguments, which no one
        # program takes)
        return AttributeError(f"'{what}' object has no attribute '{name}'")
    return AttributeError(
        f"'{what}' holds one jax.stages.{single.__name__} per stage program, not one for the "
        f"whole step: ask each program, as [key].{name} for every key of .items() (or of "
        ".stage(s), one stage's)")


def _name(key: tuple) -> str:
    return f"stage {key[1]} {key[0]}" + (f"{key[2]}" if key[0] == "A" else "")


def lower_pipeline(ex: "PipelineExecutable", args: tuple[Any, ...]) -> PipelineLowered:
    """Every program of ``ex`` lowered and compiled for ``args`` (arrays or
    ``jax.ShapeDtypeStruct`` s of the full batch)."""
    if ex.transfers.xp is not None:
        raise MeshplanError("lower() of a pipeline runs in one process; lower the stages of a "
                            "multi-process run from a one-process run of the same plan")
    split, flat, lay, m = ex.split, ex.flat, ex.layouts, ex.m
    leaf_ids = set(flat.invars)
    where: dict[int, NamedSharding] = {}         # value id -> sharding on its producer
    stage_of: dict[int, int] = {}
    lowered: dict[tuple, Any] = {}
    compiled: dict[tuple, Any] = {}
    inputs: dict[tuple, tuple[Any, ...]] = {}

    def spec(x: int, s: int, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
        aval = flat.avals[x]
        shape = tuple(aval.shape) if shape is None else shape
        if x in leaf_ids:
            return jax.ShapeDtypeStruct(shape, aval.dtype, sharding=lay.arg(x, s))
        sh = where.get(x)
        if sh is None:
            raise MeshplanError(f"internal: value t{x} of stage {s} has no producer to lower")
        if stage_of[x] != s:
            v = jax.ShapeDtypeStruct(shape, aval.dtype, sharding=sh)
            sh = lay.send(v, x, s)
        return jax.ShapeDtypeStruct(shape, aval.dtype, sharding=sh)

    def one(key: tuple, ins: list[Any]) -> None:
        prog = ex.programs[key]
        task = prog.task
        accs = [ex.sums.struct(x, task.stage) for x in task.accumulate] if m > 1 else []
        lo = prog.fn.lower(*ins, *accs)
        co = lo.compile()
        lowered[key], compiled[key], inputs[key] = lo, co, tuple(ins)
        plain, new = co.output_shardings
        for x, sh in zip(task.outputs, plain):
            where[x], stage_of[x] = sh, task.stage
        for x, sh in zip(task.accumulate, new):
            where[x], stage_of[x] = sh, task.stage

    # the R tasks run once, ahead of the micro-batches (their draws at the
    # full batch: the rows each micro-batch reads keep the draw's layout)
    for key, t in split.tasks.items():
        if key[0] == "R":       # (a batch statistic reads the whole batch)
            one(key, [spec(x, key[1], (m * flat.avals[x].shape[0], *flat.avals[x].shape[1:])
                           if x in lay.is_batch else None) for x in t.inputs])
    for kind, s, i in ex.wiring.order:
        if i == 0:
            one((kind, s), [spec(x, s) for x in ex.programs[(kind, s)].task.inputs])
    # the means of the running sums (with partial sums: the step's one
    # gradient reduction), what the updates read
    for s in (range(ex.p) if m > 1 else ()):
        ids = ex.sums.zeros(s)[0]
        if ids:
            lo = ex.sums.mean(s, len(ids)).lower(*[ex.sums.struct(x, s) for x in ids])
            co = lo.compile()
            key = ("M", s)
            lowered[key], compiled[key] = lo, co
            inputs[key] = tuple(ex.sums.struct(x, s) for x in ids)
            for x, sh in zip(ids, co.output_shardings):
                where[x], stage_of[x] = sh, s
    for key in ex.wiring.update_order:
        s = key[1]
        ins = []
        for x in ex.programs[key].task.inputs:
            src = x if x in leaf_ids or x in split.producer else split.alias.get(x, x)
            shape = None
            if split.crossing.get(src) == CONCAT and src not in leaf_ids:
                shape = (flat.avals[src].shape[0] * m,) + tuple(flat.avals[src].shape[1:])
            ins.append(spec(src, s, shape))
        one(key, ins)
    return PipelineLowered(lowered, PipelineCompiled(compiled, ex.p, m, inputs))


# ---------------------------------------------------------------------------
# memory per stage
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one stage during a call (see the module doc)."""
    stage: int
    state: int              # the stage's parameters, optimizer and other state
    running_sums: int       # the gradients summed over micro-batches
    activations: int        # kept from forward to backward, times the micro-batches in flight
    in_flight: int          # micro-batches whose activations are kept at once
    programs: int           # the largest temp (XLA's arena of intermediates) of its programs
    # the update programs' outputs in buffers of their own (not donated
    # state): held from the update, when the activations are gone, to the end
    updated: int = 0

    @property
    def total(self) -> int:
        return self.state + self.running_sums + max(self.activations + self.programs,
                                                    self.updated)

    def to_dict(self) -> dict[str, int]:
        return {**{f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)},
                "total": self.total}


def program_memory(compiled: Any) -> dict[str, int]:
    """``memory_analysis()`` of one compiled program, per device."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    return {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp")}


def _device_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else shape
    # (a typed PRNG key's dtype, "key<fry>", is no numpy dtype; graph sizes it)
    name = str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) \
        else str(jax.numpy.dtype(dtype))
    return packed_bytes(math.prod(shard), name)


def _kept_through_order(ex: "PipelineExecutable", compiled: PipelineCompiled,
                        s: int) -> tuple[int, int]:
    """(the most the micro-batches' kept values add up to on stage ``s`` in
    the driver's order, the most micro-batches in flight there).  Kept: what
    this stage's forward makes (or, remat, what it received and keeps) for
    its ``B`` or ``W``, and what ``B`` makes for ``W``."""
    split, leaf_ids = ex.split, set(ex.flat.invars)
    sizes: dict[str, dict[int, int]] = {"B": {}, "W": {}}
    made_by_b: set[int] = set()
    if split.tasks.get(("F", s)) is not None:
        for kind in ("B", "W"):
            b = split.tasks.get((kind, s))
            if b is None:
                continue
            for x, v in zip(b.inputs, compiled.inputs[(kind, s)]):
                made = split.producer.get(x)
                if x not in leaf_ids and made is not None and (
                        (made[0] == "F" and (made[1] == s or x in ex.wiring.keep[s]))
                        or made == ("B", s)):
                    sizes[kind][x] = _device_bytes(v.shape, v.dtype, v.sharding)
                    if made == ("B", s):
                        made_by_b.add(x)
    both = {**sizes["B"], **sizes["W"]}
    from_f = sum(n for x, n in both.items() if x not in made_by_b)
    from_b = sum(sizes["W"][x] for x in made_by_b if x in sizes["W"])
    after_b = sum(sizes["W"].values())      # (what W still reads, B's results among it)
    kinds = [kind for kind, st, _ in ex.wiring.order if st == s]
    closes = "W" if "W" in kinds else "B"
    now = most = 0
    for kind in kinds:
        now += 1 if kind == "F" else -1 if kind == closes else 0
        most = max(most, now)
    return int(peak_kept(kinds, from_f, from_b, after_b)), most


def stage_memory(ex: "PipelineExecutable", compiled: PipelineCompiled) -> list[StageMemory]:
    """What each stage of ``ex`` keeps on one device during a call.  The
    activations are walked through the driver's own order
    (``ex.wiring.order``), as it frees them: a micro-batch's values live from
    the program that makes them to the last one that reads them (ZB-H1: what
    only ``B`` reads goes after ``B``, what ``W`` reads after ``W``)."""
    flat, lay, split, m, p = ex.flat, ex.layouts, ex.split, ex.m, ex.p
    leaf_ids = set(flat.invars)
    copies = {o for k in split.hoisted for o in flat.eqns[k].outvars}
    out = []
    for s in range(p):
        keys = [k for k in compiled.compiled if k[1] == s]
        state = sum(_device_bytes(flat.avals[x].shape, flat.avals[x].dtype, lay.arg(x, s))
                    for x in leaf_ids if x not in lay.is_batch
                    and s in ex.wiring.leaf_readers.get(x, ()) and hasattr(flat.avals[x], "shape"))
        # the hoisted casts' copies live through the step like the state
        r = ("R", s)
        if r in compiled.compiled:
            state += sum(_device_bytes(flat.avals[x].shape, flat.avals[x].dtype, sh)
                         for x, sh in zip(split.tasks[r].outputs, compiled[r].output_shardings[0])
                         if x in copies)
        # (partial sums: (D, *shape) cut over the data axes, one gradient a device)
        sums = sum(_device_bytes(a.shape, a.dtype, a.sharding)
                   for a in (ex.sums.struct(x, s) for k in keys if k[0] in ("F", "B", "W")
                             for x in split.tasks[k].accumulate)) if m > 1 else 0
        peak, in_flight = _kept_through_order(ex, compiled, s)
        work = updated = 0
        for k in keys:
            mem = program_memory(compiled[k])
            # (outputs are the activations and sums counted above, or
            # values sent on: the arena of intermediates is what adds)
            work = max(work, mem["temp"])
            if k[0] == "A":
                updated += mem["output"] - mem["alias"]
        out.append(StageMemory(s, int(state), int(sums), int(peak), int(in_flight),
                               int(work), int(updated)))
    return out
