"""What layers of one stage hand each other: the micro-batch's rows of a
boundary value (cut over a hand-made method's data axis, as the pipeline
runtime cuts it) and the resharding between two layers' layouts
(dp_search.joints), checked against the compiled stage programs in
test_verify and benchmarks/verify.py's pipeline rows."""
import meshplan
from meshplan.dp_search.joints import Flow, joint_cost, layer_flows
from meshplan.dp_search.layers import BOUNDARY, assign_layers, layer_subgraph
from meshplan.graph import GraphInput, batch_dims_between
from meshplan.ilp.build import _rows_cut
from meshplan.models import build_model
from meshplan.planning import retracer
from meshplan.trace import trace


def _mlp():
    m = build_model("mlp", {"layers": "3"})
    full = trace(m.train_step, *m.abstract_args)
    micro = retracer(m.train_step, m.abstract_args, (1,), "mlp")(2)
    return m, full, micro


def test_batch_dims_between_finds_the_rows_of_every_value_cut_by_the_micro_batches():
    m, full, micro = _mlp()
    dims = batch_dims_between(full, micro, 2)
    batch = [i.tensor for i in full.inputs if i.role == "batch"]
    params = [i.tensor for i in full.inputs if i.role == "param"]
    assert batch and all(dims[t] == 0 for t in batch)
    assert params and not any(t in dims for t in params)
    for t, d in dims.items():       # exactly one dimension halves
        a, b = full.tensors[t].shape, micro.tensors[t].shape
        assert a[d] == 2 * b[d] and a[:d] + a[d + 1:] == b[:d] + b[d + 1:]
    # one micro-batch, or graphs of other operators: nothing is known
    assert batch_dims_between(full, full, 1) == {}
    gpt = build_model("gpt", {})
    assert batch_dims_between(full, trace(gpt.train_step, *gpt.abstract_args), 2) == {}


def test_layer_subgraphs_keep_the_rows_of_their_boundary_inputs():
    m, full, micro = _mlp()
    lay = assign_layers(micro, 3)
    dims = batch_dims_between(full, micro, 2)
    subs = [layer_subgraph(micro, lay, l, l, batch_dim=dims) for l in range(lay.num_layers)]
    bounds = [i for s in subs for i in s.inputs if i.role == BOUNDARY]
    # activations going up and their cotangents coming down carry the rows
    assert any(i.batch_dim == 0 for i in bounds)
    assert all(i.batch_dim == dims.get(i.tensor) for i in bounds)
    # the rows are part of a layer's structure (its ILP differs)
    plain = [layer_subgraph(micro, lay, l, l) for l in range(lay.num_layers)]
    assert any(a.fingerprint != b.fingerprint for a, b in zip(subs, plain))


def test_layer_flows_pair_each_boundary_input_with_the_layer_making_it():
    _, _, micro = _mlp()
    lay = assign_layers(micro, 3)
    subs = [layer_subgraph(micro, lay, l, l) for l in range(lay.num_layers)]
    flows = layer_flows(subs)
    assert flows
    for f in flows:
        assert f.maker != f.reader
        assert subs[f.maker].outputs[f.out_pos].tensor == f.tensor
        assert subs[f.reader].inputs[f.in_pos].tensor == f.tensor
        assert subs[f.reader].inputs[f.in_pos].role == BOUNDARY
    # forward values go up, their cotangents come down
    assert any(f.maker < f.reader for f in flows) and any(f.maker > f.reader for f in flows)


def test_joint_cost_sums_the_flows_with_both_ends_inside_the_stage():
    flows = [Flow(0, 1, 10, 0, 0), Flow(1, 0, 11, 1, 1), Flow(1, 2, 12, 2, 0),
             Flow(0, 3, 13, 3, 2)]
    price = {10: (1.0, 100.0), 11: (2.0, 200.0), 12: (4.0, 400.0), 13: (8.0, 800.0)}

    def cost(f):
        return price[f.tensor]
    assert joint_cost(flows, 0, 0, cost) == (0.0, 0.0)
    assert joint_cost(flows, 0, 1, cost) == (3.0, 300.0)
    assert joint_cost(flows, 1, 2, cost) == (4.0, 400.0)
    assert joint_cost(flows, 0, 3, cost) == (15.0, 1500.0)


def test_rows_cut_keeps_the_layouts_with_the_rows_over_the_data_axes_where_offered():
    inp = GraphInput(5, -1, "t5", BOUNDARY, batch_dim=1)
    specs = (((), ()), ((), (0,)), ((), (1,)), ((1,), (0,)), ((0,), ()), ((), (0, 1)))
    assert _rows_cut(specs, inp, (0,)) == (((), (0,)), ((1,), (0,)), ((), (0, 1)))
    # nothing on offer (a data axis of one device): every layout stays
    assert _rows_cut((((), ()), ((1,), ())), inp, (0,)) == (((), ()), ((1,), ()))
    # no rows known, or a method with no data axes: unchanged
    free = GraphInput(5, -1, "t5", BOUNDARY)
    assert _rows_cut(specs, free, (0,)) == specs
    assert _rows_cut(specs, inp, ()) == specs


def test_manual_middle_stages_run_data_parallel():
    # (a middle stage once took its activations whole from its neighbours
    # and ran every row on both data shards, with no gradient reduction)
    m = build_model("mlp", {})
    plan = meshplan.plan(m.train_step, *m.abstract_args,
                         method=meshplan.Manual(dp=2, tp=1, pp=4, num_micro_batches=2))
    for st in plan.stages:
        assert st.predicted.comm_bytes > 0, st


def test_pins_fix_what_a_layer_reads_and_charge_what_it_makes_unlike_its_reader():
    # dp_search.stages.StageCosts.member solves a layer again with the
    # layouts of the later layers of its stage: an input read as its maker
    # leaves it, an output charged the resharding to how its reader reads it
    from pathlib import Path
    from meshplan.ilp import Pins, solve_intra_op
    from meshplan.plan import LogicalMesh

    _, _, micro = _mlp()
    lay = assign_layers(micro, 3)
    subs = [layer_subgraph(micro, lay, l, l) for l in range(lay.num_layers)]
    cluster = meshplan.load_cluster(Path(__file__).resolve().parents[1]
                                     / "examples/clusters/dgx-a100-x1.json")
    mesh = LogicalMesh(("x", "y"), (2, 4))
    f = next(f for f in layer_flows(subs) if f.maker > f.reader and
             len(micro.tensors[f.tensor].shape) == 2)       # a cotangent coming down
    own = solve_intra_op(subs[f.reader], cluster, mesh)
    spec = (None, ("x", "y")) if own.input_specs[f.in_pos] != (None, ("x", "y")) else ("x", "y")
    pinned = solve_intra_op(subs[f.reader], cluster, mesh, pins=Pins(inputs=((f.in_pos, spec),)))
    assert own.input_specs[f.in_pos] != spec and pinned.input_specs[f.in_pos] == spec
    assert pinned.objective_s >= own.objective_s - 1e-12     # (a constraint added)
    # wanting an output as the layer makes it anyway changes nothing
    up = next(f for f in layer_flows(subs) if f.maker < f.reader)
    free = solve_intra_op(subs[up.maker], cluster, mesh)
    same = solve_intra_op(subs[up.maker], cluster, mesh,
                          pins=Pins(outputs=((up.out_pos, free.output_specs[up.out_pos]),)))
    assert same.objective_s == free.objective_s and same.output_specs == free.output_specs
    # wanting it otherwise: made so, or the resharding to it paid
    made = free.output_specs[up.out_pos]
    want = tuple(None for _ in made) if made != tuple(None for _ in made) else \
        (("x", "y"),) + made[1:]
    moved = solve_intra_op(subs[up.maker], cluster, mesh, pins=Pins(outputs=((up.out_pos, want),)))
    assert moved.output_specs[up.out_pos] == want or moved.objective_s > free.objective_s
    assert moved.objective_s >= free.objective_s - 1e-12
    assert not Pins() and Pins(outputs=((0, (None,)),))
