"""``meshplan plan --emit python``: a one-stage plan as a standalone Python
file that needs only jax -- the mesh, one ``PartitionSpec`` per argument
leaf and per planned output leaf, and a ``jax.jit`` with those shardings.

The file is data plus three small functions, so that it can be pasted into a
training script or imported as a module (``runpy.run_path``) with the user's
own step; it runs the step as a plain ``jax.jit`` (XLA partitions the
intermediates; meshplan's runtime also pins the plan's intermediate
layouts, so compiled programs may differ, the numbers do not).
"""
from __future__ import annotations

from typing import Mapping

from ..errors import MeshplanError
from ..plan import Plan
from ..specs import Spec, spec_str


def python_snippet(plan: Plan, num_args: int) -> str:
    """The standalone snippet of ``plan`` for a step of ``num_args`` arguments."""
    if len(plan.stages) != 1:
        raise MeshplanError(
            f"--emit python writes one-stage plans, and this plan has {len(plan.stages)} pipeline "
            "stages, which one plain jax.jit cannot run; plan with --method shard, data or manual "
            "without --pp, or run the pipeline with meshplan.parallelize (Plan.shardings gives "
            "each stage's shardings)")
    st = plan.stages[0]
    prefixes = plan.key_prefixes(num_args)
    params, batch = dict(st.params), dict(plan.batch)
    in_blocks = []
    for a in range(num_args):
        is_batch = a in plan.batch_argnums
        table, prefix = (batch if is_batch else params), prefixes.get(a, "")
        # (a section of several arguments keys them "[k]..."; "" is the whole section)
        mine = {k[len(prefix):]: s for k, s in table.items() if k.startswith(prefix)}
        in_blocks.append(f"    {{  # argument {a}{' (batch)' if is_batch else ''}\n"
                         f"{_entries(mine, 8)}    }},\n")
    return _TEMPLATE.format(
        function=plan.function or "the train step", cluster=plan.cluster.name,
        num_devices=len(st.devices), method=plan.method,
        device_ids=list(st.devices), shape=tuple(st.logical_mesh.shape),
        axes=tuple(st.logical_mesh.axes),
        in_specs="".join(in_blocks), out_specs=_entries(dict(st.outputs), 4),
        num_args=num_args)


def _entries(table: Mapping[str, Spec], indent: int) -> str:
    pad = " " * indent
    return "".join(f"{pad}{key!r}: {spec_str(spec)},\n" for key, spec in table.items())


_TEMPLATE = '''"""meshplan's plan for {function} on {cluster} ({num_devices} devices), method {method}:
the mesh and the shardings for a plain jax.jit.  Needs only jax, not meshplan.
Written by `meshplan plan ... --emit python`.

Import it (or paste it) and give it your train step and arguments (arrays or
jax.ShapeDtypeStructs, as the step takes them):

    step = jit_step(train_step, state, batch)
    state, metrics = step(state, batch)
"""
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# The plan's device ids are positions in jax.devices() sorted by id; they fill
# the mesh in row-major order.
DEVICE_IDS = {device_ids}
MESH_SHAPE = {shape}
MESH_AXES = {axes}

# One dict per argument of the step: the keystr path of a leaf inside the
# argument -> its PartitionSpec (leaves not listed are replicated).
IN_SPECS = (
{in_specs})

# The keystr path of a leaf inside the step's output -> its PartitionSpec
# (leaves not listed: jit chooses).
OUT_SPECS = {{
{out_specs}}}


def make_mesh(devices=None):
    """The plan's mesh on `devices` (default: jax.devices() sorted by id)."""
    pool = sorted(jax.devices(), key=lambda d: d.id) if devices is None else list(devices)
    if len(pool) <= max(DEVICE_IDS):
        raise ValueError(f"this plan needs {{max(DEVICE_IDS) + 1}} devices, but only "
                         f"{{len(pool)}} are available")
    grid = np.empty(len(DEVICE_IDS), dtype=object)
    grid[:] = [pool[i] for i in DEVICE_IDS]
    return Mesh(grid.reshape(MESH_SHAPE), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def shardings_like(tree, specs, mesh, default=P(), what="argument"):
    """A pytree like `tree` of NamedShardings, each leaf's spec looked up by
    its keystr path in `specs` (`default` when absent; None leaves it to jit).
    A path of `specs` that `tree` lacks is refused: the arguments are not
    those the plan was made for, and its layouts would be dropped unsaid."""
    paths = {{jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}}
    missing = sorted(k for k in specs if k not in paths)
    if missing and what == "output":
        raise ValueError(f"the plan lays out {{len(missing)}} output leaves the step does not "
                         f"return (e.g. {{missing[0]}}): it returns another structure than the "
                         "step planned; re-plan for this step")
    if missing:
        raise ValueError(f"the plan lays out {{len(missing)}} argument leaves these arguments "
                         f"lack (e.g. {{missing[0]}}); pass the arguments the plan was made for, "
                         "with the same pytree structure, or re-plan for these")

    def one(path, leaf):
        spec = specs.get(jax.tree_util.keystr(path), default)
        return None if spec is None else NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, tree)


def jit_step(train_step, *args, mesh=None, **jit_kwargs):
    """`train_step` under jax.jit with the plan's shardings, for arguments
    like `args` (other jax.jit options, e.g. donate_argnums, pass through)."""
    if len(args) != len(IN_SPECS):
        raise ValueError(f"the plan was made for a step of {{len(IN_SPECS)}} argument(s), "
                         f"got {{len(args)}}")
    mesh = make_mesh() if mesh is None else mesh
    in_shardings = tuple(shardings_like(a, s, mesh) for a, s in zip(args, IN_SPECS))
    out_shardings = shardings_like(jax.eval_shape(train_step, *args), OUT_SPECS, mesh,
                                   default=None, what="output")
    return jax.jit(train_step, in_shardings=in_shardings, out_shardings=out_shardings,
                   **jit_kwargs)


if __name__ == "__main__":
    # Plug in your train step and its {num_args} argument(s) here, e.g.
    #   from my_training import train_step, init
    #   state, batch = init()
    #   step = jit_step(train_step, state, batch)
    #   state, metrics = step(state, batch)
    print(make_mesh())
'''
