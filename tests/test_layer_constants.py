"""Values made from constants alone (causal masks, broadcast literals) in a
pipeline: each layer that reads one computes its own copy, no layer pays for
another layer's reads or for one nobody reads, none crosses between stages --
so the last stage is not overcharged (issue 16, item 5) -- and the pipeline
still computes the plain step."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from meshplan.dp_search.layers import (assign_layers, crossing_values, layer_subgraph,
                                       unmarked_view)
from meshplan.markers import mark_pipeline_boundary, value_and_grad
from meshplan.models import build_model
from meshplan.trace import trace

from test_pipeline_runtime import _assert_close, _run

CLUSTER = "examples/clusters/dgx-a100-x1.json"
GPT = {"hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 8}


@functools.lru_cache(maxsize=None)
def _gpt(blocks: int):
    m = build_model("gpt", dict(GPT, layers=blocks))
    return m, trace(m.train_step, *m.abstract_args)


S, H, B = 16, 32, 8


def _shared_mask_step(blocks: int):
    """Blocks (one layer each: marked) that all read one causal mask, made
    once before the first."""
    opt = optax.sgd(0.1)

    def loss_fn(p, x):
        h = jnp.tanh(x @ p["emb"])
        mask = jnp.tril(jnp.ones((S, S), bool))       # in the first layer, read by the others
        for i in range(blocks):
            h = mark_pipeline_boundary(h)
            q = jnp.tanh(h @ p[f"w{i}"])
            s = jnp.where(mask, jnp.einsum("bsh,bth->bst", q, h), -1e9)
            h = h + jnp.einsum("bst,bth->bsh", jax.nn.softmax(s, axis=-1), q)
        h = mark_pipeline_boundary(h)
        return jnp.mean((h @ p["head"]) ** 2)

    def step(state, x):
        loss, g = value_and_grad(loss_fn)(state["params"], x)
        u, o = opt.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt_state": o}, {"loss": loss}

    keys = jax.random.split(jax.random.PRNGKey(0), blocks + 3)
    p = {"emb": jax.random.normal(keys[0], (H, H)) / H ** 0.5,
         "head": jax.random.normal(keys[1], (H, 4)) / H ** 0.5}
    p.update({f"w{i}": jax.random.normal(keys[2 + i], (H, H)) / H ** 0.5 for i in range(blocks)})
    x = jax.random.normal(keys[-1], (B, S, H))
    return step, {"params": p, "opt_state": opt.init(p)}, x


def _per_layer_costs(fn, *args, layers: int) -> list[float]:
    """Each layer's predicted time, as a pipeline of one layer per stage on
    one device per stage gives it."""
    cluster = meshplan.load_cluster(CLUSTER).with_devices(1, layers)
    p = meshplan.plan(fn, *args, cluster=cluster,
                      method=meshplan.Manual(dp=1, tp=1, pp=layers, num_micro_batches=2,
                                             remat=False))
    assert [s.layers for s in p.stages] == [(l, l) for l in range(layers)]
    return [s.predicted.compute_s + s.predicted.comm_s for s in p.stages]


@pytest.mark.parametrize("blocks", [2, 4])
def test_no_layer_keeps_or_sends_a_constant_it_does_not_read(blocks):
    for g in (_gpt(blocks)[1], trace(*_shared_mask_step(blocks))):
        lay = assign_layers(g)
        assert lay.num_layers == blocks + 2
        view = unmarked_view(g, lay)
        const = view.graph.constant_tensors
        subs = [layer_subgraph(g, lay, l, l, view) for l in range(lay.num_layers)]
        for sub in subs:
            read = {t for n in sub.nodes if n.id not in sub.constant_nodes for t in n.inputs}
            made = {t for n in sub.nodes for t in n.outputs}
            # every constant value a layer computes is read by its other work
            # (transitively through other constant values) ...
            assert sub.constant_tensors <= made
            needed, stack = set(), [t for t in read if t in const]
            while stack:
                t = stack.pop()
                if t in needed:
                    continue
                needed.add(t)
                p = view.graph.producer.get(t)
                stack.extend(x for x in view.graph.nodes[p].inputs if x in const)
            assert {t for t in made if t in const} == needed
            # ... and neither enters nor leaves it
            assert not any(i.tensor in const for i in sub.inputs)
            assert not any(o.tensor in const for o in sub.outputs)
        assert not any(t in const for c in crossing_values(g, lay, subs, view) for t in c)


def test_the_head_layer_does_not_pay_for_the_blocks_constants():
    """Per-block layers: the embedding's and the head's costs do not grow
    with the number of blocks (the gpt's ``jnp.where`` leaves one unread zero
    cotangent of the scores' shape per block; none may land on the head),
    and the blocks cost alike."""
    costs = {n: _per_layer_costs(_gpt(n)[0].train_step, *_gpt(n)[0].abstract_args,
                                 layers=n + 2) for n in (2, 4)}
    for c in costs.values():
        assert c[1:-1] == pytest.approx([c[1]] * (len(c) - 2), rel=1e-9)
    assert costs[4][0] == pytest.approx(costs[2][0], rel=1e-9)
    assert costs[4][1] == pytest.approx(costs[2][1], rel=1e-9)
    assert costs[4][-1] == pytest.approx(costs[2][-1], rel=1e-9)
    # and the head layer is one problem whatever the depth: one ILP for both
    h2, h4 = (layer_subgraph(g, lay, lay.num_layers - 1, lay.num_layers - 1).fingerprint
              for g in (_gpt(2)[1], _gpt(4)[1]) for lay in (assign_layers(g),))
    assert h2 == h4


def test_a_shared_constant_is_paid_by_each_reader_only():
    """One mask read by every block: the layer that makes it (the first, which
    does not read it) pays nothing for it; no layer's cost grows with the
    number of layers reading it."""
    costs = {n: _per_layer_costs(*_shared_mask_step(n), layers=n + 2) for n in (2, 4)}
    # (the matmuls of a block's backward that read the block's input, made
    # by the block below, run in the block, with the gradients they read:
    # all blocks cost alike)
    assert costs[4][1:-1] == pytest.approx([costs[4][1]] * 4, rel=1e-9)
    for l in (0, 1, -2, -1):
        assert costs[4][l] == pytest.approx(costs[2][l], rel=1e-9)


@pytest.mark.parametrize("stages", [2, 3])
def test_each_stage_costs_the_sum_of_its_own_layers(stages):
    m, g = _gpt(4)
    per_layer = _per_layer_costs(m.train_step, *m.abstract_args, layers=6)
    cluster = meshplan.load_cluster(CLUSTER).with_devices(1, stages)
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.Manual(dp=1, tp=1, pp=stages, num_micro_batches=2,
                                             remat=False))
    assert len(p.stages) == stages and p.stages[-1].layers[1] == 5
    for s in p.stages:
        first, last = s.layers
        assert s.predicted.compute_s + s.predicted.comm_s == pytest.approx(
            sum(per_layer[first:last + 1]), rel=1e-9)
    # the last stage (head + blocks) costs no more than a middle one plus the head
    if stages == 3:
        head, block = per_layer[-1], per_layer[1]
        last = p.stages[-1]
        assert last.predicted.compute_s + last.predicted.comm_s == pytest.approx(
            head + block * (last.layers[1] - last.layers[0]), rel=1e-9)


@pytest.mark.extended
def test_a_pipeline_of_one_layer_per_stage_equals_the_plain_step():
    # the gpt of the pipeline runtime tests: embedding, two blocks, head
    from test_pipeline_runtime import _plan
    plan = _plan("gpt", 1, 2, 4, 2, "1f1b")
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    _, state, losses = _run("gpt", plan)
    _assert_close(state, losses, "gpt")


def test_a_constant_read_by_every_stage_is_recomputed_and_the_numbers_agree():
    step, state, x = _shared_mask_step(2)
    plan = meshplan.plan(step, state, x, method=meshplan.Manual(dp=2, tp=1, pp=4,
                                                                num_micro_batches=2))
    assert len(plan.stages) == 4
    ref_state, ref_metrics = state, None
    ref = jax.jit(step)
    got = meshplan.parallelize(step, plan=plan)
    got_state = jax.device_get(state)
    for _ in range(3):
        ref_state, ref_metrics = ref(ref_state, x)
        got_state, got_metrics = got(got_state, x)
        np.testing.assert_allclose(float(got_metrics["loss"]), float(ref_metrics["loss"]),
                                   rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref_state), jax.tree_util.tree_leaves(got_state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
