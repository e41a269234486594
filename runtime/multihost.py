"""Multi-process (multi-host) runs: one SPMD program over every process's devices.

JAX runs a mesh that spans several processes as a *multi-controller* program:
every process runs the same Python, calls the same jitted step, and holds only
the shards that live on its own (addressable) devices.  meshplan follows the
usual JAX contract for the data each process feeds:

* **Batch arguments** (``batch_argnums``) are *process-local*: every process
  passes its own slice of the global batch, rows
  ``process_index * local : (process_index + 1) * local`` along dimension 0 of
  every batch leaf.  The global batch is therefore the local batch stacked
  over the processes: global shape = local shape with dimension 0 multiplied
  by ``jax.process_count()``.  The planner plans (and the runtime compiles)
  the step for that *global* shape; :func:`global_view` is the translation.
  Three kinds of leaves are taken as already global: rank-0 leaves (a scalar
  cannot be split; it must be the same in every process), ``jax.Array``
  leaves that are not fully addressable (global arrays built by the caller)
  and ``jax.ShapeDtypeStruct`` leaves (abstract arguments, e.g. for
  ``step.lower``, always describe the global batch).
* **Every other argument** (the train state) holds the *same host value* in
  every process (e.g. the same seed's ``init``) or is already a global
  ``jax.Array`` (the state returned by the previous step).  Host values are
  placed with ``jax.make_array_from_callback``: each process copies the
  pieces its own devices hold.
* **Outputs** are global ``jax.Array``\\ s.  A fully replicated one (the loss)
  can be read in any process with ``x.addressable_data(0)``; :func:`to_host`
  turns any output pytree into NumPy in every process (it gathers sharded
  leaves with ``multihost_utils.process_allgather``, a collective: every
  process must call it with the same tree).
* **The plan** of process 0 is broadcast to the others
  (:func:`agree_on_plan`): every process must compile the same program, and a
  time-limited ILP need not give the same answer twice.  (Every process
  plans; planning is deterministic for a given graph and cluster, so a
  planning error is raised in every process alike.)

The batch is assembled without communication when the plan's batch sharding
lets each process's devices hold only rows that process owns (data parallel
over an axis that follows the processes, the common case).  Otherwise (a
batch replicated across processes, or split over an axis inside a host) the
local rows are first laid out one slice per process and then resharded to the
plan's sharding on the devices, one extra collective per step.

``meshplan.plan(fn, *args)`` (planning only) takes its arguments as they are:
give it the global shapes (e.g. ``jax.ShapeDtypeStruct``); a plan saved from
it runs under ``parallelize(fn, plan=...)`` fed with process-local batches.
The mesh must span every process (``Cluster.local()`` does).  A typical
multi-process program::

    jax.distributed.initialize(...)            # (CPU: jax_cpu_collectives_implementation="gloo")
    step = meshplan.parallelize(train_step, cluster=meshplan.Cluster.local())
    state, _ = init(seed)                      # the same host values everywhere
    for local_batch in my_shard_of_the_data:   # rows of this process only
        state, metrics = step(state, local_batch)
        loss = float(metrics["loss"].addressable_data(0))   # replicated: read locally
    params = meshplan.runtime.to_host(state["params"])      # every process calls it
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import RuntimeStageError, StalePlanError
from meshplan.plan import Plan

__all__ = ("is_multiprocess", "global_view", "is_global_array", "is_local_batch_leaf",
           "check_mesh_spans_processes", "BatchAssembler", "place_global", "agree_on_plan",
           "to_host",)


def is_multiprocess() -> bool:
    """Whether this program runs in more than one JAX process."""
    return jax.process_count() > 1


def is_global_array(x: Any) -> bool:
    """A ``jax.Array`` with shards on other processes' devices."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def is_local_batch_leaf(x: Any) -> bool:
    """Whether a leaf of a batch argument holds this process's rows only: a
    concrete array (NumPy or a fully addressable ``jax.Array``) of rank >= 1.
    Scalars, global arrays and ``jax.ShapeDtypeStruct`` (an abstract
    description, always of the global batch) are global."""
    if isinstance(x, jax.ShapeDtypeStruct) or is_global_array(x):
        return False
    return len(x.shape if hasattr(x, "shape") else np.shape(x)) > 0


def _dtype_of(x: Any) -> Any:
    """The dtype jax gives ``x`` (float64 NumPy data is float32 without x64)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return jax.numpy.asarray(x).dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def global_view(args: Sequence[Any], batch_argnums: Sequence[int],
                num_processes: int | None = None) -> tuple[Any, ...]:
    """``args`` as the planner sees them in a multi-process run.

    Every process-local batch leaf is replaced by a ``jax.ShapeDtypeStruct``
    of the global shape (dimension 0 times the number of processes); other
    leaves are returned unchanged.  With one process ``args`` come back as
    they are.
    """
    n = jax.process_count() if num_processes is None else int(num_processes)
    args = tuple(args)
    if n == 1:
        return args

    def one(x: Any) -> Any:
        if not is_local_batch_leaf(x):
            return x
        shape = tuple(int(s) for s in (x.shape if hasattr(x, "shape") else np.shape(x)))
        return jax.ShapeDtypeStruct((shape[0] * n,) + shape[1:], _dtype_of(x))

    return tuple(jax.tree_util.tree_map(one, a) if i in batch_argnums else a
                 for i, a in enumerate(args))


def check_mesh_spans_processes(mesh: Mesh) -> None:
    """Refuse a mesh that leaves out some process of a multi-process run:
    every process runs the same program, so each needs devices in it."""
    have = {d.process_index for d in mesh.devices.flat}
    if len(have) != jax.process_count():
        missing = sorted(set(range(jax.process_count())) - have)
        raise RuntimeStageError(
            f"this is a multi-process run ({jax.process_count()} processes), but the plan's mesh "
            f"has no devices of process(es) {missing}; every process runs the same step, so the "
            "mesh must span all of them: plan with cluster=meshplan.Cluster.local() (all "
            f"{jax.device_count()} devices)")


# ---------------------------------------------------------------------------
# the batch: process-local rows -> one global array
# ---------------------------------------------------------------------------

def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise RuntimeStageError(f"unsupported strided shard index {index}")
    return start, stop


class BatchAssembler:
    """Builds the global array of one batch leaf from this process's rows.

    ``sharding`` is the plan's sharding of the leaf and ``global_shape`` its
    global shape.  Calling the assembler with the local rows (NumPy or a
    local ``jax.Array``, shape ``(global_shape[0] // processes, ...)``)
    returns a global ``jax.Array`` with ``sharding``.
    """

    def __init__(self, sharding: NamedSharding, global_shape: Sequence[int]) -> None:
        self.sharding = sharding
        self.global_shape = tuple(int(s) for s in global_shape)
        n = jax.process_count()
        if not self.global_shape or self.global_shape[0] % n:
            raise StalePlanError(
                f"a batch leaf of global shape {self.global_shape} does not split into "
                f"{n} process-local slices along dimension 0")
        self.local_rows = self.global_shape[0] // n
        self.local_shape = (self.local_rows,) + self.global_shape[1:]
        me = jax.process_index()
        lo, hi = me * self.local_rows, (me + 1) * self.local_rows
        pieces: list[tuple[Any, tuple[slice, ...]]] = []
        direct = True
        for device, index in sharding.addressable_devices_indices_map(self.global_shape).items():
            start, stop = _bounds(index[0], self.global_shape[0])
            if start < lo or stop > hi:
                direct = False
                break
            pieces.append((device, (slice(start - lo, stop - lo),) + tuple(index[1:])))
        self.direct = direct
        if direct:
            self._devices = [d for d, _ in pieces]
            self._indices = [i for _, i in pieces]
            self._feed: NamedSharding | None = None
        else:
            self._feed = _feed_sharding(sharding.mesh, len(self.global_shape))
            self._feed_inner = BatchAssembler(self._feed, self.global_shape)

    def __call__(self, local: Any) -> jax.Array:
        shape = tuple(getattr(local, "shape", np.shape(local)))
        if shape != self.local_shape:
            raise StalePlanError(
                f"this process's batch leaf has shape {shape}, but the step was compiled for "
                f"process-local shape {self.local_shape} (global {self.global_shape})")
        if not self.direct:
            # one slice per process first, then the plan's layout on the devices
            return jax.device_put(self._feed_inner(local), self.sharding)
        host = local if isinstance(local, np.ndarray) else np.asarray(local)
        buffers = jax.device_put([host[i] for i in self._indices], self._devices)
        return jax.make_array_from_single_device_arrays(self.global_shape, self.sharding, buffers)


def _feed_sharding(mesh: Mesh, rank: int) -> NamedSharding:
    """A sharding of the mesh's devices that gives each process exactly its
    own rows: devices grouped by process (in process order), dimension 0 split
    over the processes, replicated over each process's devices."""
    devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    by_process: dict[int, list[Any]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    per = {len(v) for v in by_process.values()}
    if len(per) != 1:
        raise RuntimeStageError("the plan's mesh holds unequal numbers of devices per process; "
                                "multi-process batches need the same number in every process")
    grid = np.empty((len(by_process), per.pop()), dtype=object)
    for row, p in enumerate(sorted(by_process)):
        grid[row, :] = by_process[p]
    feed_mesh = Mesh(grid, ("processes", "local"))
    return NamedSharding(feed_mesh, PartitionSpec("processes", *([None] * (rank - 1))))


# ---------------------------------------------------------------------------
# the state: the same host value in every process -> one global array
# ---------------------------------------------------------------------------

def place_global(x: Any, sharding: NamedSharding, dtype: Any = None) -> jax.Array:
    """``x`` on a sharding that spans processes.

    A global ``jax.Array`` is resharded (or passed through when already
    placed); anything else is taken as the same host value in every process
    and each process copies the pieces its devices hold.
    """
    if is_global_array(x):
        if x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)
    host = np.asarray(x, dtype=dtype) if dtype is not None else np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# ---------------------------------------------------------------------------
# one plan for all processes
# ---------------------------------------------------------------------------

def agree_on_plan(plan: Plan | Callable[[], Plan]) -> Plan:
    """Process 0's plan, in every process.

    ``plan`` is this process's plan, or a function that makes it (then only
    process 0 calls it).  With one process the plan comes back as it is.
    Otherwise process 0 broadcasts the plan's JSON and every process,
    process 0 included, returns the plan read back from it, so all compile
    the same program even where a time-limited ILP would not repeat its
    answer.  This is a collective: every process must call it.
    """
    if not is_multiprocess():
        return plan() if callable(plan) else plan
    from jax.experimental import multihost_utils

    payload = b""
    if jax.process_index() == 0:
        payload = (plan() if callable(plan) else plan).to_json(indent=None).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.array(len(payload), np.int32)))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(payload, np.uint8)
    text = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8)).decode()
    return Plan.from_json(text)


# ---------------------------------------------------------------------------
# reading outputs
# ---------------------------------------------------------------------------

def to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` as a NumPy array of its global value, in every
    process.

    Fully replicated arrays are read locally; arrays sharded across processes
    are gathered with ``jax.experimental.multihost_utils.process_allgather``;
    an array that lives on the devices of one process only (a pipeline
    stage's output: see :mod:`meshplan.runtime.pipeline`) is sent from that
    process to the others.  These are collectives, so in a multi-process run
    every process must call ``to_host`` on the same tree.  (Which leaves live
    on one process is agreed with one small all-gather, made only when the
    tree holds a ``jax.Array`` that does not span every process.)
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not is_multiprocess():
        return jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
    from jax.experimental import multihost_utils

    everyone = set(range(jax.process_count()))
    out: list[Any] = [None] * len(leaves)
    partial: list[int] = []          # leaves on the devices of some processes only
    for k, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            out[k] = np.asarray(x)
        elif {d.process_index for d in x.sharding.device_set} != everyone:
            partial.append(k)
        elif x.is_fully_replicated:
            out[k] = np.asarray(x.addressable_data(0))
        else:
            out[k] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if partial:
        _partial_to_host(leaves, partial, out)
    return jax.tree_util.tree_unflatten(treedef, out)


def _partial_to_host(leaves: list[Any], partial: list[int], out: list[Any]) -> None:
    """Leaves on the devices of some processes only: a process-local array in
    every process (each reads its own) or an array of one process (that
    process sends it to the others)."""
    from jax.experimental import multihost_utils

    held = np.array([leaves[k].is_fully_addressable for k in partial], np.int32)
    all_held = np.asarray(multihost_utils.process_allgather(held)).reshape(-1, len(partial))
    by_owner: dict[int, list[int]] = {}
    for j, k in enumerate(partial):
        owners = [p for p in range(all_held.shape[0]) if all_held[p, j]]
        if len(owners) == all_held.shape[0]:
            out[k] = np.asarray(leaves[k])          # a process-local value everywhere
        elif len(owners) == 1:
            by_owner.setdefault(owners[0], []).append(k)
        else:
            procs = sorted({d.process_index for d in leaves[k].sharding.device_set})
            raise RuntimeStageError(
                f"an array of shape {tuple(leaves[k].shape)} is sharded over the devices of "
                f"processes {procs}, not all {all_held.shape[0]}: to_host reads arrays of one "
                "process or of all; reshard it onto every process's devices first")
    me = jax.process_index()
    for owner in sorted(by_owner):
        ks = by_owner[owner]
        values = []
        for k in ks:
            x = leaves[k]
            host = np.asarray(x) if owner == me else np.zeros(x.shape, x.dtype)
            values.append(host.astype(np.uint8) if host.dtype == np.bool_ else host)
        got = multihost_utils.broadcast_one_to_all(values, is_source=owner == me)
        for k, v in zip(ks, got):
            out[k] = np.asarray(v).astype(leaves[k].dtype, copy=False)
