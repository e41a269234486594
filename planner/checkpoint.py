"""Train state that survives a change of plan: ``save_state`` / ``restore_state``.

A checkpoint is a directory written with orbax-checkpoint (one OCDBT store of
every array's shards, written in parallel by the devices that hold them) plus
a small ``meshplan_checkpoint.json`` that lists every leaf (pytree path,
shape, dtype; a typed PRNG key, stored as its key data, also its
implementation).  What the checkpoint does *not* hold is a layout: it is read
back onto whatever plan the caller names, so state saved under a 2 x 4 mesh
restores under a 4-device mesh, or under a pipeline plan whose stages own
different parameters on different device subsets -- each array read straight
onto its new sharding (orbax reads only the slices each device needs), bit
for bit.

Crash safety.  ``save_state(path, ...)`` writes everything into a sibling
temporary directory ``<path>.meshplan-partial`` and only then, as the very
last step, writes the marker file (``meshplan_checkpoint.json`` with
``"complete": true``, flushed and fsync'ed) and renames the directory to
``path``.  A save killed at any point before the rename leaves no ``path`` at
all (the partial directory is cleared by the next save); ``restore_state``
refuses a directory without the marker.  Overwriting (``overwrite=True``)
moves the old checkpoint aside to ``<path>.meshplan-old`` before the rename
and deletes it after; if a crash falls in between, the message of
``restore_state`` says where the previous complete checkpoint lies.

Placement under a plan (``restore_state(path, like=..., plan=...)``): the
state is argument ``argnum`` (default 0) of the plan's train step; a leaf's
key is that argument's key prefix followed by ``jax.tree_util.keystr`` of its
path (as in the plan JSON).  The stage whose ``params`` name the key owns the
leaf: the leaf goes to that stage's devices, on its logical mesh, with its
spec.  A leaf no stage names is replicated over the first stage's devices
(what the one-stage runtime does with it too).  With ``plan=None`` each leaf
keeps the sharding of its ``like`` leaf when it has one (a ``jax.Array`` or
a ``jax.ShapeDtypeStruct`` with ``sharding``), else it lands on the default
device.

Multi-process runs: every process calls ``save_state`` / ``restore_state``
with the same arguments (orbax writes each process's shards); process 0 writes
the marker and renames, between barriers over all processes.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .errors import CheckpointError, StalePlanError
from .plan import Plan, Spec, Stage, section_prefixes
from .traced import jit_dtype

__all__ = ["save_state", "restore_state", "checkpoint_info", "shardings_for",
           "CHECKPOINT_FORMAT", "MARKER"]

CHECKPOINT_FORMAT = "meshplan.checkpoint/1"
MARKER = "meshplan_checkpoint.json"
_STATE = "state"
_PARTIAL = ".meshplan-partial"
_OLD = ".meshplan-old"


# ---------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------

def save_state(path: str | os.PathLike[str], state: Any, *, overwrite: bool = False) -> str:
    """Save the pytree ``state`` (jax or NumPy arrays, any sharding) to the
    directory ``path``; returns the absolute path.

    The checkpoint appears at ``path`` only once it is complete (see the
    module doc).  An existing checkpoint at ``path`` is refused unless
    ``overwrite=True``.
    """
    import orbax.checkpoint as ocp

    final = _abs(path)
    partial, old = final + _PARTIAL, final + _OLD
    primary = jax.process_index() == 0
    if os.path.exists(final):
        if not overwrite:
            raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it "
                                  "or save to a new directory (e.g. one per step)")
        if not (os.path.isdir(final) and (os.path.isfile(os.path.join(final, MARKER))
                                          or not os.listdir(final))):
            raise CheckpointError(f"{final} exists and is not a meshplan checkpoint; "
                                  "overwrite=True replaces checkpoints only: remove it yourself "
                                  "or choose another path")
    leaves = _leaf_table(state)
    # (orbax stores numeric arrays: a typed PRNG key is stored as its key
    # data, and the marker records its implementation to wrap it again; the
    # data is stored as the marker records it: a Python scalar as jax.jit takes it)
    state = jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if _is_key(x)
        else np.asarray(x, _dtype(x)) if _python_scalar(x) else x, state)
    if primary:
        # a save killed earlier leaves its partial directory behind: clear it
        shutil.rmtree(partial, ignore_errors=True)
        try:
            os.makedirs(partial)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {partial}: "
                                  f"{e.strerror}; save to a path in a writable directory") from None
    _barrier("meshplan_save_start")
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        checkpointer.save(os.path.join(partial, _STATE), args=ocp.args.StandardSave(state))
    finally:
        checkpointer.close()
    _barrier("meshplan_save_written")
    if primary:
        _write_marker(partial, leaves)
        _fsync_dir(partial)
        had_old = os.path.exists(final)
        if had_old:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        _fsync_dir(os.path.dirname(final))
        if had_old:
            shutil.rmtree(old, ignore_errors=True)
    _barrier("meshplan_save_committed")
    return final


def _write_marker(directory: str, leaves: list[dict[str, Any]]) -> None:
    body = json.dumps({"format": CHECKPOINT_FORMAT, "complete": True,
                       "process_count": jax.process_count(), "leaves": leaves}, indent=1)
    target = os.path.join(directory, MARKER)
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


# ---------------------------------------------------------------------------
# restoring
# ---------------------------------------------------------------------------

def restore_state(path: str | os.PathLike[str], like: Any, plan: Any = None, *,
                  argnum: int = 0) -> Any:
    """The state saved at ``path``, shaped like ``like`` (a state or its
    ``jax.ShapeDtypeStruct`` tree) and placed for ``plan``.

    ``plan`` is a :class:`~meshplan.Plan`, a parallelized step (its ``.plan``
    is used: call it once first, or pass ``step.plan_for(state, batch)``),
    or ``None`` (keep ``like``'s shardings).  ``argnum`` is the position of
    the state among the train step's arguments.  Every array is read straight
    onto its sharding under the plan, bit-exact.

    Raises :class:`~meshplan.CheckpointError` when ``path`` holds no complete
    checkpoint or its leaves do not match ``like``, and
    :class:`~meshplan.StalePlanError` when a spec of the plan cannot split a
    leaf.
    """
    import orbax.checkpoint as ocp

    final = _abs(path)
    info = checkpoint_info(final)
    want = _leaf_table(like)
    _check_leaves(final, info["leaves"], want)
    shardings = shardings_for(like, plan, argnum=argnum)
    saved = {d["path"]: d for d in info["leaves"]}

    def stored(path: Any, x: Any, s: Any) -> jax.ShapeDtypeStruct:
        if _is_key(x):      # its key data, the leaf's sharding on its leading dimensions
            return jax.ShapeDtypeStruct(tuple(saved[jax.tree_util.keystr(path)]["key_data"]),
                                        np.uint32, sharding=s)
        return jax.ShapeDtypeStruct(tuple(np.shape(x)), _dtype(x), sharding=s)

    def rewrapped(path: Any, x: Any, got: Any) -> Any:
        if not _is_key(x):
            return got
        return jax.random.wrap_key_data(got, impl=saved[jax.tree_util.keystr(path)]["impl"])

    target = jax.tree_util.tree_map_with_path(stored, like, shardings)
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        got = checkpointer.restore(os.path.join(final, _STATE),
                                   args=ocp.args.StandardRestore(target))
        return jax.tree_util.tree_map_with_path(rewrapped, like, got)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the checkpoint at {final}: {type(e).__name__}: "
                              f"{e}") from e
    finally:
        checkpointer.close()


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The marker of the complete checkpoint at ``path`` (format, leaves);
    :class:`~meshplan.CheckpointError` when there is none."""
    final = _abs(path)
    marker = os.path.join(final, MARKER)
    if not os.path.isdir(final):
        hint = ""
        if os.path.isdir(final + _PARTIAL):
            hint = (f"; {final + _PARTIAL} holds an interrupted save, which is incomplete and "
                    "cannot be restored")
        if os.path.isfile(os.path.join(final + _OLD, MARKER)):
            hint += (f"; the previous complete checkpoint was moved to {final + _OLD} by an "
                     "overwrite that did not finish: restore from there")
        raise CheckpointError(f"no checkpoint at {final}{hint}")
    try:
        with open(marker) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{final} is not a complete meshplan checkpoint (no {MARKER}): the save that wrote "
            "it did not finish, or it was not written by meshplan.save_state") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{final}: unreadable {MARKER}: {e}") from e
    if not isinstance(info, dict) or info.get("format") != CHECKPOINT_FORMAT:
        fmt = info.get("format") if isinstance(info, dict) else None
        raise CheckpointError(f"{final}: checkpoint format {fmt!r} is not supported by this "
                              f"meshplan (it reads {CHECKPOINT_FORMAT!r})")
    if info.get("complete") is not True or not isinstance(info.get("leaves"), list):
        raise CheckpointError(f"{final}: the checkpoint is not marked complete")
    return info


def _check_leaves(where: str, saved: Sequence[Mapping[str, Any]],
                  want: Sequence[Mapping[str, Any]]) -> None:
    have = {d["path"]: d for d in saved}
    need = {d["path"]: d for d in want}
    missing = [p for p in need if p not in have]
    extra = [p for p in have if p not in need]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the state has leaves the checkpoint lacks: {_few(missing)}")
        if extra:
            parts.append(f"the checkpoint has leaves the state lacks: {_few(extra)}")
        raise CheckpointError(f"{where} was saved from another state structure; "
                              + "; ".join(parts))
    for p, d in need.items():
        s = have[p]
        if list(s["shape"]) != list(d["shape"]) or not _same_dtype(s, d):
            raise CheckpointError(
                f"{where}: leaf {p or '<root>'} was saved as {s['dtype']}{list(s['shape'])}, but "
                f"the state wants {d['dtype']}{list(d['shape'])}")


def _same_dtype(saved: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether a leaf saved as ``saved`` restores as ``want``: the same dtype,
    or a scalar saved in 64 bits where jax takes it in 32 (a Python number,
    which earlier versions stored as NumPy gives it: int64, float64)."""
    if saved["dtype"] == want["dtype"]:
        return True
    if list(saved["shape"]) or "impl" in saved:
        return False
    try:
        return str(jax.dtypes.canonicalize_dtype(np.dtype(saved["dtype"]))) == want["dtype"]
    except TypeError:
        return False


# ---------------------------------------------------------------------------
# shardings under a plan
# ---------------------------------------------------------------------------

def shardings_for(like: Any, plan: Any = None, *, argnum: int = 0) -> Any:
    """A pytree like ``like`` of the sharding each leaf gets under ``plan``
    (see the module doc for the rule)."""
    plan = _as_plan(plan)
    if plan is None:
        return jax.tree_util.tree_map(_own_sharding, like)
    if not plan.stages:
        raise StalePlanError("the plan has no stages; re-plan")
    from meshplan.runtime.shard import build_mesh, check_spec, stage_devices

    meshes: dict[int, Any] = {}

    def mesh_of(k: int) -> Any:
        if k not in meshes:
            stage = plan.stages[k]
            meshes[k] = build_mesh(stage.logical_mesh, stage_devices(stage))
        return meshes[k]

    prefix = _prefix(plan, argnum)
    owners = _owners(plan.stages)

    def one(path: Any, leaf: Any) -> NamedSharding:
        key = prefix + jax.tree_util.keystr(path)
        owner = owners.get(key)
        if owner is None:
            return NamedSharding(mesh_of(0), PartitionSpec())
        k, spec = owner
        check_spec(spec, np.shape(leaf), plan.stages[k].logical_mesh,
                   f"state leaf {key or '<root>'} (stage {k})")
        return NamedSharding(mesh_of(k), PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, like)


def _owners(stages: Sequence[Stage]) -> dict[str, tuple[int, Spec]]:
    """key -> (index of the stage that owns it, its spec there): the first
    stage whose ``params`` name it."""
    out: dict[str, tuple[int, Spec]] = {}
    for k, stage in enumerate(stages):
        for key, spec in stage.params:
            out.setdefault(key, (k, spec))
    return out


def _prefix(plan: Plan, argnum: int) -> str:
    """The key prefix of argument ``argnum``'s leaves in the plan's tables."""
    given = dict(plan.arg_prefixes)
    if argnum in given:
        return given[argnum]
    if argnum in plan.batch_argnums:
        raise CheckpointError(f"argument {argnum} is a batch argument of the plan "
                              f"(batch_argnums={plan.batch_argnums}), not the train state")
    # the non-batch arguments the plan names, numbered among themselves
    named = {argnum} | {a for a, _ in plan.arg_prefixes}
    return dict(section_prefixes(named, plan.batch_argnums))[argnum]


def _as_plan(plan: Any) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    got = getattr(plan, "plan", None)
    if isinstance(got, Plan):
        return got
    if hasattr(plan, "plan_for"):
        raise CheckpointError("this parallelized step has no plan yet: call it once, or pass "
                              "plan=step.plan_for(state, batch)")
    raise CheckpointError(f"plan= takes a meshplan.Plan or a parallelized step, not "
                          f"{type(plan).__name__}")


def _own_sharding(leaf: Any) -> Any:
    s = getattr(leaf, "sharding", None)
    if s is not None:
        return s
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _is_key(x: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``), or its ShapeDtypeStruct."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _dtype(x: Any) -> Any:
    d = getattr(x, "dtype", None)
    if _is_key(x):
        return d
    # (a Python scalar: as jax.jit takes it, int32 or float32 unless x64 is on)
    return np.dtype(d) if d is not None else jit_dtype(x)


def _python_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex)) and not hasattr(x, "dtype")


def _leaf_table(tree: Any) -> list[dict[str, Any]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        entry = {"path": jax.tree_util.keystr(path),
                 "shape": [int(s) for s in np.shape(leaf)],
                 "dtype": str(_dtype(leaf))}
        if _is_key(leaf) and isinstance(leaf, jax.Array):
            entry["impl"] = str(jax.random.key_impl(leaf))
            entry["key_data"] = [int(s) for s in jax.random.key_data(leaf).shape]
        out.append(entry)
    return out


def _few(items: Sequence[str], n: int = 4) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _abs(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(path)).rstrip(os.sep) or os.sep


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
