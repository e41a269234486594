"""Recomputation in a one-program plan (meshplan.runtime.remat): Manual(pp=1)
with remat prices it through the stage DP, the program recomputes layer by
layer with the plain step's numbers, and XLA's memory analysis confirms the
saving (float32, SGD)."""
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshplan
from meshplan.models import build_model
from meshplan.runtime import ShardExecutable

from _steps import losses_match

ROOT = pathlib.Path(__file__).resolve().parents[1]
DGX = str(ROOT / "examples" / "clusters" / "dgx-a100-x1.json")
GPT = {"optimizer": "sgd", "layers": "2", "hidden": "32", "seq_len": "16", "vocab": "64",
       "batch": "16"}
KINDS = ("none", "selective", "full")


@functools.lru_cache(maxsize=None)
def _priced(remat):
    m = build_model("gpt", GPT)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(DGX),
                         method=meshplan.Manual(dp=2, tp=4, remat=remat))


def test_one_stage_manual_prices_each_choice():
    plans = {k: _priced(k) for k in KINDS}
    for k, p in plans.items():
        assert len(p.stages) == 1 and p.num_micro_batches == 1
        assert p.stages[0].recompute == k
    # (none is planned by the whole-graph ILP, as before: its memory model is
    # not the layer sum's, so only its time is compared)
    act = {k: p.stages[0].predicted.memory.activations for k, p in plans.items()}
    assert act["selective"] > act["full"], act
    t = {k: p.predicted.iteration_s for k, p in plans.items()}
    assert t["none"] < t["selective"] < t["full"], t


@functools.lru_cache(maxsize=None)
def _model():
    m = build_model("gpt", GPT)
    state, batch = jax.device_get(m.init(0))
    return m, state, batch


@pytest.mark.parametrize("kind", ["selective", "full"])
def test_one_program_recomputes_with_the_plain_steps_numbers(kind):
    m, state, batch = _model()
    plan = _priced(kind)
    step = meshplan.parallelize(m.train_step, plan=plan)
    s, r = losses_match(step, state, batch, m.train_step)
    ex = step._fast[1]
    assert isinstance(ex, ShardExecutable) and ex.replay is not None
    # the copy sits behind a barrier (as jax.checkpoint's): XLA cannot merge it
    assert "optimization_barrier" in ex.lower(state, batch).as_text()
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(r)), jax.tree_util.tree_leaves(s)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(a))), 1e-3) < 1e-5


_MEMORY = r"""
import dataclasses, json, sys
import meshplan
from meshplan.models import build_model
from meshplan.tools.verify import compiled_memory
# (long sequences: the attention scores dominate what the backward reads)
m = build_model("gpt", {"optimizer": "sgd", "layers": "4", "hidden": "64", "seq_len": "256",
                        "vocab": "128", "batch": "16", "heads": "8"})
plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(sys.argv[1]),
                     method=meshplan.Manual(dp=2, tp=4, remat="full"))
temp = {}
for kind in ("none", "selective", "full"):
    p = dataclasses.replace(plan, stages=tuple(dataclasses.replace(
        s, remat=kind != "none", recompute=kind) for s in plan.stages))
    step = meshplan.parallelize(m.train_step, plan=p, donate_argnums=(0,))
    temp[kind] = compiled_memory(step.lower(*m.abstract_args).compile())[1]["temp"]
print(json.dumps(temp))
"""


@pytest.mark.slow
def test_memory_analysis_confirms_the_saving():
    # one plan's layouts, its recomputation swapped: XLA's temporaries shrink
    # none > selective > full (with the CPU's memory-aware scheduler, see
    # meshplan.tools.remat_memory)
    from meshplan.tools.remat_memory import SCHEDULER_FLAG
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {SCHEDULER_FLAG}")
    out = subprocess.run([sys.executable, "-c", _MEMORY, DGX], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    temp = json.loads(out.strip().splitlines()[-1])
    assert temp["none"] > temp["selective"] > temp["full"], temp


@pytest.mark.extended
def test_shard_parallel_recomputes_on_its_fixed_mesh_with_the_plain_steps_numbers():
    # ShardParallel(remat=...) keeps its mesh, lets the ILP choose the layouts
    # (weights may split over both axes, unlike Manual's), and recomputes
    m, state, batch = _model()
    cluster = meshplan.load_cluster(DGX)
    plan = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                         method=meshplan.ShardParallel(mesh_shape=(4, 2), remat="full"))
    assert plan.method == "shard" and len(plan.stages) == 1 and plan.num_micro_batches == 1
    assert plan.stages[0].logical_mesh.shape == (4, 2)
    assert plan.stages[0].recompute == "full"
    plain = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                          method=meshplan.ShardParallel(mesh_shape=(4, 2)))
    assert plain.stages[0].recompute == "none"
    step = meshplan.parallelize(m.train_step, plan=plan)
    s, metrics = step(state, batch)
    r, ref_metrics = jax.jit(m.train_step)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert step._fast[1].replay is not None


@pytest.mark.parametrize("bad", ["sometimes", 2])
def test_shard_parallel_refuses_an_unknown_remat(bad):
    with pytest.raises(meshplan.MeshplanError, match="ShardParallel.remat="):
        meshplan.ShardParallel(remat=bad)
