"""The layer ILP's builder takes shortcuts (resharding moves found once per
layout pair and priced per size, columns and follower mappings memoised per
build): the problem it builds must be the one the plain definitions give."""
import numpy as np
import pytest

import meshplan
from meshplan.cost_model.collectives import fixed_s
from meshplan.cost_model.mesh import mesh_model
from meshplan.cost_model.sharding import enumerate_specs, reshard_steps
from meshplan.graph import GRAD_BOUNDARY
from meshplan.ilp import IlpCaches, build_problem
from meshplan.ilp.caches import ReshardMemo
from meshplan.ilp.decode import explain
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

A100 = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
A100_X2 = meshplan.load_cluster("examples/clusters/dgx-a100-x2.json")
GPT = {"layers": "1", "hidden": "64", "heads": "4", "seq_len": "32", "vocab": "128", "batch": "8"}
# (model, cluster, mesh); three mesh axes make a GPT layer's build slow: an MLP there
CASES = [("gpt", A100, LogicalMesh(("x", "y"), (2, 4))),
         ("mlp", A100, LogicalMesh(("x", "y", "z"), (2, 2, 2))),
         ("gpt", A100_X2, LogicalMesh(("x", "y"), (2, 8)))]
IDS = ["gpt-2x4", "mlp-2x2x2", "gpt-2x8-two-hosts"]


@pytest.fixture(scope="module")
def graphs():
    """model -> (traced step, its parameter gradients)."""
    out = {}
    for name, cfg in (("gpt", GPT), ("mlp", {"layers": "2"})):
        m = build_model(name, cfg)
        g = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums)
        grads = frozenset(t for n in g.nodes if n.primitive == GRAD_BOUNDARY for t in n.inputs)
        assert grads
        out[name] = g, grads
    return out


def _steps_cost(mm, tt, src, dst, seen):
    key = (tt.id, src, dst)     # (the same call, not the builder's sharing across tensors)
    if key not in seen:
        steps = reshard_steps(mm, tt.shape, tt.nbytes, src, dst)
        seen[key] = (sum(s[1] for s in steps), sum(s[2] for s in steps))
    return seen[key]


@pytest.mark.parametrize("model,cluster,mesh", CASES, ids=IDS)
def test_edges_are_the_reads_costed_one_by_one(graphs, model, cluster, mesh):
    """Every edge matrix cell, recomputed from the groups' reads with the
    plain reshard_steps (no memo), in the order the builder adds them."""
    g, grads = graphs[model]
    mm = mesh_model(cluster, mesh)
    b = build_problem(g, mm, accumulate=grads, grad_accum=4)
    gt = b.group_of_tensor
    want: dict[tuple[int, int], list[np.ndarray]] = {}
    done: dict = {}
    for grp in b.groups:
        for j in range(grp.size):
            seen = set()
            for t, req in grp.reads[j]:
                if (t, req) in seen or not g.tensors[t].shape or t not in gt:
                    continue
                seen.add((t, req))
                h = b.groups[gt[t]]
                if h.gid == grp.gid:
                    continue
                w = 1.0 if (t, req) in grp.steady_reads[j] else 0.25
                sec, byt = want.setdefault((h.gid, grp.gid), [np.zeros((h.size, grp.size)),
                                                              np.zeros((h.size, grp.size))])
                col = np.array([_steps_cost(mm, g.tensors[t], sp[t], req, done)
                                for sp in h.specs])
                sec[:, j] += col[:, 0] * w
                byt[:, j] += col[:, 1] * w
    for o in g.outputs:     # the alias edges: new values into their inputs' layouts
        if o.updates is None or o.tensor not in gt:
            continue
        in_t = g.inputs[o.updates].tensor
        p, h = b.groups[gt[in_t]], b.groups[gt[o.tensor]]
        if not g.tensors[in_t].shape or p.gid == h.gid:
            continue
        sec, byt = want.setdefault((h.gid, p.gid), [np.zeros((h.size, p.size)),
                                                    np.zeros((h.size, p.size))])
        for j in range(p.size):
            col = np.array([_steps_cost(mm, g.tensors[o.tensor], sp[o.tensor], p.specs[j][in_t],
                                        done) for sp in h.specs])
            sec[:, j] += col[:, 0] * 0.25
            byt[:, j] += col[:, 1] * 0.25
    got = {(u, v): (sec, byt) for u, v, sec, byt in b.edge_costs}
    assert sorted(got) == sorted(want)
    assert sum(m.size for m, _ in got.values()) > 10000      # (a problem worth checking)
    assert any(np.count_nonzero(m) for m, _ in got.values())
    for key, (sec, byt) in want.items():
        assert np.array_equal(got[key][0], sec), key
        assert np.array_equal(got[key][1], byt), key
    assert [(e.u, e.v) for e in b.problem.edges] == list(got)
    assert all(e.cost is got[e.u, e.v][0] for e in b.problem.edges)


def test_reshard_steps_is_its_moves_priced():
    """On every pair of layouts of a few shapes: the moves found for one size
    and priced for another are what reshard_steps gives for that size."""
    from meshplan.cost_model.sharding import price_moves, reshard_moves
    for _, cluster, mesh in CASES:
        mm = mesh_model(cluster, mesh)
        memo: dict = {}
        for shape in [(16, 32, 64), (8, 1024)]:
            specs = enumerate_specs(shape, mesh.shape)
            for src in specs:
                for dst in specs:
                    moves = reshard_moves(mesh.shape, src, dst)
                    for nbytes in (4 * np.prod(shape), 6 * np.prod(shape), 0):
                        want = reshard_steps(mm, shape, int(nbytes), src, dst)
                        assert price_moves(mm, int(nbytes), moves) == want
                        assert price_moves(mm, int(nbytes), moves, memo) == want
        assert memo


class _Forgetful(dict):
    """A memo table that keeps nothing: every look-up is computed afresh."""
    def __setitem__(self, key, value):
        pass


def _problem(b):
    p = b.problem
    return ([list(c) for c in p.costs], [(e.u, e.v, e.cost.tolist()) for e in p.edges],
            [(r.name, r.budget, {k: list(v) for k, v in r.coefs.items()}) for r in p.memory],
            [(grp.specs, grp.reads, grp.cost, grp.compute, grp.comm, grp.comm_bytes,
              grp.comm_kinds) for grp in b.groups])


@pytest.mark.parametrize("model,cluster,mesh", CASES[:2], ids=IDS[:2])
def test_memo_tables_change_no_number(graphs, model, cluster, mesh):
    """Built with memo tables that forget, with fresh ones, and with tables
    warmed by other meshes and the same one: the same problem, number for number."""
    g, grads = graphs[model]
    mm = mesh_model(cluster, mesh)
    forgetful = IlpCaches()
    forgetful._reshard[mm] = ReshardMemo(steps=_Forgetful(), columns=_Forgetful(),
                                         collectives=_Forgetful())
    forgetful._moves[mesh.shape] = _Forgetful()
    plain = _problem(build_problem(g, mm, accumulate=grads, grad_accum=2, caches=forgetful))
    assert _problem(build_problem(g, mm, accumulate=grads, grad_accum=2)) == plain
    warm = IlpCaches()
    for other_model, other_cluster, other in CASES:
        if other_model == model:
            build_problem(g, mesh_model(other_cluster, other), caches=warm)
    assert _problem(build_problem(g, mm, accumulate=grads, grad_accum=2, caches=warm)) == plain


@pytest.mark.parametrize("model,cluster,mesh", CASES[:2], ids=IDS[:2])
def test_group_communication_is_what_the_plan_explains(graphs, model, cluster, mesh):
    """For random choices, the communication the ILP charges (groups' own,
    followers included, and edges) is what decode.explain lists collective by
    collective, each worked out from the graph again."""
    g, grads = graphs[model]
    mm = mesh_model(cluster, mesh)
    b = build_problem(g, mm, accumulate=grads, grad_accum=4)
    assert any(grp.members for grp in b.groups)
    rng = np.random.default_rng(0)
    for _ in range(12):
        choice = [int(rng.integers(grp.size)) for grp in b.groups]
        own = [(grp.comm[c], grp.comm_bytes[c]) for grp, c in zip(b.groups, choice)]
        between = [(float(s[choice[u], choice[v]]), float(by[choice[u], choice[v]]))
                   for u, v, s, by in b.edge_costs]
        listed = explain(g, mm, b, choice, dedupe=False, merge=False)
        assert sum(x for x, _ in own + between) == pytest.approx(
            sum(pc.seconds for pc in listed), rel=1e-9)
        # merged, the gradient reductions pay one fixed cost per merged collective
        # (one each: these gradients are far below COMBINE_BYTES)
        buckets = {(pc.kind, pc.axes, pc.per_step) for pc in listed if pc.gradient and pc.axes}
        merged = explain(g, mm, b, choice, dedupe=False)
        assert sum(pc.seconds for pc in merged) == pytest.approx(
            sum(pc.seconds for pc in listed) + sum(
                fixed_s(mm, k, ax) * (1 / 4 if once else 1) for k, ax, once in buckets),
            rel=1e-9)
        assert sum(y for _, y in own + between) == pytest.approx(
            sum(pc.nbytes for pc in listed), rel=1e-9)
