"""The runtime gives each reader its operand as the plan priced it.

* ``runtime.reads.read_layouts``: a read the cost model prices as XLA's
  fallback (gather whole, then slice) gets the replicated layout first;
  other reads get their layout alone.
* The main job (``meshplan run --model gpt`` on 8 devices, Auto) compiles
  without XLA's "involuntary full rematerialization" fallback: a value made
  in one layer and read by the next in another layout is constrained as the
  reading layer takes it (``dp_search.assemble``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from meshplan.plan import LogicalMesh
from meshplan.runtime.reads import read_layouts
from meshplan.traced import FlatEqn, FlatJaxpr


def _stage(operand_spec, read_spec):
    # t0 (input) -> t1 = f(t0) pinned to operand_spec -> t2 = g(t1), read as read_spec
    eqns = (FlatEqn(None, (0,), (1,), False, ""), FlatEqn(None, (1,), (2,), False, ""))
    avals = {t: SimpleNamespace(shape=(4, 8, 16)) for t in range(3)}
    flat = FlatJaxpr(invars=(0,), constvars=(), consts=(), eqns=eqns, outvars=(2,), avals=avals)
    stage = SimpleNamespace(logical_mesh=LogicalMesh(("x", "y"), (2, 2)),
                            constraints=((1, operand_spec), (2, read_spec)),
                            read_constraints=((2, 0, read_spec),))
    return stage, flat


def test_a_read_gathered_whole_is_replicated_first():
    # the hidden split over (x, y) -> the batch over y: y leaves a dimension
    # that also loses x, which XLA (and the cost model) does by gathering whole
    stage, flat = _stage((None, None, ("x", "y")), ("y", None, None))
    assert read_layouts(stage, flat) == {2: [(0, (None, None, None)), (0, ("y", None, None))]}


def test_an_axis_dropped_before_another_is_sliced_in_is_replicated_first():
    # channels over x -> the batch over y (a residual join's cotangent read by
    # a strided shortcut's gradient in wresnet): priced as gathered over x,
    # then sliced; left to XLA it warned of an involuntary rematerialization
    stage, flat = _stage((None, None, "x"), ("y", None, None))
    assert read_layouts(stage, flat) == {2: [(0, (None, None, None)), (0, ("y", None, None))]}


def _specs(rank, axes):
    """Every layout of a rank-``rank`` tensor over mesh ``axes`` (each axis
    on at most one dimension, in either order)."""
    import itertools
    out = set()
    for where in itertools.product(range(rank + 1), repeat=len(axes)):
        for order in itertools.permutations(axes):
            dims = [[] for _ in range(rank)]
            for a in order:
                if where[a] < rank:
                    dims[where[a]].append(a)
            out.add(tuple(tuple(d) for d in dims))
    return sorted(out)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2)])
def test_the_runtime_goes_through_the_whole_tensor_where_the_cost_model_does(shape):
    # (the runtime cannot import the cost model: layout_moves decides it for
    # both; here checked against the cost model's own steps)
    from meshplan.cost_model.sharding import reshard_moves
    from meshplan.layout_moves import through_whole
    for rank in (2, 3):
        specs = _specs(rank, range(len(shape)))
        for src in specs:
            for dst in specs:
                moves, _ = reshard_moves(shape, src, dst)
                whole = any(dst) and any(kind == "all-gather" and not any(after)
                                         for kind, _, _, after in moves)
                assert through_whole(shape, src, dst) == whole, (src, dst, moves)


WRESNET = """
import jax, meshplan
from meshplan.models import build_model
m = build_model("wresnet", {"num_stages": 2, "layers": 6, "optimizer": "sgd"})
state, batch = m.init(0)
step = meshplan.parallelize(m.train_step, method=meshplan.Manual(dp=2, tp=4))
jax.block_until_ready(step(state, batch))
print("ran")
"""


@pytest.mark.extended   # (a subprocess: XLA's warning is its C++ stderr)
def test_a_wresnet_plan_compiles_without_xlas_fallback():
    proc = subprocess.run([sys.executable, "-c", WRESNET], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-2000:]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("src, dst", [
    (("y", None, None), (None, None, ("x", "y"))),   # a slice and an all-to-all
    ((None, None, "x"), (None, None, None)),          # one all-gather
    (("y", None, "x"), ("y", None, None)),
])
def test_other_reads_keep_their_one_layout(src, dst):
    stage, flat = _stage(src, dst)
    assert read_layouts(stage, flat) == {2: [(0, dst)]}


@pytest.mark.slow   # (plans and runs the main job: about a minute)
def test_the_main_job_compiles_without_xlas_fallback(tmp_path):
    env_flags = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "run", "--model", "gpt"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": env_flags, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK" in proc.stdout.splitlines()[-1]
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-2000:]
