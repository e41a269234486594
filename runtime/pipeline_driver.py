"""The pipeline driver: one call of a pipeline plan, program by program.

:class:`StepRun` dispatches the stage programs asynchronously in one global
order that follows every stage's schedule (GPipe: all forwards, then all
backwards; 1F1B: warm-up forwards, then one forward / one backward; see
:func:`~meshplan.runtime.pipeline_split.dispatch_order`).  It keeps a
micro-batch's activations only until the programs that read them ran
(:class:`Wiring` counts the readers), accumulates gradients per stage (the
gradient is the mean over micro-batches, i.e. the loss is taken to be a mean
over the batch), then runs each stage's update, level by level, and returns
the outputs as the undecorated step does.

[remat] For a rematerialised stage the copies of the activations its forward
received from other programs are kept on the stage until its backward, which
reads them again (``Wiring.keep``).

[multi-host] Every process runs the same loop in the same order and
dispatches the programs of its own stages only; a value moves to a stage of
another process through a collective both processes issue at the same point
of the loop (:class:`~meshplan.runtime.pipeline_transport.Transfers`).

What ran is noted per program (dispatch times; a :class:`Watcher` thread per
stage notes when the outputs were ready) and turned into
:class:`~meshplan.schedule.Block` s by :func:`timeline_blocks`.
"""
from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, AbstractSet, Any, Sequence

import jax

from meshplan.errors import RuntimeStageError, deleted_argument
from meshplan.schedule import Block
from meshplan.traced import FlatJaxpr

from .pipeline_split import CONCAT, LAST, StepSplit, dispatch_order
from .pipeline_transport import concat
from .shard import check_donated_aliases

if TYPE_CHECKING:
    from .pipeline import PipelineExecutable

__all__ = ("Wiring", "wire", "StepRun", "Watcher", "timeline_blocks",)


# ---------------------------------------------------------------------------
# What the loop needs to know about the split
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TaskWiring:
    """Where a micro-batch program's inputs come from and its outputs go,
    worked out once so that the loop does not ask again per micro-batch
    (one process: the multi-host loop fetches input by input)."""
    params: tuple[tuple[int, int], ...]     # (position, argument leaf): the same every micro-batch
    batch: tuple[tuple[int, int], ...]      # (position, batch leaf): its micro-batch's piece
    # (position, id, how many reads it takes, made on another stage, [remat] kept)
    values: tuple[tuple[int, int, int, bool, bool], ...]
    outputs: tuple[tuple[Any, int], ...]    # (crossing: LAST / CONCAT / None, readers) per output
    opens: bool                             # a micro-batch's activations begin to live on its stage
    closes: bool                            # ... and are freed


@dataclasses.dataclass(frozen=True)
class Wiring:
    order: tuple[tuple[str, int, int], ...]       # (kind, stage, micro-batch) to dispatch
    update_order: tuple[tuple, ...]               # update task keys by (level, stage)
    consumers: dict[int, list[tuple]]             # C id -> C task keys reading it (one micro-batch)
    leaf_readers: dict[int, tuple[int, ...]]      # argument leaf -> the stages reading it
    keep: tuple[frozenset[int], ...]              # [remat] per stage, see the module doc
    tasks: dict[tuple[str, int], TaskWiring]      # per F / B / W program


def wire(split: StepSplit, flat: FlatJaxpr, schedule: str, m: int, is_batch: AbstractSet[int],
         groups: Sequence[int] | None = None) -> Wiring:
    """The loop's wiring; ``is_batch``: the batch argument leaves
    (``StageLayouts.is_batch``: a micro-batch reads its own rows of them)."""
    order = dispatch_order(split, schedule, m, groups)
    update_order = sorted((k for k in split.tasks if k[0] == "A"), key=lambda k: (k[2], k[1]))
    consumers: dict[int, list[tuple]] = defaultdict(list)
    for key, t in split.tasks.items():
        if key[0] in ("F", "B", "W"):
            for x in t.inputs:
                consumers[x].append(key)
    # the stages that read every argument leaf (the update reads a
    # gradient marker's output as its input where nothing computes it)
    leaf_ids = set(flat.invars)
    readers: dict[int, set[int]] = defaultdict(set)
    for key, t in split.tasks.items():
        for x in t.inputs:
            src = x if x in leaf_ids or x in split.producer else split.alias.get(x, x)
            if src in leaf_ids:
                readers[src].add(key[1])
    # [remat] per stage, the values of other programs its forward received
    # that its backward reads again
    keep: list[frozenset[int]] = []
    for s in range(split.num_stages):
        f, b = split.tasks.get(("F", s)), split.tasks.get(("B", s))
        kept: frozenset[int] = frozenset()
        if f is not None and b is not None and b.replay:
            kept = frozenset(x for x in f.inputs if x in set(b.inputs) and x not in leaf_ids)
        keep.append(kept)
    tasks = {key[:2]: _task_wiring(split, key, leaf_ids, is_batch, consumers, keep[key[1]])
             for key in split.tasks if key[0] in ("F", "B", "W")}
    return Wiring(tuple(order), tuple(update_order), dict(consumers),
                  {i: tuple(sorted(v)) for i, v in readers.items()}, tuple(keep), tasks)


def _task_wiring(split: StepSplit, key: tuple, leaf_ids: set[int], batch: AbstractSet[int],
                 consumers: dict[int, list[tuple]], keep: frozenset[int]) -> TaskWiring:
    kind, s = key[0], key[1]
    t = split.tasks[key]
    params, rows, values = [], [], []
    for pos, x in enumerate(t.inputs):
        if x in leaf_ids:
            (rows if x in batch else params).append((pos, x))
        else:
            kept = x in keep
            values.append((pos, x, 2 if kept else 1, split.producer[x][1] != s, kept))
    outputs = tuple((split.crossing.get(x), len(consumers.get(x, ()))) for x in t.outputs)
    closes = ("F", s) in split.tasks and kind == ("W" if ("W", s) in split.tasks else "B")
    return TaskWiring(tuple(params), tuple(rows), tuple(values), outputs, kind == "F", closes)


# ---------------------------------------------------------------------------
# One call
# ---------------------------------------------------------------------------

class StepRun:
    """One call of ``ex`` with the flat argument ``leaves``: :meth:`run`
    returns the flat outputs; ``events`` notes what ran."""

    def __init__(self, ex: "PipelineExecutable", leaves: Sequence[Any]) -> None:
        self.ex = ex
        self.split, self.flat, self.m, self.w = ex.split, ex.flat, ex.m, ex.wiring
        self.tr = ex.transfers
        self.xp, self.local = self.tr.xp, self.tr.local
        self.t_step = time.perf_counter()
        self.moves0 = self.xp.moves if self.xp is not None else 0
        self.given = dict(zip(self.flat.invars, leaves))
        self.placed: dict[tuple[int, int], Any] = {}        # (arg id, stage) -> array there
        self.mb_cache: dict[tuple[int, int], list[Any]] = {}
        self.params_in: dict[tuple[str, int], list[Any]] = {}   # (kind, stage) -> inputs, params set
        # [multi-host] the global batch and arguments of remote stages, moved
        # up front and in the same order in every process
        self.leaf_of = self.given if self.xp is None else self.tr.arguments(self.given, self.placed)
        p = ex.p
        # per micro-batch values: id -> array on its producer's stage, and
        # how many programs still read it
        self.vals: list[dict[int, Any]] = [dict() for _ in range(self.m)]
        self.remaining: list[dict[int, int]] = [dict() for _ in range(self.m)]
        self.accs: list[dict[int, Any]] = [dict() for _ in range(p)]
        self.last: dict[int, Any] = {}
        self.concat: dict[int, list[Any]] = defaultdict(list)
        self.events: list[tuple] = []
        self.in_flight = [0] * p
        self.max_in_flight = [0] * p
        ex._steps += 1
        self.step_id = ex._steps
        self.watchers = ex._get_watchers() if ex.record_timeline else None
        # [multi-host] values moved across processes: sent once per receiving
        # stage, kept there for its other programs
        self.sent: set[tuple] = set()
        self.got: dict[tuple, list[Any]] = {}
        # [remat] (micro-batch, id, stage) -> the copy a remat stage's forward
        # received, kept there for its backward
        self.kept: dict[tuple[int, int, int], Any] = {}

    def run(self) -> list[Any]:
        self._check_donated()
        self._start_sums()
        self._draw()
        for kind, s, i in self.w.order:
            self._run_task(kind, s, i)
        leftover = [x for d in self.vals for x in d]
        if leftover or self.got or self.kept:   # cannot happen: every value is counted to its consumers
            raise RuntimeStageError(f"internal: {len(leftover) + len(self.got) + len(self.kept)} "
                                    "activation(s) left after the step")
        done = self._reduce()
        self._update(done)
        outs = self._outputs(done)
        self._release()
        return outs

    # ---- donation (see meshplan.runtime.pipeline) ---------------------------
    def _check_donated(self) -> None:
        """Refuse, before anything runs, an array deleted by an earlier call
        (jax 0.10.2 crashes the process on one) and an array passed as a
        donated leaf and as another leaf (it would be taken over twice)."""
        for x, v in self.given.items():
            if isinstance(v, jax.Array) and v.is_deleted():
                raise deleted_argument(self._where(x))
        if self.ex.released:
            check_donated_aliases(self.given.items(), self.ex.released, self._where)

    def _where(self, x: int) -> str:
        a, path = self.ex.arg_path[x]
        return f"argument {a}{path}"

    def _release(self) -> None:
        """The caller's arrays of donated arguments are given up, as jax.jit
        does (those the step returns unchanged excepted): deleted once every
        program reading them is dispatched (the runtime keeps them alive
        until those programs are done)."""
        for x in self.ex.released - self.ex.returned:
            v = self.given[x]
            if isinstance(v, jax.Array) and not v.is_deleted():
                v.delete()

    def stats(self) -> dict[str, Any]:
        out = {"max_in_flight": self.max_in_flight, "dispatch_s": time.perf_counter() - self.t_step,
               "tasks": len(self.events)}
        if self.xp is not None:
            out["cross_process_moves"] = self.xp.moves - self.moves0
        return out

    # ---- the micro-batches --------------------------------------------------
    def _start_sums(self) -> None:
        if self.m > 1:      # running sums start at zero: every program has one signature
            for s in range(self.ex.p):
                if not self.local[s]:
                    continue
                ids, zeros = self.ex.sums.zeros(s)
                if ids:
                    self.accs[s] = dict(zip(ids, zeros()))

    def _draw(self) -> None:
        """The R tasks, once per step ahead of the micro-batches: the random
        draws over the batch at the full batch's shape, each micro-batch's
        rows becoming its values; the hoisted casts and the batch statistics,
        the same value every micro-batch's (read and freed like any
        activation)."""
        dims = {self.flat.eqns[k].outvars[0]: d for k, (d, _) in self.split.draws.items()}
        batch = self.tr.layouts.is_batch
        for key, t in self.split.tasks.items():
            if key[0] != "R" or not self.local[key[1]]:
                continue
            prog = self.ex.programs[key]
            # (a batch statistic reads the whole batch: the micro-batches' rows in order)
            ins = [jax.numpy.concatenate([self._arg_on(x, key[1], i) for i in range(self.m)])
                   if x in batch else self._arg_on(x, key[1], 0) for x in t.inputs]
            plain, _ = self.ex._call(prog, ins, [], -1)
            for x, v in zip(t.outputs, plain):
                if x in self.split.statistics:      # (for the update and the outputs)
                    self.last[x] = v
                uses = len(self.w.consumers.get(x, ()))
                if not uses:
                    continue
                pieces = _rows(v, self.m, dims[x]) if x in dims else [v] * self.m
                for i, piece in enumerate(pieces):
                    self.vals[i][x] = piece
                    self.remaining[i][x] = uses

    def _run_task(self, kind: str, s: int, i: int) -> None:
        prog = self.ex.programs[(kind, s)]
        task = prog.task
        tw = self.w.tasks[(kind, s)]
        if self.xp is None:
            ins = self._inputs(kind, s, i, tw)
        else:
            ins = [self._fetch(x, s, i, kind) for x in task.inputs]
            if not self.local[s]:       # [multi-host] another process runs it
                return
        acc_in = [self.accs[s][x] for x in task.accumulate] if self.m > 1 else []
        t0 = time.perf_counter()
        plain, new = self.ex._call(prog, ins, acc_in, i)
        t1 = time.perf_counter()
        del ins, acc_in
        if new:
            accs = self.accs[s]
            for x, v in zip(task.accumulate, new):
                accs[x] = v
        vals, remaining = self.vals[i], self.remaining[i]
        for x, v, (c, uses) in zip(task.outputs, plain, tw.outputs):
            if c == LAST:
                self.last[x] = v
            elif c == CONCAT:
                self.concat[x].append(v)
            if uses:
                vals[x] = v
                remaining[x] = uses
        if tw.opens:
            self.in_flight[s] += 1
            self.max_in_flight[s] = max(self.max_in_flight[s], self.in_flight[s])
        elif tw.closes:     # (zb-h1: a micro-batch's activations live until its W)
            self.in_flight[s] -= 1
        self._note(s, i, kind, t0, t1, plain + new)

    def _inputs(self, kind: str, s: int, i: int, tw: TaskWiring) -> list[Any]:
        """[one process] the inputs of program ``(kind, s)`` on micro-batch
        ``i``: the stage's arguments placed once a step, the micro-batch's
        rows, and the values other programs made, sent where made on
        another stage (what :meth:`_fetch` does input by input)."""
        ins = self.params_in.get((kind, s))
        if ins is None:
            ins = self.params_in[(kind, s)] = [None] * len(self.ex.programs[(kind, s)].task.inputs)
            for pos, x in tw.params:
                ins[pos] = self._arg_on(x, s, 0)
        ins = ins.copy()
        for pos, x in tw.batch:
            ins[pos] = self._arg_on(x, s, i)
        for pos, x, n, other, kept in tw.values:
            if kept and kind == "B":
                ins[pos] = self.kept.pop((i, x, s))
                continue
            v = self._take(x, i, n)
            if other:
                v = self.tr.send(v, x, s)
            if kept:
                self.kept[(i, x, s)] = v
            ins[pos] = v
        return ins

    def _note(self, s: int, i: int, kind: str, t0: float, t1: float, outs: list[Any]) -> None:
        self.events.append((s, i, kind, t0, t1))
        if self.watchers is not None:
            self.watchers[s].put(self.step_id, len(self.events) - 1, outs)

    def _arg_on(self, i: int, s: int, mb: int) -> Any:
        if i in self.tr.layouts.is_batch:
            pieces = self.mb_cache.get((i, s))
            if pieces is None:
                for j, got in self.tr.split_batches(self.leaf_of, i, s).items():
                    self.mb_cache[(j, s)] = got
                pieces = self.mb_cache[(i, s)]
            return pieces[mb]
        v = self.placed.get((i, s))
        if v is None:
            v = self.placed[(i, s)] = self.tr.place_arg(self.leaf_of[i], i, s)
        return v

    def _take(self, x: int, mb: int, n: int = 1) -> Any:
        v = self.vals[mb][x]
        rem = self.remaining[mb]
        rem[x] -= n
        if rem[x] == 0:
            del self.vals[mb][x], rem[x]
        return v

    def _fetch(self, x: int, s: int, mb: int, kind: str) -> Any:
        """Input ``x`` of a program of stage ``s`` on micro-batch ``mb``
        (None where another process runs the program)."""
        if x in self.leaf_of:
            return self._arg_on(x, s, mb) if self.local[s] else None
        # [remat] what a remat stage's forward received from another
        # program, its backward reads again: taken for both at the forward
        again = x in self.w.keep[s]
        n = 2 if again else 1
        if self.xp is None or (self.local[self.split.producer[x][1]] and self.local[s]):
            if again and kind == "B":
                return self.kept.pop((mb, x, s))
            v = self.tr.send(self._take(x, mb, n), x, s)
            if again:
                self.kept[(mb, x, s)] = v
            return v
        return self._fetch_remote(x, s, mb, kind, again)

    def _fetch_remote(self, x: int, s: int, mb: int, kind: str, again: bool) -> Any:
        """[multi-host] input ``x`` made by a stage of another process, or
        read by one: both processes take part in the move."""
        r = self.split.producer[x][1]
        if self.local[r]:
            if again and kind == "B":
                return None          # taken and moved for both at the forward
            v = self._take(x, mb, 2 if again else 1)
            if (mb, x, s) not in self.sent:
                self.sent.add((mb, x, s))
                self.tr.move(v, x, r, s, False)
            return None
        if self.local[s]:
            hit = self.got.get((mb, x, s))
            if hit is None:
                uses = sum(1 for k in self.w.consumers.get(x, ()) if k[1] == s)
                hit = self.got[(mb, x, s)] = [self.tr.move(None, x, r, s, False), uses]
            hit[1] -= 1
            if hit[1] == 0:
                del self.got[(mb, x, s)]
            return hit[0]
        return None

    # ---- after the micro-batches: means, then the update, level by level ----
    def _reduce(self) -> dict[int, Any]:
        """id -> array (on its producer's stage) of what crosses into the update."""
        done: dict[int, Any] = {}
        done.update(self.last)
        for s in range(self.ex.p):
            if not self.accs[s]:
                continue
            ids = list(self.accs[s])
            arrs = [self.accs[s][x] for x in ids]
            if self.m > 1:
                arrs = self.ex.sums.mean(s, len(arrs))(*arrs)
            done.update(zip(ids, arrs))
        for x, parts in self.concat.items():
            done[x] = parts[0] if len(parts) == 1 else concat(parts)
        return done

    def _produced(self, x: int, done: dict[int, Any]) -> bool:
        # [multi-host] what other processes made is not in `done` here
        return x in done if self.xp is None else x in self.split.producer

    def _update(self, done: dict[int, Any]) -> None:
        keys, make = self.ex.constant_grads
        if keys:
            done.update(zip(keys, make()))
        for key in self.w.update_order:
            prog = self.ex.programs[key]
            s = key[1]
            ins = [self._update_input(x, s, done) for x in prog.task.inputs]
            if not self.local[s]:
                continue
            t0 = time.perf_counter()
            plain, _ = self.ex._call(prog, ins, [], -1)
            t1 = time.perf_counter()
            del ins
            done.update(zip(prog.task.outputs, plain))
            self._note(s, -1, "A", t0, t1, plain)
        self.got.clear()

    def _update_input(self, x: int, s: int, done: dict[int, Any]) -> Any:
        """Input ``x`` of an update program of stage ``s`` (None where another
        process runs it)."""
        src = x if x in self.leaf_of or self._produced(x, done) else self.split.alias.get(x, x)
        if src in self.leaf_of:
            return self._arg_on(src, s, 0) if self.local[s] else None
        if src in self.ex.constant_ids:     # (made here: constant_gradients)
            return self.tr.send(done[src], src, s) if self.local[s] else None
        xp, local = self.xp, self.local
        r = self.split.producer[src][1] if xp is not None else s
        if xp is None or (local[r] and local[s]):
            return self.tr.send(done[src], src, s)
        if local[r]:
            if (-1, src, s) not in self.sent:
                self.sent.add((-1, src, s))
                self.tr.move(done[src], src, r, s, True)
        elif local[s]:
            hit = self.got.get((-1, src, s))
            if hit is None:
                hit = self.got[(-1, src, s)] = [self.tr.move(None, src, r, s, True)]
            return hit[0]
        return None

    def _outputs(self, done: dict[int, Any]) -> list[Any]:
        outs = []
        keys, make = self.ex.fixed
        fixed = dict(zip(keys, make())) if keys else {}
        for k, x in enumerate(self.flat.outvars):
            if k in fixed:
                outs.append(fixed[k])
            elif x in self.leaf_of:
                outs.append(_as_array(self.given[x]))
            else:
                src = x if self._produced(x, done) else self.split.alias.get(x, x)
                if src in self.leaf_of:
                    outs.append(_as_array(self.given[src]))
                elif self.xp is None:
                    outs.append(done[src])
                else:
                    outs.append(self.tr.output(done.get(src), src, k))
        # (one array returned as two outputs, as a metric that is also state:
        # copied, as jax.jit returns distinct arrays, so that donating one
        # deletes no other)
        seen: set[int] = set()
        for k, v in enumerate(outs):
            if isinstance(v, jax.Array):
                if id(v) in seen:
                    outs[k] = jax.numpy.copy(v)
                seen.add(id(v))
        return outs


def _as_array(v: Any) -> Any:
    """An argument returned as it is, as jax.jit returns it: an array (a
    Python scalar weakly typed)."""
    return v if isinstance(v, jax.Array) else jax.numpy.asarray(v)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rows(x: Any, m: int, dim: int) -> tuple[Any, ...]:
    """``x`` cut into ``m`` equal pieces along ``dim`` (a draw's micro-batches)."""
    return tuple(jax.numpy.split(x, m, axis=dim))


# ---------------------------------------------------------------------------
# What ran
# ---------------------------------------------------------------------------

class Watcher:
    """A thread that waits for programs' outputs in dispatch order and notes
    when each was ready (one per stage: a stage runs its programs in order)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._done: dict[int, dict[int, float]] = {}
        self._cv = threading.Condition()
        self._put = 0
        self._seen = 0
        self.thread = t = threading.Thread(target=self._loop, daemon=True,
                                           name="meshplan-pipeline-watch")
        t.start()
        # (ended before the interpreter exits: a daemon thread killed inside
        # block_until_ready aborted the process, "terminate called after
        # throwing an instance of ''", after the user's work was done)
        self.end = weakref.finalize(self, _end_watch, self._q, t)

    def put(self, step: int, event: int, arrays: list[Any]) -> None:
        self._put += 1
        self._q.put((step, event, arrays))

    def mark(self) -> int:
        return self._put

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            step, event, arrays = item
            try:
                jax.block_until_ready(arrays)
            except Exception:       # the error is the caller's to see, not the watcher's
                pass
            t = time.perf_counter()
            del arrays
            with self._cv:
                d = self._done.setdefault(step, {})
                d[event] = t
                for old in [k for k in self._done if k < step - 1]:
                    del self._done[old]
                self._seen += 1
                self._cv.notify_all()

    def wait(self, step: int, upto: int) -> dict[int, float]:
        with self._cv:
            self._cv.wait_for(lambda: self._seen >= upto, timeout=120)
            return dict(self._done.get(step, {}))


def _end_watch(q: queue.Queue, thread: threading.Thread) -> None:
    q.put(None)
    thread.join(timeout=30)


def timeline_blocks(events: Sequence[tuple], t_step: float, ends: dict[int, float],
                    split: StepSplit, p: int, groups: Sequence[int] | None = None) -> list[Block]:
    """The blocks of one call: ``end`` is when a program's outputs were ready
    (``ends``, by event; else when its dispatch returned); ``start`` is the
    later of its dispatch, the end of the previous program on the stage's
    devices (``groups``: each stage's device group, default its own) and
    the end of the programs it reads from."""
    blocks: list[Block] = []
    group = tuple(range(p)) if groups is None else tuple(groups)
    stage_free = [0.0] * (max(group) + 1)
    end_of: dict[tuple, float] = {}
    for k, (s, i, kind, t0, t1) in enumerate(events):
        end = ends.get(k, t1) - t_step
        start = max(t0 - t_step, stage_free[group[s]])
        if kind in ("F", "B", "W"):
            for d in split.deps[(kind, s)]:
                start = max(start, end_of.get((d[0], d[1], i), 0.0))
        end = max(end, start)
        stage_free[group[s]] = end
        end_of[(kind, s, i)] = end
        blocks.append(Block(s, i, kind, start, end))
    return blocks
