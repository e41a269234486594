"""Gradient accumulation: what runs every micro-batch is charged every
micro-batch, what runs once a step once (issues 19 and 23).

The parameters here are pinned split over the data axis (ZeRO-3-like), so
the forward and backward must gather them (or reshard the activations
instead) on every micro-batch.  The optimizer update joins each parameter's
group in the ILP (it follows the parameter), which once made every read of
the parameter look like the update's and cost ``1 / grad_accum``."""
from __future__ import annotations

import pytest

import meshplan
from meshplan.cost_model.mesh import mesh_model
from meshplan.graph import BATCH, PARAM, strip_markers
from meshplan.ilp import build_problem, explain, solve
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

ACCUM = 4
TWO_LAYERS = {"batch": "64", "in_dim": "256", "hidden": "1024", "layers": "2"}
GPT = {"batch": "8", "layers": "1", "optimizer": "sgd"}


def _zero3(inp, spec, _) -> bool:
    """The batch split along its first dimension, the parameters split along
    some dimension (the ILP picks which), the optimizer state as it likes."""
    if inp.role == BATCH:
        return bool(spec) and spec[0] == (0,) and not any(spec[1:])
    return any(spec) if inp.role == PARAM else True


def _update_nodes(g, grads) -> set[int]:
    """The operators reading a gradient or a value made from one."""
    later, out = set(grads), set()
    for n in g.nodes:
        if any(t in later for t in n.inputs):
            later.update(n.outputs)
            out.add(n.id)
    return out


def _built(config: dict, mesh: LogicalMesh, input_filter, model: str = "mlp"):
    """An MLP's (``model``'s) step on ``mesh`` of a DGX A100, its gradients,
    and its ILP built for one micro-batch and for ACCUM."""
    m = build_model(model, config)
    g = trace(m.train_step, *m.abstract_args)
    grads = frozenset(t for n in g.nodes if n.primitive == "meshplan_grad_boundary"
                      for t in n.inputs)
    g = strip_markers(g)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    mm = mesh_model(cluster, mesh)
    once = build_problem(g, mm, input_filter=input_filter, accumulate=grads, grad_accum=1)
    accum = build_problem(g, mm, input_filter=input_filter, accumulate=grads, grad_accum=ACCUM)
    return g, mm, grads, once, accum


@pytest.fixture(scope="module")
def problems():
    return _built({"batch": "512", "in_dim": "64", "hidden": "64", "layers": "1"},
                  LogicalMesh(("data",), (8,)), _zero3)


def test_reads_of_a_parameter_by_the_forward_and_backward_cost_every_micro_batch(problems):
    g, _, grads, once, accum = problems
    params = {i.tensor for i in g.inputs if i.role == PARAM}
    upd = _update_nodes(g, grads)
    pgroups = {accum.group_of_tensor[t] for t in params}
    # the trap: the update's operators joined the parameters' groups
    assert pgroups & accum.per_iteration
    e1 = {(u, v): b for u, v, _, b in once.edge_costs}
    checked = 0
    for u, v, _, b4 in accum.edge_costs:
        root = accum.groups[v].root_node
        if u in pgroups and root is not None and root not in upd and e1[u, v].any():
            assert (b4 == e1[u, v]).all(), accum.groups[v].name   # not divided by ACCUM
            checked += 1
    assert checked >= 2      # the forward's and the backward's matmuls read the weight


def test_the_chosen_plan_charges_its_parameter_gathers_per_micro_batch(problems):
    g, mm, grads, once, accum = problems
    params = {i.tensor for i in g.inputs if i.role == PARAM}
    choice = solve(accum.problem, backend="highs", time_limit=30).choice
    per_mb = {(pc.key, pc.where): pc.nbytes for pc in explain(g, mm, once, choice)}
    got = explain(g, mm, accum, choice)
    gathers = [pc for pc in got if pc.tensor in params and pc.kind == "all-gather"]
    assert gathers
    for pc in gathers:      # the forward's and backward's, every micro-batch
        assert pc.nbytes == pytest.approx(per_mb[pc.key, pc.where]), pc.where
        assert not pc.per_step
    for pc in got:
        full = per_mb[pc.key, pc.where] if pc.key else None
        if pc.per_step:
            # the gradient reductions, the update and the new values' reshardings
            if full is not None:
                assert pc.nbytes == pytest.approx(full / ACCUM)
        elif full is not None:
            assert pc.nbytes == pytest.approx(full)
    # the gradient reduction (a reduce-scatter into the split parameters'
    # layout, or an all-reduce) is still paid once a step
    assert any(pc.per_step and pc.kind in ("reduce-scatter", "all-reduce") for pc in got)


@pytest.fixture(scope="module")
def tensor_parallel():
    """A 2-layer MLP with bias on 8 devices, the batch whole: the ILP may split
    the hidden units, so the backward reduces input gradients as well as
    weight gradients."""
    whole = lambda inp, spec, _: inp.role != BATCH or not any(spec)  # noqa: E731
    return _built(TWO_LAYERS, LogicalMesh(("model",), (8,)), whole)


def test_only_the_operators_of_parameter_gradients_may_wait_for_the_last_micro_batch(
        tensor_parallel):
    g, _, grads, _, accum = tensor_parallel
    made = {t: n for n in g.nodes for t in n.outputs}
    # every gradient's maker is a gradient operator; no operator of the
    # forward is, nor one whose result also feeds the loss or another layer
    assert all(made[t].id in accum.grad_nodes for t in grads if t in made)
    dots = [n for n in g.nodes if n.primitive == "dot_general"]
    weights = [i for i in g.inputs if i.role == PARAM and len(g.tensors[i.tensor].shape) == 2]
    # one weight-gradient matmul per weight; the forward's and the input
    # gradients' matmuls are not gradient operators
    assert len([n for n in dots if n.id in accum.grad_nodes]) == len(weights)
    assert len(dots) > 2 * len(weights)
    for nid in accum.grad_nodes:
        node = g.nodes[nid]
        # (its results end in gradients only: none is an output but a gradient)
        assert not (set(node.outputs) & {o.tensor for o in g.outputs}) - grads


def test_an_input_gradient_reduction_is_charged_every_micro_batch(tensor_parallel):
    g, _, grads, once, accum = tensor_parallel
    checked = 0
    for g1, g4 in zip(once.groups, accum.groups):
        if g4.gid not in accum.accumulated:
            continue
        for i in range(g4.size):
            other = g1.comm[i] - g1.grad_comm[i]
            # the gradient reductions at 1/ACCUM, the rest (an input gradient's
            # all-reduce in the same group) in full
            assert g4.comm[i] == pytest.approx(other + g1.grad_comm[i] / ACCUM)
            checked += other > 0 and g1.grad_comm[i] >= 0
    assert checked, "no group mixes an input-gradient reduction with a gradient's"


def test_only_sums_over_the_batch_axes_wait_for_the_last_micro_batch():
    """The runtime keeps partial gradient sums over the axes the batch is
    split on (runtime.pipeline_partial), not over a tensor-parallel axis: a
    weight gradient summed over ``model`` (tokens split there) is reduced
    every micro-batch, and the ILP charges it so."""
    from meshplan.ilp import InputLayouts
    from meshplan.ilp.accumulation import summed_axes
    from meshplan.ilp.strategies import merged_comm_s
    _, mm, _, once, accum = _built(TWO_LAYERS, LogicalMesh(("data", "model"), (2, 4)),
                                   InputLayouts("model"))
    kinds = set()
    for g1, g4 in zip(once.groups, accum.groups):
        if g4.root_node not in accum.grad_nodes:
            continue
        for i, s in enumerate(g4.strategies):
            axes = summed_axes(s.name, mm.mesh.axes)
            if not s.comm_s or not axes:
                continue
            if axes <= {0}:     # (less what the merged gradient reductions pay once)
                assert g4.grad_comm[i] == pytest.approx(merged_comm_s(mm, s)[0])
            else:
                assert g4.grad_comm[i] == 0.0
                assert g4.comm[i] == pytest.approx(g1.comm[i])   # not divided
            kinds.add(axes <= {0})
    assert kinds == {True, False}


def test_a_searched_plan_defers_only_sums_over_axes_that_cut_the_rows():
    """A searched layer ILP may lay the batch out over any axis; the runtime
    keeps a gradient's partial sums over an axis only where that axis cuts
    the micro-batch's rows (it replays the backward per data shard).  With
    the rows known (``Graph.batch_dims``), a sum over an axis that cuts the
    tokens' other dimensions is charged every micro-batch; without them
    (the old rule) every sum of a gradient operator waits."""
    import dataclasses

    from meshplan.graph import batch_dims_between
    from meshplan.ilp.accumulation import rows_axes, summed_axes
    mesh = LogicalMesh(("data", "model"), (2, 4))
    # (gpt: a weight gradient contracts over the batch and the sequence)
    full, mm, grads, _, _ = _built(GPT, mesh, None, "gpt")
    half = build_model("gpt", {**GPT, "batch": "4"})
    micro = strip_markers(trace(half.train_step, *half.abstract_args))
    dims = batch_dims_between(full, micro, 2)
    assert dims, "the two traces should align"
    g = dataclasses.replace(micro, batch_dims=tuple(sorted(dims.items())))
    blind = build_problem(micro, mm, accumulate=grads, grad_accum=ACCUM)
    known = build_problem(g, mm, accumulate=grads, grad_accum=ACCUM)
    seen = set()
    for gb, gk in zip(blind.groups, known.groups):
        if gk.root_node not in known.grad_nodes:
            continue
        node = g.nodes[gk.root_node]
        for i, s in enumerate(gk.strategies):
            axes = summed_axes(s.name, mm.mesh.axes)
            if not s.comm_s or not axes:
                continue
            cut = {a for t, sp in zip(node.inputs, s.in_specs)
                   if sp is not None and t in dims for a in sp[dims[t]]}
            assert rows_axes(g, node.inputs, s.in_specs) == frozenset(cut)
            assert gb.grad_comm[i] > 0          # (the old rule: any axis waits)
            assert gk.grad_comm[i] == (gb.grad_comm[i] if axes <= cut else 0.0)
            assert gk.waits[i] == (axes if axes <= cut else frozenset())
            seen.add(axes <= cut)
    assert seen == {True, False}
