"""The intra-operator ILP: optimality against brute force, textbook plans, memory."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import meshplan
from meshplan.cost_model.mesh import mesh_model
from meshplan.layout_moves import spec_from_names
from meshplan.errors import InfeasiblePlanError
from meshplan.graph import OPT_STATE, PARAM
from meshplan.ilp import best_intra_op, build_problem, candidate_meshes, solve_intra_op
from meshplan.ilp.problem import Edge, IlpProblem, MemoryRow, brute_force
from meshplan.ilp.presolve import presolve, repair
from meshplan.ilp.solvers import solve
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

A100 = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")


def random_problem(rng, n_groups, max_strats=4, memory=False):
    sizes = rng.integers(1, max_strats + 1, size=n_groups)
    p = IlpProblem([f"g{i}" for i in range(n_groups)],
                   [rng.random(k) * rng.choice([1.0, 10.0]) for k in sizes])
    for _ in range(rng.integers(1, 2 * n_groups + 1)):
        u, v = rng.choice(n_groups, 2, replace=False)
        m = rng.random((sizes[u], sizes[v]))
        m[rng.random(m.shape) < 0.3] = 0.0
        p.edges.append(Edge(int(u), int(v), m))
    if memory:
        for _ in range(2):
            coefs = {g: rng.random(sizes[g]) * 10 for g in range(n_groups)}
            p.memory.append(MemoryRow(coefs, sum(float(np.median(c)) for c in coefs.values())))
    return p


@pytest.mark.parametrize("seed", range(40))
def test_core_equals_brute_force_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, int(rng.integers(2, 8)), memory=bool(seed % 2))
    best, best_val = brute_force(p)
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            solve(p)
        return
    sol = solve(p)
    assert sol.objective == pytest.approx(best_val, rel=1e-6, abs=1e-9)
    assert p.feasible(list(sol.choice))


@pytest.mark.parametrize("seed", range(20))
def test_a_seeded_mip_is_still_optimal_and_its_start_fits(seed):
    """A capped layer's MIP starts from its uncapped plan made to fit
    (``repair``): the solve from it proves the same optimum as brute force."""
    rng = np.random.default_rng(100 + seed)
    p = random_problem(rng, int(rng.integers(3, 8)), memory=True)
    best, val = brute_force(p)
    loose, _ = brute_force(IlpProblem(p.names, p.costs, p.edges))
    pre = presolve(p)
    # (a choice of the presolved problem comes back through lift and project)
    some = [int(rng.integers(len(c))) for c in pre.problem.costs]
    assert pre.project(pre.lift(some)) == some
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            solve(p, dp=False, seed=loose)
        return
    sol = solve(p, dp=False, seed=loose)
    assert sol.objective == pytest.approx(val, rel=1e-6, abs=1e-9)
    assert p.feasible(list(sol.choice))


def test_repair_finds_a_fitting_start_from_the_unconstrained_optimum():
    """From the optimum without memory rows, repair reaches a choice that fits
    on nearly every feasible random instance (a greedy: not on all), close
    to the optimum with them."""
    found, feasible, excess = 0, 0, []
    for seed in range(100):
        rng = np.random.default_rng(1000 + seed)
        p = random_problem(rng, int(rng.integers(3, 8)), memory=True)
        best, val = brute_force(p)
        if best is None:
            continue
        feasible += 1
        loose, _ = brute_force(IlpProblem(p.names, p.costs, p.edges))
        got = repair(p, loose)
        if got is not None:
            found += 1
            excess.append(p.objective(got) / val - 1)
    assert feasible >= 80 and found >= 0.95 * feasible
    assert float(np.median(excess)) < 0.05


def test_repair_only_improves_a_start_that_fits():
    rng = np.random.default_rng(5)
    for _ in range(20):
        p = random_problem(rng, 7, memory=True)
        fits, _ = brute_force(p)
        if fits is None:
            continue
        worse = list(fits)
        g = int(rng.integers(len(worse)))
        worse[g] = (worse[g] + 1) % len(p.costs[g])
        start = worse if p.feasible(worse) else fits
        got = repair(p, start)
        assert got is not None
        assert p.objective(got) <= p.objective(start) + 1e-12
    # (what is not a choice of the problem is no start)
    assert repair(p, [0] * (p.num_groups + 1)) is None
    assert repair(p, [len(c) for c in p.costs]) is None


def test_cbc_backend_agrees_with_highs():
    rng = np.random.default_rng(7)
    p = random_problem(rng, 6, memory=True)
    best, val = brute_force(p)
    assert best is not None
    assert solve(p, backend="cbc").objective == pytest.approx(val, rel=1e-6)


def _forward(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2


@pytest.mark.parametrize("mesh, shapes, budget", [
    (LogicalMesh(("x",), (4,)), [(16, 32), (32, 8), (64, 16)], None),
    (LogicalMesh(("x",), (4,)), [(16, 32), (32, 8), (64, 16)], 6_000),
    (LogicalMesh(("x", "y"), (2, 2)), [(8, 8), (4, 8)], None),
])
def test_graph_ilp_equals_brute_force(mesh, shapes, budget):
    if len(shapes) == 3:
        fn, args = _forward, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    else:
        fn = lambda w, x: x @ w  # noqa: E731
        args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    g = trace(fn, *args, batch_argnums=())
    mm = mesh_model(A100, mesh)
    built = build_problem(g, mm, memory_budget=budget)
    p = built.problem
    n_combos = math.prod(len(c) for c in p.costs)
    assert n_combos <= 200_000 and sum(len(c) > 1 for c in p.costs) <= 10
    best, val = brute_force(p)
    sol = solve(p)
    assert sol.objective == pytest.approx(val, rel=1e-9, abs=1e-15)


def _dot_strategies(g, result):
    chosen = dict(result.strategies)
    return [(n, chosen[n.id]) for n in g.nodes if n.primitive == "dot_general" and n.id in chosen]


def test_large_batch_small_weights_is_data_parallel():
    m = build_model("mlp", dict(batch="65536", in_dim="256", hidden="256", layers="2", out_dim="256"))
    g = trace(m.train_step, *m.abstract_args)
    r = solve_intra_op(g, A100, LogicalMesh(("x",), (8,)))
    specs = {i.path: s for i, s in zip(g.inputs, r.input_specs)}
    assert specs["['x']"] == ("x", None) and specs["['y']"] == ("x", None)
    for node, strat in _dot_strategies(g, r):
        # every matmul splits the batch: forward/backward on rows, weight gradients sum over it
        assert strat in ("x:o0", "x:sum", "x:sum>rs0", "x:sum>rs1"), (node, strat)
    # communication is the gradient reduction: at most ~one all-reduce of all weights
    weight_bytes = g.param_bytes
    assert r.comm_bytes <= 1.2 * weight_bytes


def test_small_batch_huge_hidden_is_megatron():
    m = build_model("mlp", dict(batch="8", in_dim="8192", hidden="32768", layers="1", out_dim="8192"))
    g = trace(m.train_step, *m.abstract_args)
    r = solve_intra_op(g, A100, LogicalMesh(("x",), (8,)))
    specs = {i.path: s for i, s in zip(g.inputs, r.input_specs)}
    assert specs["['params']['dense0']['w']"] == (None, "x")     # column split
    assert specs["['params']['head']['w']"] == ("x", None)       # row split
    fwd = [s for n, s in _dot_strategies(g, r)][:2]
    assert fwd == ["x:o1", "x:sum"]    # one all-reduce in the forward pass


def test_optimizer_state_sharded_when_replicas_do_not_fit():
    m = build_model("mlp", dict(batch="64", in_dim="2048", hidden="2048", layers="2", out_dim="2048"))
    g = trace(m.train_step, *m.abstract_args)
    mesh = LogicalMesh(("x",), (8,))
    free = solve_intra_op(g, A100, mesh)
    state_bytes = g.param_bytes + g.role_bytes(OPT_STATE)
    budget = 0.6 * state_bytes      # the replicated state alone does not fit
    r = solve_intra_op(g, A100, mesh, memory_budget=budget)
    assert r.peak_memory_bytes <= budget
    sharded = [i.path for i, s in zip(g.inputs, r.input_specs)
               if i.role in (PARAM, OPT_STATE) and any(d is not None for d in s)]
    assert len(sharded) >= 6
    assert r.objective_s >= free.objective_s - 1e-12


def test_infeasible_budget_says_what_is_needed():
    m = build_model("mlp")
    g = trace(m.train_step, *m.abstract_args)
    with pytest.raises(InfeasiblePlanError) as info:
        solve_intra_op(g, A100, LogicalMesh(("x",), (8,)), memory_budget=1000)
    e = info.value
    assert e.budget_bytes == 1000 and e.needed_bytes > 1000
    assert "budget is 1000 B" in str(e) and "devices" in str(e)
    assert re.search(r"needs at least [\d.]+ (KiB|MiB|GiB) per device", str(e)), str(e)
    assert isinstance(e, meshplan.MeshplanError)


def test_a_permuted_mesh_is_searched_too():
    # a 1-block gpt on the 8 local devices: 4x2 solves 0.7% faster than 2x4
    # (sweep T found a model 12% faster); the search over every mesh finds the
    # best of them, where it used to drop 4x2 as planning like 2x4
    local = meshplan.Cluster.local()
    m = build_model("gpt", {"layers": 1})
    g = trace(m.train_step, *m.abstract_args)
    each = {s: solve_intra_op(g, local, LogicalMesh(("x", "y"), s)).objective_s
            for s in ((2, 4), (4, 2))}
    assert each[(4, 2)] < each[(2, 4)]
    best, _ = best_intra_op(g, local)
    assert best.objective_s <= min(each.values()) * (1 + 1e-9)


def test_three_d_mesh_and_candidates():
    assert [m.shape for m in candidate_meshes(8, 3)] == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    # inside one host all axes have the same links, yet (4, 2) is kept beside
    # (2, 4): a dimension split over both axes is split major axis first
    # (test_a_permuted_mesh_is_searched_too)
    assert [m.shape for m in candidate_meshes(8, cluster=A100)] == [(8,), (2, 4), (4, 2)]
    two_hosts = meshplan.load_cluster("examples/clusters/dgx-a100-x2.json")
    shapes16 = [m.shape for m in candidate_meshes(16, cluster=two_hosts)]
    assert (2, 8) in shapes16 and (8, 2) in shapes16 and any(len(s) == 3 for s in shapes16)
    m = build_model("mlp")
    g = trace(m.train_step, *m.abstract_args)
    meshes = candidate_meshes(8, 3)
    best, results = best_intra_op(g, A100, meshes=meshes)
    assert len(results) == 4
    assert best.objective_s == min(r.objective_s for r in results)
    r3 = [r for r in results if len(r.mesh.shape) == 3][0]
    assert len(r3.input_specs) == len(g.inputs)


def test_odd_sizes_only_split_where_divisible():
    m = build_model("mlp", dict(batch="12", in_dim="30", hidden="20", layers="2", out_dim="6"))
    g = trace(m.train_step, *m.abstract_args)
    for mesh in (LogicalMesh(("x",), (8,)), LogicalMesh(("x", "y"), (2, 4))):
        r = solve_intra_op(g, A100, mesh)
        for inp, spec in zip(g.inputs, r.input_specs):
            shape = g.tensors[inp.tensor].shape
            for size, axes in zip(shape, spec_from_names(spec, mesh.axes)):
                assert size % math.prod(mesh.shape[a] for a in axes) == 0
        for t, spec in r.constraints:
            shape = g.tensors[t].shape
            for size, axes in zip(shape, spec_from_names(spec, mesh.axes)):
                assert size % math.prod(mesh.shape[a] for a in axes) == 0


# ---- exact reductions and dynamic programming ---------------------------------

from meshplan.ilp.presolve import eliminate, reduce_problem  # noqa: E402
from meshplan.ilp.dp import min_sum_eliminate  # noqa: E402


@pytest.mark.parametrize("seed", range(30))
def test_reductions_and_dp_keep_the_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    p = random_problem(rng, int(rng.integers(3, 9)), memory=False)
    best, val = brute_force(p)
    red = reduce_problem(p)
    assert brute_force(red.problem)[1] == pytest.approx(val, rel=1e-9, abs=1e-12)
    q, el = eliminate(red.problem)
    qb, qv = brute_force(q)
    assert qv + el.offset == pytest.approx(val, rel=1e-9, abs=1e-12)
    choice = el.recover(qb, red.problem.num_groups)
    assert red.problem.objective(choice) == pytest.approx(val, rel=1e-9, abs=1e-12)
    got = min_sum_eliminate(p)
    assert got is not None and p.objective(got[0]) == pytest.approx(val, rel=1e-9, abs=1e-12)
    sol = solve(p)
    assert sol.objective == pytest.approx(val, rel=1e-9, abs=1e-12)


def test_dp_reuses_identical_layers():
    """Hubs with many identical pieces: every piece gets the same (optimal) answer."""
    rng = np.random.default_rng(3)
    hub_costs = [rng.random(3), rng.random(4)]
    piece = [rng.random(3), rng.random(5)]
    e_h0 = rng.random((3, 3))          # hub0 - piece[0]
    e_in = rng.random((3, 5))          # piece[0] - piece[1]
    e_h1 = rng.random((4, 5))          # hub1 - piece[1]
    costs = list(hub_costs)
    edges = []
    for k in range(12):
        a, b = len(costs), len(costs) + 1
        costs += [piece[0].copy(), piece[1].copy()]
        edges += [Edge(0, a, e_h0), Edge(a, b, e_in), Edge(1, b, e_h1)]
    p = IlpProblem([f"g{i}" for i in range(len(costs))], costs, edges)
    got = min_sum_eliminate(p)
    assert got is not None
    choice, _ = got
    # exact: compare with the MIP on the same problem
    assert p.objective(choice) == pytest.approx(solve(p, dp=False).objective, rel=1e-9)
    pieces = {(choice[2 + 2 * k], choice[3 + 2 * k]) for k in range(12)}
    assert len(pieces) == 1


def test_dp_respects_memory_through_the_mip():
    """When the DP answer does not fit, the MIP decides (and its answer fits)."""
    m = build_model("mlp", dict(batch="64", in_dim="2048", hidden="2048", layers="2", out_dim="2048"))
    g = trace(m.train_step, *m.abstract_args)
    state_bytes = g.param_bytes + g.role_bytes(OPT_STATE)
    r = solve_intra_op(g, A100, LogicalMesh(("x",), (8,)), memory_budget=0.6 * state_bytes)
    assert r.solution.backend in ("highs", "dp")
    assert r.peak_memory_bytes <= 0.6 * state_bytes


@pytest.mark.parametrize("config, reshards", [
    ({"layers": "1"}, False),
    # large enough that the plan splits the model and reshards between operators
    ({"layers": "1", "hidden": "256", "heads": "4", "seq_len": "128", "vocab": "1024",
      "batch": "16"}, True),
])
def test_comm_breakdown_adds_up(config, reshards):
    m = build_model("gpt", config)
    g = trace(m.train_step, *m.abstract_args)
    r = solve_intra_op(g, A100, LogicalMesh(("x", "y"), (2, 4)))
    assert sum(b for _, b in r.comm_by_kind) == pytest.approx(r.comm_bytes)
    assert sum(c.nbytes for c in r.collectives) == pytest.approx(r.comm_bytes)
    assert r.comm_s >= 0 and r.objective_s > 0
    # every laid-out intermediate is pinned, and reshards are listed per operand
    laid = {t for t, _ in r.constraints}
    assert len(laid) > len(g.nodes) // 2
    # a read constraint names the reader (by its first result) and one of its
    # operands, in a layout of that operand's rank other than the one planned
    # for the operand's value
    planned = dict(r.constraints)
    planned.update((i.tensor, s) for i, s in zip(g.inputs, r.input_specs))
    if reshards:
        assert r.comm_bytes > 0 and r.read_constraints
    for tid, pos, spec in r.read_constraints:
        reader = g.nodes[g.producer[tid]]
        assert reader.outputs[0] == tid and 0 <= pos < len(reader.inputs)
        operand = reader.inputs[pos]
        assert len(spec) == len(g.tensors[operand].shape)
        assert planned[operand] != spec


@pytest.mark.extended
def test_deep_gpt_plans_quickly():
    """A 12-layer GPT on 2 x 4: identical layers are solved once (exact), so
    the ILP is solved to optimality inside its time limit (how long it takes
    is benchmarks/ilp_scaling.py's figure, not a unit test's)."""
    m = build_model("gpt", {"layers": "12", "hidden": "256", "heads": "4", "seq_len": "128",
                            "vocab": "1024", "batch": "16", "compute_dtype": "bfloat16"})
    g = trace(m.train_step, *m.abstract_args)
    r = solve_intra_op(g, A100, LogicalMesh(("x", "y"), (2, 4)))
    assert r.solution.status == "optimal"


def test_gpt_on_one_dgx_is_batch_times_megatron():
    # GPT-style block with a 4096 hidden size and 2048-token sequences on the
    # 2 x 4 mesh of one DGX A100: the MLP of every block runs Megatron's
    # column-then-row split over one mesh axis while the batch is split over
    # the other (the weights' remaining dimension is sharded ZeRO-style over
    # the batch axis).
    m = build_model("gpt", dict(hidden=4096, heads=32, seq_len=2048, vocab=51200, batch=16,
                                layers=1, dtype="float32", compute_dtype="bfloat16"))
    g = trace(m.train_step, *m.abstract_args)
    r = solve_intra_op(g, A100, LogicalMesh(("x", "y"), (2, 4)))
    specs = {i.path: s for i, s in zip(g.inputs, r.input_specs)}
    fc = specs["['params']['h0']['mlp']['fc']['w']"]
    proj = specs["['params']['h0']['mlp']['proj']['w']"]
    tp = fc[1]
    assert tp in ("x", "y") and proj[0] == tp, (fc, proj)    # column then row, same axis
    dp = "y" if tp == "x" else "x"
    weights = ((4096, 16384), (16384, 4096))
    mlp = [s for n, s in _dot_strategies(g, r)
           if g.tensors[n.inputs[1]].shape in weights and len(g.tensors[n.outputs[0]].shape) == 3][:2]
    assert len(mlp) == 2, mlp
    for s in mlp:
        assert f"{dp}:o0" in s.split(), s                      # the batch on the other axis
    assert mlp[0].split()[0 if tp == "x" else 1] == f"{tp}:o2"  # column split: output features
    assert mlp[1].split()[0 if tp == "x" else 1].startswith(f"{tp}:sum")  # row split: partial sums
