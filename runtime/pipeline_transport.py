"""Moving values between pipeline stages.

Within one process (:class:`Transfers`): a value crosses to another stage
only through an explicit put (:func:`cross`: ``jax.device_put``, or the
shard copy it ends in where shard k of the sender is what device k of the
receiver wants) onto a ``NamedSharding`` of the receiving stage's mesh (its planned layout there; see
:class:`~meshplan.runtime.pipeline_programs.StageLayouts`): jax 0.10.2
crashed on the cached second call of a program given an array of another
submesh.  Batch arguments are cut into micro-batches on the stages that read
them.

Send once, gather on the receiver (Alpa's cross-mesh resharding, Zheng et
al., OSDI'22, section 6): where the receiver's layout replicates the value
over some of its mesh axes, the value does not cross once per replica.  It
crosses in :func:`send_once_hop`'s layout, those axes splitting it further,
so each distinct piece lands on one receiver device; a jitted identity on the
receiver's mesh then all-gathers the pieces into the planned layout over the
receiver's own (fast) links.  Where the two stages' meshes have the same axis
names and shape, the value is first laid out that way on the sender (a local
slice where the sender holds it replicated too), so that every piece is one
whole shard of a sender device and the copy moves it as it is.
:func:`moved_bytes` counts what lands on devices that did not hold it.
Within one host a put moves the same bytes, except where the sender holds
not every piece the receiver's layout wants: jax then copies the value
through host memory, waiting for it; there it crosses in its own layout,
shard by shard, and is gathered on the receiver (:meth:`SendOnce._local`).

Across processes
----------------
Stages on different ``jax.distributed`` processes, values moved between
them by a small collective.

A multi-stage plan runs as a *multi-controller* program: every process runs
the same driver loop (:mod:`~meshplan.runtime.pipeline_driver`) in the same
order and dispatches only the programs of the stages whose devices
are its own.  Each stage must sit on the devices of one process (the planner
places stages host by host, and a process is a host).

Moving a value from stage ``r`` to stage ``s`` of another process
(:meth:`StageTransport.move`): ``jax.device_put`` onto devices of another
process is not supported on CPU (jax 0.10.2 asks for a DCN transfer server,
and a transfer through it hangs), so both processes call one jitted
``shard_map`` with a ``ppermute`` over a mesh of the two stages' devices: a
``pipe`` axis of size 2 stacked on the stages' mesh axes.  Its input is one
global array built with ``jax.make_array_from_single_device_arrays`` from the
sender's shards (the value laid out as the receiver wants it, further split
over the axes that replicate it there: :func:`send_once_hop`) and zeros on
the receiver's devices; after the permute the receiver rebuilds the value on
its own stage from its local shards and all-gathers it into its layout.  Each
device sends only its own shard, so each distinct piece crosses once.  Two
stages of different mesh shapes send the whole value from one device of the
sender to one of the receiver, which then lays it out locally.  The CPU client
launches the collectives of a process one at a time in dispatch order, so
processes that dispatch them in the same order cannot deadlock.

Values on their stage: the step's outputs are ``jax.Array``\\ s on the
producing stage's mesh.  The process of that stage holds the data; every
other process gets a handle of the same global shape, dtype and mesh with no
addressable shards.  Fed back into the next step (the usual training loop),
such a value goes straight to the stages of its own process and is moved to
the others; :func:`meshplan.runtime.to_host` reads it in every process.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan.errors import RuntimeStageError
from meshplan.traced import TracedStep

from .host_put import HostPut
from .multihost import is_global_array, is_local_batch_leaf, to_host
from .pipeline_programs import StageLayouts
from .pipeline_split import CONCAT, StepSplit
from .shard import place

__all__ = ("Transfers", "StageTransport", "same_mesh", "stage_processes", "place",
           "concat", "SendOnce", "send_once_hop", "moved_bytes")

PIPE_AXIS = "meshplan_pipe"


# ---------------------------------------------------------------------------
# One executable's transfers
# ---------------------------------------------------------------------------

class Transfers:
    """Moves the values of one pipeline executable between its stages.
    ``xp``: the cross-process transport (None in a one-process run)."""

    def __init__(self, meshes: Sequence[Mesh], layouts: StageLayouts, split: StepSplit,
                 traced: TracedStep, m: int, xp: "StageTransport | None",
                 leaf_readers: Mapping[int, tuple[int, ...]]) -> None:
        self.meshes = list(meshes)
        self.layouts = layouts
        self.split = split
        self.flat = traced.flat
        self.step_out_avals = traced.step_out_avals
        self.m = m
        self.mb = traced.micro_batch_size
        self.xp = xp
        self.local = list(xp.local) if xp is not None else [True] * len(self.meshes)
        self.leaf_readers = leaf_readers
        self.cross = SendOnce()
        self._in_place: dict[tuple[int, int], Any] = {}  # (leaf, stage) -> sharding found in place
        self._cutters: dict[tuple, Any] = {}    # shardings -> :meth:`_cutter`'s program
        self.host_put = HostPut()
        self._stacks: dict[NamedSharding, NamedSharding] = {}
        # the batch leaves each stage reads
        self._batch_on = [sorted(i for i in layouts.is_batch if s in leaf_readers.get(i, ()))
                          for s in range(len(self.meshes))]

    def send(self, v: Any, x: int, s: int) -> Any:
        """``v`` onto stage ``s``: unchanged if it already lives there, else
        explicitly onto the receiving stage's sharding, each distinct piece
        crossing once (:class:`SendOnce`)."""
        cur = getattr(v, "sharding", None)
        if isinstance(cur, NamedSharding) and cur.mesh == self.meshes[s]:
            return v
        return self.cross.put(v, self.layouts.send(v, x, s))

    def place_arg(self, x: Any, i: int, s: int) -> Any:
        """Argument leaf ``i`` on stage ``s``.  A leaf whose sharding is the
        very object one of an earlier call had when it was found in place
        there (jit gives its outputs the same objects call after call) is
        passed through without comparing shardings again."""
        cur = getattr(x, "sharding", None)
        if cur is not None and self._in_place.get((i, s)) is cur:
            return x
        v = place(x, self.layouts.arg(i, s))
        if v is x and cur is not None:
            self._in_place[(i, s)] = cur
        return v

    def split_batches(self, leaf_of: Mapping[int, Any], i: int, s: int) -> dict[int, list[Any]]:
        """Batch argument leaf ``i`` and every other one stage ``s`` reads
        (``leaf_of``: id -> leaf) on stage ``s``, one piece per micro-batch.
        The leaves on the host cross in one put, each whole, and one program
        cuts them there."""
        out: dict[int, list[Any]] = {}
        host: list[tuple[int, np.ndarray, NamedSharding]] = []
        mb, m = self.mb, self.m
        for j in self._batch_on[s] if i in self._batch_on[s] else [i]:
            x, sh = leaf_of[j], self.layouts.arg(j, s)
            if isinstance(x, jax.Array):
                out[j] = [place(x, sh)] if m == 1 else jax.device_put(_split_rows(x, m), sh)
            else:
                host.append((j, np.asarray(x), sh))
        if host and m == 1:
            for (j, _, _), v in zip(host, self.host_put([x for _, x, _ in host],
                                                        [sh for _, _, sh in host])):
                out[j] = [v]
        elif host:
            # each leaf crosses whole as (m, mb, ...), one put for all, and one
            # program cuts the micro-batches on the devices: a put per piece
            # costs the driver about as much as the whole leaf's
            stacked = self.host_put(
                [x.reshape((m, mb) + x.shape[1:]) for _, x, _ in host],
                [self._stacked(sh) for _, _, sh in host])
            pieces = self._cutter(tuple(sh for _, _, sh in host))(*stacked)
            for k, (j, _, _) in enumerate(host):
                out[j] = list(pieces[k * m:(k + 1) * m])
        return out

    def _stacked(self, sh: NamedSharding) -> NamedSharding:
        """``sh`` with a leading unsplit axis: a leaf stacked as (m, mb, ...)
        (the same object call after call: the put's layouts are keyed by it)."""
        got = self._stacks.get(sh)
        if got is None:
            got = self._stacks[sh] = NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec),
                                                   memory_kind=sh.memory_kind)
        return got

    def _cutter(self, shardings: tuple[NamedSharding, ...]) -> Any:
        """A jitted function taking leaves stacked as (m, mb, ...) to their
        m micro-batches each, on ``shardings`` (one per leaf)."""
        fn = self._cutters.get(shardings)
        if fn is None:
            m = self.m

            def cut(*xs: Any) -> tuple[Any, ...]:
                return tuple(x[k] for x in xs for k in range(m))
            fn = self._cutters[shardings] = jax.jit(
                cut, out_shardings=tuple(sh for sh in shardings for _ in range(m)))
        return fn

    # ---- multi-host ---------------------------------------------------------
    def arguments(self, given: dict[int, Any], placed: dict[tuple[int, int], Any]
                  ) -> dict[int, Any]:
        """[multi-host] The arguments as this process's stages read them, made
        with collectives every process issues in the same order: the global
        batch gathered to host, arrays spread over processes gathered to
        host, stage outputs of the last step moved to the stages of other
        processes that read them (into ``placed``)."""
        xp = self.xp
        assert xp is not None
        leaf_of = dict(given)
        spread: list[int] = []
        for i in self.flat.invars:
            x = given[i]
            if i in self.layouts.is_batch:
                leaf_of[i] = _global_batch(x)
            elif isinstance(x, jax.Array) and xp.stage_of(x) is None and not x.is_fully_addressable:
                procs = sorted({d.process_index for d in x.sharding.device_set})
                if jax.process_index() not in procs and len(procs) < jax.process_count():
                    raise RuntimeStageError(
                        f"argument {self.layouts.leaf_key[i]} lives on the devices of process(es) "
                        f"{procs} only and on no stage of this pipeline: pass the same host value "
                        "(NumPy) in every process, a global array, or the state the step returned")
                spread.append(i)
        if spread:
            for i, v in zip(spread, to_host([given[i] for i in spread])):
                leaf_of[i] = v
        for i in self.flat.invars:
            x = given[i]
            r = None if i in self.layouts.is_batch or i in spread else xp.stage_of(x)
            if r is None:
                continue        # a host value: each process places its copy
            for s in self.leaf_readers.get(i, ()):
                target = self.layouts.arg(i, s)
                if xp.same_process(r, s):
                    if xp.local[s]:
                        placed[(i, s)] = place(x, target)
                elif xp.local[r] or xp.local[s]:
                    y = xp.move(x if xp.local[r] else None, r, s, target, x.shape, x.dtype)
                    if y is not None:
                        placed[(i, s)] = y
        return leaf_of

    def move(self, v: Any, x: int, r: int, s: int, after: bool) -> Any:
        """[multi-host] value ``x`` of stage ``r`` to stage ``s`` of another
        process (``v`` on the sender, None on the receiver); ``after``: in the
        update phase (concatenated outputs have the full batch there)."""
        aval = self.flat.avals[x]
        shape = tuple(aval.shape)
        if after and self.split.crossing.get(x) == CONCAT:
            shape = (shape[0] * self.m,) + shape[1:]
        target = self.layouts.cross(x, r, s, len(shape))
        return self.xp.move(v, r, s, target, shape, aval.dtype)

    def output(self, v: Any, x: int, k: int) -> Any:
        """[multi-host] output leaf ``k`` (value ``x``): on its stage's mesh in
        the process of that stage, a handle without local data elsewhere."""
        xp = self.xp
        r = self.split.producer[x][1]
        if xp.local[r]:
            return xp.on_stage(v, r) if isinstance(v, jax.Array) else v
        shape, dtype = self.step_out_avals[k]
        planned = self.layouts.constraints[r].get(x)
        spec = planned.spec if planned is not None and len(planned.spec) == len(shape) else None
        return xp.remote(r, shape, dtype, spec)


class SendOnce:
    """Puts values onto another submesh's sharding, each distinct piece
    crossing once and all-gathered on the receiver (see the module doc).
    Keeps the routes and gather programs it made."""

    def __init__(self) -> None:
        self._routes: dict[tuple, tuple | None] = {}
        self._gathers: dict[NamedSharding, Any] = {}     # sharding -> jitted identity

    def put(self, v: Any, target: NamedSharding) -> Any:
        """``v`` (an array of another mesh) on ``target``."""
        key = (target, tuple(getattr(v, "shape", ())), getattr(v, "sharding", None))
        route = self._routes.get(key, _NO_ROUTE)
        if route is _NO_ROUTE:
            route = self._routes[key] = self._with_copy(v, self._route(v, target), target)
        on_sender, dest, gather, devices = route
        if on_sender is not None:
            v = on_sender(v)
        v = cross(v, dest, devices)
        return v if gather is None else gather(v)

    @staticmethod
    def _with_copy(v: Any, route: tuple | None, target: NamedSharding) -> tuple:
        """``route`` as (reshard on the sender or None, where the value is put,
        the gather on the receiver or None, the receiver's devices where the
        put copies shard k of the sender to device k of the receiver, else
        None).  Such a put is what ``jax.device_put`` does for it, called
        without its dispatch (about a third of a small pipeline's driver time
        went there)."""
        on_sender, dest, gather = (None, target, None) if route is None else route
        src = getattr(v, "sharding", None)
        if on_sender is not None:
            # (the sender lays it out as it crosses: in the hop's spec)
            src = NamedSharding(src.mesh, dest.spec) if isinstance(src, NamedSharding) else None
        devices = None
        if (_COPY is not None and isinstance(v, jax.Array) and src is not None
                and not jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)
                and _one_to_one(src, dest, v.shape)):
            devices = getattr(getattr(dest, "_internal_device_list", None),
                              "addressable_device_list", None)
        return on_sender, dest, gather, devices

    def _route(self, v: Any, target: NamedSharding) -> tuple | None:
        """(reshard on the sender or None, the layout the value crosses in,
        the gather on the receiver), or None where a plain put sends no
        more (nothing replicated, or nothing a replicated axis divides)."""
        if not isinstance(v, jax.Array) or jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended):
            return None
        if one_host(v.sharding.device_set | target.device_set):
            # all links are the host's own: a put moves the same bytes as
            # three dispatches would (as the stage DP prices it inside a
            # host), where the sender holds every piece the receiver wants
            return None if _holds(v.sharding, target, v.shape) else self._local(v, target)
        hop = send_once_hop(target, v.shape)
        if hop is target:
            return None
        cur = v.sharding
        on_sender = None
        if isinstance(cur, NamedSharding) and same_shape(cur.mesh, hop.mesh):
            # each piece one whole shard of a sender device: copied as it is
            there = NamedSharding(cur.mesh, hop.spec)
            if not cur.is_equivalent_to(there, v.ndim):
                on_sender = self.gather_to(there)
        return on_sender, hop, self.gather_to(target)

    def _local(self, v: jax.Array, target: NamedSharding) -> tuple | None:
        """[one host] where a put would copy ``v`` through host memory (and
        wait for it): it crosses in its own layout onto the receiver's mesh
        of the same shape, shard by shard, and is gathered there."""
        cur = v.sharding
        if not isinstance(cur, NamedSharding) or not same_shape(cur.mesh, target.mesh):
            return None
        hop = NamedSharding(target.mesh, cur.spec, memory_kind=target.memory_kind)
        return None, hop, self.gather_to(target)

    def gather_to(self, sharding: NamedSharding) -> Any:
        """A jitted identity onto ``sharding``: XLA's resharding collectives
        on that mesh's devices (an all-gather after a send-once hop)."""
        fn = self._gathers.get(sharding)
        if fn is None:
            fn = self._gathers[sharding] = jax.jit(_identity, out_shardings=sharding)
        return fn


def _copier() -> tuple[Any, Any] | None:
    """xla_client's batched shard copy, the call ``jax.device_put`` ends in
    for an array whose shards map one to one onto the target's devices, and
    its reuse-input semantics; None where this jax has no such call."""
    try:
        from jax._src.lib import xla_client as xc
        return xc.batched_copy_array_to_devices_with_sharding, xc.ArrayCopySemantics.REUSE_INPUT
    except (ImportError, AttributeError):
        return None


_COPY = _copier()
_NO_ROUTE = object()


def cross(v: Any, dest: NamedSharding, devices: Any = None) -> Any:
    """``v`` put on ``dest``: with ``devices`` (``dest``'s, where shard k of
    ``v`` is what device k wants: :func:`_one_to_one`) a copy of the shards
    as they are, else ``jax.device_put``."""
    if devices is not None and _COPY is not None:
        try:
            return _COPY[0]([v], [devices], [dest], [_COPY[1]])[0]
        except TypeError:       # (another jax's signature: the put does it)
            pass
    return jax.device_put(v, dest)


def _one_to_one(src: Any, dst: Any, shape: Sequence[int]) -> bool:
    """Does the k-th device of ``src`` hold exactly what the k-th device of
    ``dst`` wants, for every k, in the same memory (jax's own test for
    copying shards as they are)?"""
    if getattr(src, "memory_kind", None) != getattr(dst, "memory_kind", None) or \
            not (src.is_fully_addressable and dst.is_fully_addressable):
        return False
    shape = tuple(shape)
    a = list(src.addressable_devices_indices_map(shape).values())
    b = list(dst.addressable_devices_indices_map(shape).values())
    return len(a) == len(b) and all(_box(i, shape) == _box(j, shape) for i, j in zip(a, b))


def _holds(src: Any, dst: Any, shape: Sequence[int]) -> bool:
    """Does some device of ``src`` hold each piece a device of ``dst`` wants
    (so that a put copies whole shards, device to device)?"""
    shape = tuple(shape)
    had = {tuple(_box(i, shape)) for i in src.devices_indices_map(shape).values()}
    return all(tuple(_box(i, shape)) in had for i in dst.devices_indices_map(shape).values())


def same_shape(a: Mesh, b: Mesh) -> bool:
    """Meshes of the same axis names and shape (a spec of one fits the other)."""
    return tuple(a.axis_names) == tuple(b.axis_names) and a.devices.shape == b.devices.shape


def one_host(devices: Any) -> bool:
    """Do ``devices`` all belong to one process (one host: no slow link)?"""
    return len({d.process_index for d in devices}) == 1


def _global_batch(x: Any) -> Any:
    """[multi-host] a batch leaf's global value on host, in every process
    (a collective): process-local rows stacked in process order."""
    if is_local_batch_leaf(x):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if is_global_array(x):
        return to_host(x)
    return x


def send_once_hop(target: NamedSharding, shape: Sequence[int]) -> NamedSharding:
    """The layout a value crosses to ``target``'s mesh in: ``target``'s, each
    mesh axis that replicates it further splitting the first dimension it
    divides (after that dimension's own axes), so that every distinct piece
    lands on one device; ``target`` itself where no axis can."""
    mesh, ndim = target.mesh, len(shape)
    spec = tuple(target.spec)
    if len(spec) > ndim or any(d is not None and not isinstance(d, (str, tuple, list))
                               for d in spec) or getattr(target.spec, "unreduced", None):
        return target
    dims = [list(_names(d)) for d in spec + (None,) * (ndim - len(spec))]
    used = {a for d in dims for a in d}
    added = False
    for a in mesh.axis_names:
        if a in used or mesh.shape[a] == 1:
            continue
        for dim in range(ndim):     # the leading dimension first: contiguous pieces
            ways = math.prod(mesh.shape[b] for b in dims[dim]) * mesh.shape[a]
            if shape[dim] % ways == 0:
                dims[dim].append(a)
                added = True
                break
    if not added:
        return target
    entries = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims]
    return NamedSharding(mesh, PartitionSpec(*entries), memory_kind=target.memory_kind)


def _names(d: Any) -> tuple[str, ...]:
    if d is None:
        return ()
    return (d,) if isinstance(d, str) else tuple(d)


def moved_bytes(src: Any, dst: Any, shape: Sequence[int], itemsize: int) -> int:
    """Bytes a move from sharding ``src`` to sharding ``dst`` of a value of
    ``shape`` lands on devices that did not hold them: each ``dst`` device's
    shard less its overlap with what the device held under ``src``."""
    shape = tuple(shape)
    had = {d: _box(i, shape) for d, i in src.devices_indices_map(shape).items()}
    total = 0
    for d, idx in dst.devices_indices_map(shape).items():
        want = _box(idx, shape)
        total += math.prod(b - a for a, b in want)
        if d in had:
            total -= math.prod(max(0, min(b, y) - max(a, x))
                               for (a, b), (x, y) in zip(want, had[d]))
    return total * itemsize


def _box(idx: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """A shard's index as (start, stop) per dimension."""
    out = []
    for sl, n in zip(idx, shape):
        a, b, _ = sl.indices(n)
        out.append((a, b))
    return out


def _identity(x: Any) -> Any:
    return x


@jax.jit
def concat(parts: list[Any]) -> Any:
    """Outputs of the micro-batches joined along dimension 0."""
    return jax.numpy.concatenate(parts, axis=0)


def _split_rows(x: jax.Array, m: int) -> list[jax.Array]:
    return list(_split_jit(x, m))


@functools.partial(jax.jit, static_argnums=1)
def _split_jit(x: jax.Array, m: int) -> tuple[jax.Array, ...]:
    return tuple(jax.numpy.split(x, m, axis=0))


# ---------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------


def same_mesh(a: Mesh, b: Mesh) -> bool:
    """The same devices in the same grid with the same axis names."""
    if a is b:
        return True
    return same_shape(a, b) and all(x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat))


def stage_processes(meshes: Sequence[Mesh]) -> list[int]:
    """The process of every stage; a stage over several processes is refused."""
    out = []
    for k, mesh in enumerate(meshes):
        procs = sorted({d.process_index for d in mesh.devices.flat})
        if len(procs) != 1:
            raise RuntimeStageError(
                f"pipeline stage {k} runs on devices of processes {procs}; across processes "
                "this version runs every stage on the devices of one process: plan with stages "
                "of at most one host each (e.g. Manual(dp=, tp=) with dp * tp <= the devices "
                "per process), or run the plan in one process")
        out.append(procs[0])
    return out


class StageTransport:
    """Moves values between pipeline stages of different processes (see the
    module doc).  ``meshes``: the stages' meshes, each on one process."""

    def __init__(self, meshes: Sequence[Mesh]) -> None:
        self.meshes = list(meshes)
        self.process_of = stage_processes(self.meshes)
        me = jax.process_index()
        self.local = [p == me for p in self.process_of]
        self._fns: dict[tuple, tuple[Mesh, Any]] = {}
        self._zeros: dict[tuple, jax.Array] = {}
        self.cross = SendOnce()          # (its gathers on the receiver)
        self.moves = 0                   # (tests) transfers this process took part in

    # ---- which stage a value lives on --------------------------------------
    def stage_of(self, x: Any) -> int | None:
        """The stage whose mesh ``x`` is laid out on (a step output), else None."""
        sh = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or not isinstance(sh, NamedSharding):
            return None
        for r, mesh in enumerate(self.meshes):
            if same_mesh(sh.mesh, mesh):
                return r
        return None

    def same_process(self, r: int, s: int) -> bool:
        return self.process_of[r] == self.process_of[s]

    # ---- outputs -----------------------------------------------------------
    def on_stage(self, v: jax.Array, r: int) -> jax.Array:
        """``v`` (an output of local stage ``r``) as an array whose sharding
        is a NamedSharding of the stage's mesh (what :meth:`stage_of` reads)."""
        mesh = self.meshes[r]
        sh = v.sharding
        if isinstance(sh, NamedSharding) and same_mesh(sh.mesh, mesh):
            return v
        cands = [NamedSharding(mesh, sh.spec)] if isinstance(sh, NamedSharding) else []
        cands.append(NamedSharding(mesh, PartitionSpec()))
        for cand in cands:
            try:
                ok = sh.is_equivalent_to(cand, v.ndim)
            except Exception:          # a spec of another mesh's axes
                ok = False
            if ok:
                shards = {s.device: s.data for s in v.addressable_shards}
                order = cand.addressable_devices_indices_map(v.shape)
                return jax.make_array_from_single_device_arrays(
                    v.shape, cand, [shards[d] for d in order])
        return jax.device_put(v, NamedSharding(mesh, PartitionSpec()))

    def remote(self, r: int, shape: Sequence[int], dtype: Any,
               spec: PartitionSpec | None = None) -> jax.Array:
        """A handle, in a process without stage ``r``, of a value that lives
        on stage ``r``: global shape and dtype, no addressable shards."""
        spec = spec if spec is not None and len(spec) <= len(shape) else PartitionSpec()
        return jax.make_array_from_single_device_arrays(
            tuple(shape), NamedSharding(self.meshes[r], spec), [], dtype=dtype)

    # ---- moving ------------------------------------------------------------
    def move(self, x: Any, r: int, s: int, target: NamedSharding, shape: Sequence[int],
             dtype: Any) -> jax.Array | None:
        """Move a value of stage ``r`` onto ``target`` (a sharding of stage
        ``s``'s mesh).  Called in the processes of both stages, in the same
        order: the sender passes the value ``x`` and gets None back; the
        receiver passes None and gets the array on ``target``."""
        shape = tuple(int(d) for d in shape)
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            raise RuntimeStageError(
                f"a value of dtype {dtype} crosses from pipeline stage {r} to stage {s}, on "
                "another process; typed PRNG keys cannot cross processes in this version: keep "
                "them as key data (jax.random.key_data) in the step")
        mesh_a, mesh_b, spec = self._layout(r, s, target, shape)
        pipe_mesh, fn = self._fn(mesh_a, mesh_b, spec)
        sharding = NamedSharding(pipe_mesh, spec)
        order = sharding.addressable_devices_indices_map(shape)
        if self.local[r]:
            if tuple(x.shape) != shape:
                raise RuntimeStageError(f"internal: a value of shape {tuple(x.shape)} sent from "
                                        f"stage {r} to stage {s} as shape {shape}")
            src = place(x, NamedSharding(mesh_a, spec))
            pieces = {p.device: p.data for p in src.addressable_shards}
        else:
            local_shape = sharding.shard_shape(shape)
            pieces = {d: self._zero(d, local_shape, dtype) for d in order}
        buf = jax.make_array_from_single_device_arrays(shape, sharding, [pieces[d] for d in order])
        out = fn(buf)
        self.moves += 1
        if not self.local[s]:
            return None
        got = {p.device: p.data for p in out.addressable_shards}
        dst = NamedSharding(mesh_b, spec)
        y = jax.make_array_from_single_device_arrays(
            shape, dst, [got[d] for d in dst.addressable_devices_indices_map(shape)])
        if same_mesh(mesh_b, target.mesh) and not dst.is_equivalent_to(target, len(shape)):
            return self.cross.gather_to(target)(y)      # send-once: gather on the receiver
        return place(y, target)

    def _layout(self, r: int, s: int, target: NamedSharding, shape: tuple[int, ...]
                ) -> tuple[Mesh, Mesh, PartitionSpec]:
        """(sender mesh, receiver mesh, spec): the stages' meshes and the
        target's spec, its replicated axes splitting the value further
        (:func:`send_once_hop`: each piece crosses once), where the two meshes
        have one shape and axis names; else one device of each, the value
        whole."""
        a, b = self.meshes[r], self.meshes[s]
        if same_shape(a, b) and same_mesh(target.mesh, b):
            spec = tuple(target.spec) + (None,) * (len(shape) - len(target.spec))
            hop = send_once_hop(NamedSharding(b, PartitionSpec(*spec)), shape)
            return a, b, PartitionSpec(*hop.spec)
        one_a = _one_device_mesh(a.devices.flat[0])
        one_b = _one_device_mesh(b.devices.flat[0])
        return one_a, one_b, PartitionSpec()

    def _fn(self, mesh_a: Mesh, mesh_b: Mesh, spec: PartitionSpec) -> tuple[Mesh, Any]:
        key = (tuple(d.id for d in mesh_a.devices.flat), tuple(d.id for d in mesh_b.devices.flat),
               mesh_a.devices.shape, tuple(mesh_a.axis_names), tuple(spec))
        hit = self._fns.get(key)
        if hit is None:
            names = (PIPE_AXIS,) + tuple(mesh_a.axis_names)
            pipe_mesh = Mesh(np.stack([mesh_a.devices, mesh_b.devices]), names,
                             axis_types=(AxisType.Auto,) * len(names))

            def permute(block: Any) -> Any:
                return jax.lax.ppermute(block, PIPE_AXIS, perm=[(0, 1)])

            # in and out are "replicated" over the pipe axis only nominally:
            # the sender's half holds the value, the receiver's zeros (in) and
            # the value (out); nothing reads the other half
            fn = jax.jit(jax.shard_map(permute, mesh=pipe_mesh, in_specs=spec, out_specs=spec,
                                       check_vma=False))
            hit = self._fns[key] = (pipe_mesh, fn)
        return hit

    def _zero(self, device: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        key = (device.id, shape, np.dtype(dtype).str)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return z


def _one_device_mesh(device: Any) -> Mesh:
    grid = np.empty((1,), dtype=object)
    grid[0] = device
    return Mesh(grid, ("meshplan_one",), axis_types=(AxisType.Auto,))
