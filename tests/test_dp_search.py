"""The inter-operator pass: stage DP against brute force, layering, markers, plans."""
import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshplan
from meshplan.dp_search import PipelineOptions, plan_pipeline
from meshplan.dp_search.layers import assign_layers, layer_subgraph
from meshplan.dp_search.stage_dp import brute_force, stage_dp, submesh_shapes
from meshplan.markers import mark_pipeline_boundary, value_and_grad
from meshplan.models import build_model
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _random_stage_problem(rng, min_layers: int):
    """A random stage-DP instance: layers, submeshes, hosts, devices per host,
    micro-batches and a cost table (some entries infeasible)."""
    L = int(rng.integers(min_layers, 6))
    hosts, dph = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    subs = submesh_shapes(hosts, dph)
    B = int(rng.integers(1, 6))
    table = {}
    for i in range(L):
        for j in range(i, L):
            for m in range(len(subs)):
                for s in range(1, L + 1):
                    base = rng.random() * (j - i + 1) / subs[m].size ** rng.random()
                    table[i, j, m, s] = None if rng.random() < 0.15 else base
    return L, subs, hosts, dph, B, lambda i, j, m, s: table[i, j, m, s]


@pytest.mark.parametrize("seed", range(30))
def test_stage_dp_equals_brute_force(seed):
    L, subs, hosts, dph, B, cost = _random_stage_problem(np.random.default_rng(seed), 1)
    asked = set()

    def ask(*key):
        asked.add(key)
        return cost(*key)
    D = hosts * dph
    r = stage_dp(L, subs, D, B, ask)
    bf = brute_force(L, subs, D, B, cost)
    # (each cost asked is layer ILPs: none for a stage no plan on every
    # device has, the whole model on fewer devices or a later stage on all)
    assert not any(i == 0 and s == 1 and subs[m].size < D for i, _, m, s in asked)
    assert not any(i > 0 and subs[m].size == D for i, _, m, s in asked)
    if bf is None:
        assert r is None
    else:
        assert r is not None and r.total_s == pytest.approx(bf, rel=1e-12)
        assert sum(subs[st.submesh].size for st in r.stages) == hosts * dph
        assert [st.first for st in r.stages][0] == 0 and r.stages[-1].last == L - 1


def test_submesh_shapes():
    assert [(s.hosts, s.devices_per_host) for s in submesh_shapes(2, 8)] == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]


def _gpt(layers=4, compute_dtype="float32", **extra):
    m = build_model("gpt", {"layers": str(layers), "hidden": "128", "seq_len": "64", "vocab": "512",
                            "compute_dtype": compute_dtype, **extra})
    return m, trace(m.train_step, *m.abstract_args)


def test_layers_put_forward_backward_and_update_of_a_block_together():
    m, g = _gpt(4)
    lay = assign_layers(g, 6)
    assert lay.num_layers == 6
    # identical middle blocks hash equal
    hashes = [layer_subgraph(g, lay, l, l).fingerprint for l in range(lay.num_layers)]
    assert len(set(hashes)) < lay.num_layers
    # every parameter's forward readers and its update live in one layer (the
    # tied embedding is read by the first and the last layer)
    layers_of = {}
    for n in g.nodes:
        for t in n.inputs:
            inp = g.input_of_tensor.get(t)
            if inp is not None and inp.role == "param":
                layers_of.setdefault(inp.path, set()).add(lay.layer_of_node[n.id])
    spread = {p: ls for p, ls in layers_of.items() if len(ls) > 1 and "wte" not in p}
    assert not spread, spread
    # backward work is spread over the layers, not piled into one
    bwd = [sum(n.flops for n in g.nodes if not lay.forward[n.id] and lay.layer_of_node[n.id] == l)
           for l in range(lay.num_layers)]
    assert max(bwd) < 0.6 * sum(bwd)


def test_user_marks_define_the_layers():
    opt = optax.sgd(0.1)

    def loss_fn(p, x):
        h = jnp.tanh(x @ p["w0"])
        h = mark_pipeline_boundary(h)
        h = jnp.tanh(h @ p["w1"])
        h = mark_pipeline_boundary(h)
        return (h @ p["w2"]).mean()

    def step(state, x):
        loss, g = value_and_grad(loss_fn)(state["params"], x)
        u, o = opt.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt_state": o}, loss

    p = {f"w{i}": jnp.ones((16, 16)) * 0.1 for i in range(3)}
    state = {"params": p, "opt_state": opt.init(p)}
    x = jnp.ones((8, 16))
    g = trace(step, state, x)
    lay = assign_layers(g)
    assert lay.marked and lay.num_layers == 3
    for n in g.nodes:
        for t in n.inputs:
            inp = g.input_of_tensor.get(t)
            if inp is not None and inp.role == "param":
                assert lay.layer_of_node[n.id] == int(inp.path[-3]), (inp.path, n)
    # markers change no numbers
    s1, l1 = jax.jit(step)(state, x)
    assert np.isfinite(float(l1))


def test_pipeline_plan_on_a_small_cluster_is_consistent():
    m, g = _gpt(4)
    from meshplan.api import retracer
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    p = plan_pipeline(g, cluster, meshplan.PipeshardParallel(num_micro_batches=2),
                      retrace=retracer(m.train_step, m.abstract_args, (1,), "gpt"))
    devices = [d for s in p.stages for d in s.devices]
    assert sorted(devices) == list(range(8))
    assert p.num_micro_batches == 2
    firsts = [s.layers[0] for s in p.stages]
    assert firsts[0] == 0 and firsts == sorted(firsts)
    for a, b in zip(p.stages, p.stages[1:]):
        assert b.layers[0] == a.layers[1] + 1
    # every parameter is placed on exactly one stage (the tied embedding may be on two)
    keys = [k for s in p.stages for k, _ in s.params if "['params']" in k]
    want = {jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(m.abstract_args[0])[0]
            if jax.tree_util.keystr(path).startswith("['params']")}
    assert set(keys) == want
    assert meshplan.Plan.from_json(p.to_json()) == p


def test_manual_pipeline_plan_has_the_requested_shape():
    m, g = _gpt(4)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, schedule="gpipe"))
    assert len(p.stages) == 2 and p.num_micro_batches == 4 and p.schedule == "gpipe"
    for s in p.stages:
        assert s.logical_mesh.shape == (2, 2) and len(s.devices) == 4


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_stages_send_from_all_their_devices(dp, tp):
    """Between two stages of one host each, the activations (and their
    gradients back) cross once, cut over all the devices, each over its share
    of the host's link, then the devices that hold each byte all-gather it
    inside the receiving host (Alpa's cross-mesh resharding)."""
    from meshplan.dp_search.problem import layer_problems
    m, g = _gpt(4)
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/aws-p3.16xlarge-x2.json"
                                    ).with_devices(2, 4)
    # (every collective on the critical path: no gradient reduction hides
    # under compute and leaves the difference below to the sends)
    a = dataclasses.replace(cluster.device.achieved, overlap_communication=False)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, achieved=a))
    method = meshplan.Manual(dp=dp, tp=tp, pp=2, num_micro_batches=1, schedule="1f1b")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster, method=method)
    assert [s.submesh for s in p.stages] == [(1, 4), (1, 4)] and not any(s.remat for s in p.stages)
    work = sum(s.predicted.compute_s + s.predicted.comm_s for s in p.stages)
    # one micro-batch: the stages run one after another, each launching a
    # forward and a backward program, and each its update program
    dispatch = 3 * len(p.stages) * cluster.device.achieved.program_dispatch_s
    sent = p.predicted.iteration_s - work - dispatch
    lay = layer_problems(g, 1, cluster, method.request(cluster.num_devices).pipeline)
    cut = p.stages[0].layers[1]
    # how many devices hold each byte of the activations crossing the cut,
    # from the layouts the first stage gives them
    specs = dict(p.stages[0].constraints)
    mesh = p.stages[0].logical_mesh
    crossing = lay.crossing[cut]
    assert crossing and all(t in specs for t in crossing)
    copies = {t: mesh.size // math.prod(mesh.shape[mesh.axes.index(a)] for d in specs[t] if d
                                        for a in ((d,) if isinstance(d, str) else d))
              for t in crossing}
    held = sum(g.tensors[t].nbytes * copies[t] for t in crossing)
    rep = held / sum(g.tensors[t].nbytes for t in crossing)
    per_device_link = cluster.inter_host.achieved_bandwidth / cluster.devices_per_host
    nbytes = lay.layering.cut_bytes[cut]
    once = cluster.inter_host.latency_s + nbytes / (4 * per_device_link)
    if rep > 1:     # a ring over the rep holders of each shard, inside the host
        once += (rep - 1) * cluster.intra_host.latency_s + \
            nbytes * (rep - 1) / 4 / cluster.intra_host.achieved_bandwidth
    assert sent == pytest.approx(2 * once, rel=1e-6)


def test_auto_plans_and_parallelize_runs():
    m = build_model("mlp", {"optimizer": "sgd"})
    state, batch = m.init(0)
    step = meshplan.parallelize(m.train_step, cluster=meshplan.Cluster.local(),
                                method=meshplan.Auto(time_limit=30))
    new_state, metrics = step(jax.tree.map(np.array, state), batch)
    ref_state, ref_metrics = jax.jit(m.train_step)(state, batch)
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-5)
    # (one stage, or a pipeline when micro-batches pay: either way it runs)
    assert step.plan.method == "auto" and len(step.plan.stages) >= 1


def test_timeline_simulation_follows_the_schedule(tmp_path):
    from meshplan.plan import Plan
    from meshplan.tools.timeline import breakdown, draw, simulate
    m, g = _gpt(4)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    for schedule in ("gpipe", "1f1b"):
        p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                          method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4,
                                                 schedule=schedule))
        blocks = simulate(p)
        assert len(blocks) == 2 * 2 * 4
        # no stage runs two blocks at once; backward of a micro-batch after its forward
        for k in range(2):
            mine = sorted((b for b in blocks if b.stage == k), key=lambda b: b.start)
            assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
        end = {(b.kind, b.stage, b.micro_batch): b.end for b in blocks}
        assert all(end["B", 0, i] > end["F", 1, i] for i in range(4))
        order0 = [b.kind for b in sorted((b for b in blocks if b.stage == 0), key=lambda b: b.start)]
        if schedule == "gpipe":
            assert order0 == ["F"] * 4 + ["B"] * 4
        else:
            assert order0[:2] == ["F", "F"] and order0[2] == "B"   # one warm-up forward, then 1F1B
        png = tmp_path / f"{schedule}.png"
        draw(p, str(png))
        assert png.stat().st_size > 1000
        # the blocks are the stage latencies the search costed: with the update
        # programs they add up to the predicted iteration (A100s, not a shared host)
        update = 2 * cluster.device.achieved.program_dispatch_s
        assert max(b.end for b in blocks) + update == pytest.approx(p.predicted.iteration_s,
                                                                    rel=1e-9)
        assert "differs" not in breakdown(p, blocks)
        assert Plan.from_json(p.to_json()).stages[0].predicted.latency_s == \
            p.stages[0].predicted.latency_s > 0


def test_constant_masks_are_recomputed_not_sent_between_layers():
    m, g = _gpt(4)
    lay = assign_layers(g, 4)
    for l in range(lay.num_layers):
        sub = layer_subgraph(g, lay, l, l)
        big = [i for i in sub.inputs if i.role == "boundary"
               and len(g.tensors[i.tensor].shape) == 4]   # [batch, heads, seq, seq] masks
        assert not big


def test_gradient_accumulation_pays_gradient_reduction_once_per_iteration():
    from meshplan.graph import strip_markers
    from meshplan.ilp import solve_intra_op
    from meshplan.plan import LogicalMesh
    # (wide enough that data parallelism is the ILP's choice: at width 256
    # gathering the batch and running each weight gradient whole, split-K,
    # ties with it)
    m = build_model("mlp", {"batch": "4096", "in_dim": "1024", "hidden": "1024"})
    g = trace(m.train_step, *m.abstract_args)
    grads = frozenset(t for n in g.nodes if n.primitive == "meshplan_grad_boundary" for t in n.inputs)
    assert len(grads) == len([i for i in g.inputs if i.role == "param"])
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    mesh = LogicalMesh(("data",), (8,))
    dp_only = lambda inp, spec, _: (inp.role == "batch") == any(spec)  # noqa: E731
    sg = strip_markers(g)
    r1 = solve_intra_op(sg, cluster, mesh, input_filter=dp_only, accumulate=grads, grad_accum=1)
    r4 = solve_intra_op(sg, cluster, mesh, input_filter=dp_only, accumulate=grads, grad_accum=4)
    reduced = [sum(pc.nbytes for pc in r.collectives if pc.gradient) for r in (r1, r4)]
    assert reduced[0] > 0
    # data parallel: the gradient reductions, a quarter per micro-batch (the ILP
    # may also re-plan around the cheaper reduction); what the forward and the
    # input gradients move is paid every micro-batch
    assert all(pc.per_step for pc in r4.collectives if pc.gradient)
    assert not any(pc.per_step for pc in r1.collectives)
    assert reduced[1] <= 0.26 * reduced[0]
    assert r4.comm_s < r1.comm_s


# ---- repeated blocks, layer groups, saved activations ----------------------

def test_find_blocks_on_a_repeated_sequence():
    from meshplan.dp_search.layers import find_blocks
    block = [5, 6, 7, 8, 9]
    sig = np.array([1, 2] + block * 4 + [3, 4])
    cut = np.ones(len(sig))
    cut[[1, 6, 11, 16, 21]] = 0.1      # the block boundaries are the cheap cuts
    assert find_blocks(sig, cut) == [1, 6, 11, 16, 21]
    # no repetition, or too little of it: no blocks
    assert find_blocks(np.arange(20), np.ones(20)) is None
    assert find_blocks(np.array(list(range(30)) + [1, 2, 1, 2]), np.ones(34)) is None


@pytest.mark.parametrize("layers,compute_dtype,dropout", [
    (3, "float32", 0), (6, "float32", 0), (4, "float16", 0),
    # each block draws its masks from its own key, keys[i] of one split:
    # the blocks differ only in the position of that slice
    (4, "float32", 0.1)])
def test_identical_transformer_blocks_are_layers_of_one_kind(layers, compute_dtype, dropout):
    m, g = _gpt(layers, compute_dtype, dropout=dropout)
    lay = assign_layers(g)
    assert lay.num_layers == layers + 2       # embedding, the blocks, head + loss
    hashes = [layer_subgraph(g, lay, l, l).fingerprint for l in range(lay.num_layers)]
    # every block is the same problem, the first and the last included (in
    # float16 the gradient arriving from the first block is cast back to
    # float32 on the embedding's side: the narrower value crosses)
    assert len(set(hashes[1:-1])) == 1 and len(set(hashes)) == 3
    # Adam's moment updates of a block's weights run on the block's layer, not
    # where the gradient marker that gathers every gradient happens to be
    # placed -- a bias's too, although its gradient sums the gradient arriving
    # from the block above and reads no activation of its own block.
    import re
    checked = 0
    for n in g.nodes:
        if lay.forward[n.id]:
            continue
        for t in n.inputs:
            inp = g.input_of_tensor.get(t)
            block = re.search(r"\['h(\d+)'\]", inp.path) if inp is not None else None
            if inp is not None and inp.role == "opt_state" and block:
                assert lay.layer_of_node[n.id] == int(block.group(1)) + 1, (inp.path, n.primitive)
                checked += 1
    assert checked >= 16 * layers


@pytest.mark.parametrize("seed", range(20))
def test_group_layers_is_the_best_balanced_partition(seed):
    import itertools
    from meshplan.dp_search.layers import group_layers
    rng = np.random.default_rng(seed)
    flops = list(rng.random(int(rng.integers(1, 8))))
    G = int(rng.integers(1, len(flops) + 1))
    groups = group_layers(flops, G)
    assert [a for a, _ in groups] == [0] + [b + 1 for _, b in groups[:-1]]
    assert groups[-1][1] == len(flops) - 1 and len(groups) == G
    got = max(sum(flops[a:b + 1]) for a, b in groups)
    best = min(max(sum(flops[a:b]) for a, b in zip((0,) + c, c + (len(flops),)))
               for c in itertools.combinations(range(1, len(flops)), G - 1))
    assert got == pytest.approx(best)


def test_saved_activations_are_what_the_backward_reads():
    from meshplan.dp_search.layers import saved_for_backward

    def loss_fn(p, x):
        mask = jnp.tril(jnp.ones((16, 16), bool))       # a constant: never kept
        h = jnp.tanh(x @ p["w0"])
        return jnp.where(mask[:8], h @ p["w1"], 0.0).sum()

    def step(p, x):
        loss, gr = value_and_grad(loss_fn)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, gr), loss

    p = {"w0": jnp.ones((16, 16)), "w1": jnp.ones((16, 16))}
    g = trace(step, p, jnp.ones((8, 16)))
    lay = assign_layers(g, 1)
    (saved,) = saved_for_backward(g, lay)
    kinds = {g.nodes[g.producer[t]].primitive if t in g.producer else "input" for t in saved}
    assert "tanh" in kinds                        # tanh' needs its output
    assert all(t not in g.constant_tensors for t in saved)
    assert not any(g.input_of_tensor[t].role == "param" for t in saved if t in g.input_of_tensor)


def test_stage_layouts_name_the_stages_own_tensors():
    # identical blocks share one ILP result; each stage's pinned layouts must
    # still be those of its own layers' tensors
    m, g = _gpt(4)
    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=1))
    layer_of_tensor = {t: p.layer_of_node[n.id] for n in g.nodes for t in n.outputs}
    assert len(p.stages) == 2
    for s in p.stages:
        first, last = s.layers
        pinned = [layer_of_tensor[t] for t, _ in s.constraints if t in layer_of_tensor]
        # every layer of the stage has its own intermediates pinned, and few
        # pinned values come from elsewhere (those made by the stage before)
        for layer in range(first, last + 1):
            assert pinned.count(layer) > 10, (s.layers, layer, sorted(set(pinned)))
        assert sum(first <= x <= last for x in pinned) >= 0.9 * len(pinned)


def test_a_micro_batch_size_the_step_cannot_trace_is_skipped():
    from meshplan.api import retracer
    from meshplan.errors import TraceError
    m = build_model("mlp", {"optimizer": "sgd"})
    g = trace(m.train_step, *m.abstract_args)
    real = retracer(m.train_step, m.abstract_args, (1,), "step")
    tried = []

    def retrace(B):
        tried.append(B)
        if B == 2:      # like MoE token groups larger than the micro-batch
            raise TraceError("could not trace 'step': cannot reshape")
        return real(B)

    cluster = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
    p = plan_pipeline(g, cluster, meshplan.PipeshardParallel(), retrace=retrace)
    assert 2 in tried and p.num_micro_batches != 2


def test_layers_inside_a_scan_are_reported_or_unrolled():
    m = build_model("gpt", {"layers": "4", "hidden": "64", "seq_len": "32", "vocab": "128",
                            "scan_layers": "true", "batch": "8"})
    from meshplan.dp_search.search import _scanned_layers
    # a graph traced as it is holds the layers in one scan: the search says so
    g = trace(m.train_step, *m.abstract_args)
    note = _scanned_layers(g)
    assert note is not None and "lax.scan over 4 stacked layers" in note
    # the same model with its blocks in a Python loop has nothing to report
    m2 = build_model("gpt", {"layers": "4", "hidden": "64", "seq_len": "32", "vocab": "128",
                             "batch": "8"})
    assert _scanned_layers(trace(m2.train_step, *m2.abstract_args)) is None
    # meshplan.plan unrolls the scan (meshplan.trace.unstack): nothing to warn about,
    # and the layering sees the blocks
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = meshplan.plan(m.train_step, *m.abstract_args,
                             cluster=meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json"),
                             method=meshplan.PipeshardParallel(num_micro_batches=2, stages=2))
    assert any("lax.scan over 4 stacked layers was unrolled" in n for n in plan.notes)
    assert len(plan.stages) == 2


def test_scanned_layers_warn_once_a_plan_however_many_searches_ran():
    # the step traced as it is (no unrolling): Auto runs several searches
    # (its passes and the hand plans), each noting the scan; one warning
    from meshplan.planning import plan_step, retracer
    m = build_model("gpt", {"layers": "4", "hidden": "64", "seq_len": "32", "vocab": "128",
                            "scan_layers": "true", "batch": "8"})
    g = trace(m.train_step, *m.abstract_args)
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step", graph=g)
    import warnings
    two = meshplan.ClusterSpec.from_dict({
        "format": "meshplan.cluster/1", "name": "fake-1x2", "num_hosts": 1,
        "devices_per_host": 2, "num_devices": 2,
        "device": {"kind": "fake", "memory_bytes": 16 * 2**30, "memory_bandwidth_bytes_per_s": 1e12,
                   "peak_flops": {"float32": 1e13}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
                  "inter_host": {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6}}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = plan_step(g, two, meshplan.Auto(num_micro_batches=(2,)), retrace=rt)
    said = [w for w in caught if "stacked layers" in str(w.message)]
    assert planned.search.searches > 1 and len(said) == 1
    assert any("lax.scan over 4 stacked layers" in n for n in planned.plan.notes)


def test_a_recurrence_is_noted_not_warned_of_as_stacked_layers():
    # a scan over time that reads the same weights each step is no stack of
    # layers: the plan notes that no stage cuts inside it, with no warning
    # telling the user to stack parameters they never stacked
    def loss(p, x, y):
        def cell(h, xt):
            h = jnp.tanh(h @ p["w"] + xt @ p["u"])
            return h, None
        h, _ = jax.lax.scan(cell, jnp.zeros((x.shape[0], 32)), jnp.swapaxes(x, 0, 1))
        return jnp.mean((h @ p["out"] - y) ** 2)

    def step(p, batch):
        l, g = jax.value_and_grad(loss)(p, batch["x"], batch["y"])
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), {"loss": l}
    k = jax.random.split(jax.random.key(0), 3)
    p = {"w": jax.random.normal(k[0], (32, 32)), "u": jax.random.normal(k[1], (16, 32)),
         "out": jax.random.normal(k[2], (32, 4))}
    batch = {"x": jnp.ones((8, 12, 16)), "y": jnp.ones((8, 4))}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = meshplan.plan(step, p, batch, cluster=meshplan.load_cluster(
            ROOT / "examples/clusters/dgx-a100-x1.json"),
            method=meshplan.PipeshardParallel(num_micro_batches=2))
    assert any("lax.scan loops of 12 iterations that read the same parameters" in n
               for n in plan.notes)
    assert not any("stacked layers" in n for n in plan.notes)


@pytest.mark.parametrize("fits,untraceable,expected,fastest", [
    # counts that fit -> the counts searched, from the most micro-batches down:
    # once a count fits nothing after one that did, fewer are not tried
    pytest.param({64, 32, 16}, (), [64, 32, 16, 8], 32, marks=pytest.mark.extended),
    # nothing fits with 64 (the most of the usual counts): smaller micro-batches
    # are tried, fewer are not; 128 being the fastest, 256 is tried too
    pytest.param({128}, (), [64, 128, 256], 32, marks=pytest.mark.extended),
    # micro-batches too small to trace (MoE token groups) do not stop the search
    ({16}, (64, 32), [16, 8], 32),
    # the most of the usual counts is the fastest that fits: more are tried
    # while the most searched stays the fastest
    ({128, 64, 32}, (), [64, 32, 16, 128, 256], 128),
])
def test_micro_batch_counts_searched_from_the_most_down(monkeypatch, fits, untraceable, expected,
                                                        fastest):
    import dataclasses
    import meshplan.dp_search.search as dps
    from meshplan.api import retracer
    from meshplan.errors import InfeasiblePlanError
    m = build_model("mlp", {"optimizer": "sgd", "batch": "256"})
    g = trace(m.train_step, *m.abstract_args)
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    base = plan_pipeline(g, cluster, meshplan.PipeshardParallel(num_micro_batches=1))
    tried = []

    def fake(full, lay, *args):
        tried.append(lay.B)
        if lay.B not in fits:
            raise InfeasiblePlanError("does not fit")
        return dataclasses.replace(base, num_micro_batches=lay.B, predicted=dataclasses.replace(
            base.predicted, iteration_s=1.0 + abs(lay.B - fastest)))
    monkeypatch.setattr(dps, "_plan_for", fake)
    # (no count passed over or planned by its relaxed search: every one is searched)
    monkeypatch.setattr(dps, "_relaxed", lambda *args: (0.0, None))
    real = retracer(m.train_step, m.abstract_args, (1,), "step")

    def rt(B):
        if B in untraceable:
            from meshplan.errors import TraceError
            raise TraceError("cannot reshape")
        return real(B)
    p = plan_pipeline(g, cluster, meshplan.PipeshardParallel(), retrace=rt)
    assert tried == expected
    assert p.num_micro_batches == min(fits & set(expected), key=lambda b: abs(b - fastest))
    # without pruning every usual count is searched
    tried.clear()
    opts = dataclasses.replace(meshplan.PipeshardParallel().request(8).pipeline,
                               prune_micro_batches=False)
    plan_pipeline(g, cluster, meshplan.PipeshardParallel(), retrace=rt, options=opts)
    assert tried[:7] == [b for b in (64, 32, 16, 8, 4, 2, 1) if b not in untraceable][:7]


def test_no_fit_names_the_memory_reason_before_the_untraceable_counts(monkeypatch):
    import meshplan.dp_search.search as dps
    from meshplan.api import retracer
    from meshplan.errors import InfeasiblePlanError, TraceError
    m = build_model("mlp", {"optimizer": "sgd", "batch": "256"})
    g = trace(m.train_step, *m.abstract_args)
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")

    def fake(full, lay, *args):
        raise InfeasiblePlanError(f"nothing fits with {lay.B}")
    monkeypatch.setattr(dps, "_plan_for", fake)
    # (no count passed over or planned by its relaxed search: every one is searched)
    monkeypatch.setattr(dps, "_relaxed", lambda *args: (0.0, None))
    real = retracer(m.train_step, m.abstract_args, (1,), "step")

    def rt(B):
        if B >= 128:
            raise TraceError("cannot reshape")
        return real(B)
    with pytest.raises(InfeasiblePlanError) as e:
        plan_pipeline(g, cluster, meshplan.PipeshardParallel(), retrace=rt)
    # the fewest-memory count that traced, then why more micro-batches did not
    assert "(nothing fits with 64; the step does not trace with 128 micro-batches" in str(e.value)


def test_gradients_are_matched_to_their_parameters_only_when_unambiguous():
    from meshplan.dp_search.layers import gradient_parameters
    from meshplan.graph import GRAD_MARKER

    def step(state, x):
        def loss(p, q):
            return jnp.sum(jnp.tanh(x @ p["w1"] + p["b1"]) @ q["w2"] + q["b2"])
        # (the forward reads r too, so r is a parameter like q: read by none,
        # it would be state the update alone reads, as an EMA of the weights)
        _, gp = value_and_grad(lambda p: loss(p, state["q"]) + loss(p, state["r"]))(state["p"])
        _, gq = value_and_grad(lambda q: loss(state["p"], q))(state["q"])
        sub = lambda a, b: a - b      # noqa: E731
        return {"p": jax.tree.map(sub, state["p"], gp), "q": jax.tree.map(sub, state["q"], gq),
                "r": jax.tree.map(sub, state["r"], gq)}, 0.0

    f32 = jnp.float32
    S = jax.ShapeDtypeStruct
    q = {"b2": S((4,), f32), "w2": S((3, 4), f32)}
    state = {"p": {"b1": S((3,), f32), "w1": S((4, 3), f32)}, "q": q, "r": dict(q)}
    g = trace(step, state, S((2, 4), f32))
    markers = [n for n in g.nodes if n.primitive == GRAD_MARKER]
    assert len(markers) == 2
    paths = {i.tensor: i.path for i in g.inputs}
    # p's gradients: one run of parameters has their shapes
    assert [paths[t] for t in gradient_parameters(g, markers[0])] == [
        "['p']['b1']", "['p']['w1']"]
    # q's: so has r's run -- which parameters they belong to cannot be told
    assert gradient_parameters(g, markers[1]) == [None, None]


@pytest.mark.parametrize("remat", [True, False, None])
def test_manual_remat_is_every_stage_none_or_chosen(remat):
    m, g = _gpt(4)
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4, remat=remat))
    # a tiny model fits without recomputation: chosen, it is not used
    assert [s.remat for s in p.stages] == [bool(remat)] * 2
    if remat:
        plain = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                              method=meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=4))
        assert p.predicted.iteration_s > plain.predicted.iteration_s


def test_more_stages_than_repeated_blocks_cuts_finer_layers():
    m, g = _gpt(2)        # embedding, 2 blocks, head: 4 layers
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.Manual(dp=1, tp=1, pp=8, num_micro_batches=8))
    assert len(p.stages) == 8


@pytest.mark.extended      # (about 30 s)
def test_a_schedule_searched_after_interleaved_is_costed():
    # (the interleaved branch once rebound the send-cost helper to a float, so
    # any schedule searched after it raised TypeError)
    m, g = _gpt(4)
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    method = meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=1)
    opts = PipelineOptions(num_micro_batches=(1,), schedules=("interleaved", "1f1b", "gpipe"),
                           num_stages=2, fixed=(2, 2, 2), equal_layers=True)
    p = plan_pipeline(g, cluster, method, options=opts)
    alone = {s: plan_pipeline(g, cluster, method, options=PipelineOptions(
        num_micro_batches=(1,), schedules=(s,), num_stages=2, fixed=(2, 2, 2), equal_layers=True))
        for s in ("1f1b", "gpipe")}
    # (one micro-batch: interleaved 1F1B, which runs a multiple of the
    # stages, is skipped in the search and refused alone, with the reason)
    with pytest.raises(meshplan.InfeasiblePlanError, match="multiple of the 2 stages"):
        plan_pipeline(g, cluster, method, options=PipelineOptions(
            num_micro_batches=(1,), schedules=("interleaved",), num_stages=2, fixed=(2, 2, 2),
            equal_layers=True))
    assert len(p.stages) == 2 and all(a < b for a, b in (st.layers for st in p.stages))
    best = min(alone.values(), key=lambda q: q.predicted.iteration_s)
    assert p.predicted.iteration_s == best.predicted.iteration_s
    assert p.schedule == best.schedule


@pytest.mark.parametrize("seed", range(20))
def test_stage_dp_with_an_exact_number_of_stages_equals_brute_force(seed):
    L, subs, hosts, dph, B, cost = _random_stage_problem(np.random.default_rng(100 + seed), 2)
    for S in range(1, L + 1):
        r = stage_dp(L, subs, hosts * dph, B, cost, max_stages=S, min_stages=S)
        bf = brute_force(L, subs, hosts * dph, B, cost, stages=S)
        if bf is None:
            assert r is None
        else:
            assert r is not None and len(r.stages) == S
            assert r.total_s == pytest.approx(bf, rel=1e-12)


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeshard_stages_is_an_exact_count(stages):
    # (it used to be an upper bound: stages=2 often gave one stage)
    m = build_model("mlp", {"layers": "4", "optimizer": "sgd"})
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.PipeshardParallel(stages=stages))
    assert len(p.stages) == stages
    assert sum(len(s.devices) for s in p.stages) == cluster.num_devices
    with pytest.raises(meshplan.MeshplanError, match="stages=9"):
        meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster,
                      method=meshplan.PipeshardParallel(stages=9))


@pytest.mark.parametrize("seed", range(20))
def test_uneven_operations_get_layers_of_their_own_before_any_layer_gets_two(seed):
    # a few large operations among small ones, more layers asked than an even
    # share allows: the cuts minimise the largest layer's FLOPs (brute force)
    import itertools
    from meshplan.dp_search.layers import cluster_forward
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 9))
    flops = np.where(rng.random(n) < 0.3, 1e6, rng.random(n))
    flops[int(rng.integers(n))] = 1e6
    L = int(rng.integers(2, n + 1))
    cut = rng.random(n)
    cuts = cluster_forward(flops, cut, L, list(range(n - 1)))
    bounds = [-1] + cuts + [n - 1]
    got = max(flops[a + 1:b + 1].sum() for a, b in zip(bounds, bounds[1:]))
    best = min(max(flops[a + 1:b + 1].sum() for a, b in zip((-1,) + c, c + (n - 1,)))
               for c in itertools.combinations(range(n - 1), L - 1))
    assert got == pytest.approx(best)
    assert len(cuts) == L - 1


def test_more_stages_than_the_step_cuts_into_is_one_clear_error():
    def step(p, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(b @ p["w"]) @ p["o"]))(p)
        return jax.tree.map(lambda a, c: a - 0.1 * c, p, g), loss
    p = {"w": jnp.ones((16, 16)), "o": jnp.ones((16, 1))}
    with pytest.raises(meshplan.MeshplanError, match="too few for 8 pipeline stages") as e:
        meshplan.plan(step, p, jnp.ones((16, 16)), cluster=meshplan.Cluster.local(),
                      method=meshplan.PipeshardParallel(stages=8))
    assert "stages or fewer" in str(e.value)
