"""The ILP's explicit configuration and caches, and the rules its modules keep:
no configuration read inside the algorithms, no module-level mutable state."""
import ast
import dataclasses
import pathlib

import numpy as np
import pytest

import meshplan
from meshplan.cost_model.mesh import mesh_model
from meshplan.ilp import IlpCaches, SolverOptions, build_problem, solve_intra_op
from meshplan.ilp.presolve import Presolved, presolve, reduced
from meshplan.ilp.problem import Edge, IlpProblem, MemoryRow, brute_force
from meshplan.ilp.solvers import solve
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.trace import trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100 = meshplan.load_cluster("examples/clusters/dgx-a100-x1.json")
ENV = ("MESHPLAN_ILP_DUMP", "MESHPLAN_HIGHS_PRESOLVE", "MESHPLAN_ILP_LOG", "MESHPLAN_DP_DEBUG")


def _chain(n=6, k=3, seed=0):
    """A problem with a memory row that binds, so the MIP decides."""
    rng = np.random.default_rng(seed)
    costs = [rng.random(k) for _ in range(n)]
    edges = [Edge(i, (i + 1) % n, rng.random((k, k))) for i in range(n)]
    edges += [Edge(i, (i + 2) % n, rng.random((k, k))) for i in range(n)]
    coefs = {g: rng.random(k) * 10 for g in range(n)}
    mem = [MemoryRow(coefs, sum(float(np.median(c)) for c in coefs.values()), "mem")]
    return IlpProblem([f"g{i}" for i in range(n)], costs, edges, mem)


def test_default_options_are_todays_behaviour_without_variables():
    assert SolverOptions() == SolverOptions.from_env({})
    o = SolverOptions()
    assert (o.dump_path, o.highs_presolve, o.log, o.dp_debug) == (None, "off", False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.log = True


def test_options_from_env():
    o = SolverOptions.from_env({"MESHPLAN_ILP_DUMP": "/tmp/x.lp", "MESHPLAN_HIGHS_PRESOLVE": "on",
                                "MESHPLAN_ILP_LOG": "1", "MESHPLAN_DP_DEBUG": "1"})
    assert o == SolverOptions(dump_path="/tmp/x.lp", highs_presolve="on", log=True, dp_debug=True)
    assert SolverOptions.from_env({"MESHPLAN_ILP_DUMP": "", "MESHPLAN_ILP_LOG": ""}) == SolverOptions()
    with pytest.raises(ValueError, match="MESHPLAN_ILP_LOG"):
        SolverOptions.from_env({"MESHPLAN_ILP_LOG": "yes"})


def test_solvers_read_options_not_the_environment(tmp_path, monkeypatch, capsys):
    p = _chain()
    dump = tmp_path / "env.lp"
    for name in ENV:
        monkeypatch.setenv(name, str(dump) if name == "MESHPLAN_ILP_DUMP" else "1")
    plain = solve(p, dp=False)
    assert not dump.exists() and "dp max table" not in capsys.readouterr().out
    asked = tmp_path / "asked.lp"
    got = solve(p, dp=False, options=SolverOptions(dump_path=str(asked)))
    assert asked.exists() and "s_g0_0" in asked.read_text()     # named variables
    assert got.choice == plain.choice
    solve(p, options=SolverOptions(dp_debug=True))
    assert "dp max table" in capsys.readouterr().out


def test_shared_caches_change_no_result():
    m = build_model("gpt", {"layers": "1", "hidden": "256", "heads": "4", "seq_len": "128",
                            "vocab": "1024", "batch": "16"})
    g = trace(m.train_step, *m.abstract_args)
    caches = IlpCaches()
    meshes = [LogicalMesh(("x", "y"), (2, 4)), LogicalMesh(("x",), (8,))]
    for _ in range(2):      # the second round finds everything in the caches
        for mesh in meshes:
            shared = solve_intra_op(g, A100, mesh, caches=caches)
            fresh = solve_intra_op(g, A100, mesh)
            assert shared.solution.choice == fresh.solution.choice
            assert shared.objective_s == fresh.objective_s
            assert shared.collectives == fresh.collectives
    mms = [mesh_model(A100, mesh) for mesh in meshes]
    assert all(caches.reshard(mm).steps and caches.reshard(mm).columns for mm in mms)
    built = build_problem(g, mms[0], caches=caches)
    assert [list(c) for c in built.problem.costs] == \
        [list(c) for c in build_problem(g, mms[0]).problem.costs]


def test_caches_forget_when_full():
    caches = IlpCaches(max_meshes=1)
    a, b = (mesh_model(A100, LogicalMesh(("x",), (n,)), submesh=(1, n)) for n in (4, 8))
    caches.reshard(a).steps["k"] = ()
    assert caches.reshard(a).steps == {"k": ()}
    caches.reshard(b)
    assert caches.reshard(a).steps == {}


@pytest.mark.parametrize("seed", range(10))
def test_presolve_lifts_back_to_the_optimum(seed):
    p = _chain(n=5, seed=seed)
    p.memory = []
    best, val = brute_force(p)
    pre = presolve(p)
    sub, sub_val = brute_force(pre.problem)
    choice = pre.lift(sub)
    assert p.objective(choice) == pytest.approx(val, rel=1e-9)
    assert brute_force(reduced(p))[1] == pytest.approx(sub_val, rel=1e-9)
    assert Presolved(p).lift(best) == best


def _module_state(path: pathlib.Path) -> list[str]:
    """Module-level names bound to mutable values or caches, and global statements."""
    tree = ast.parse(path.read_text())
    bad = []
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, mutable) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict")):
            bad.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if "cache" in ast.unparse(d):
                    bad.append(f"{path.name}:{node.lineno} {ast.unparse(d)}")
    bad += [f"{path.name}:{n.lineno} global" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return bad


# where configuration is parsed, once, at the edge (the rest receives it)
EDGES = {"ilp": ["options.py"], "cost_model": [], "dp_search": ["session.py"],
         "runtime": []}


@pytest.mark.parametrize("folder", ["ilp", "cost_model", "dp_search", "runtime"])
def test_no_module_level_state_and_no_environment_reads(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    assert [b for f in files for b in _module_state(f)] == []
    readers = [f.name for f in files if "environ" in f.read_text() or "getenv" in f.read_text()]
    assert readers == EDGES[folder]
