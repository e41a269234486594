"""Layer ILPs sent to the worker processes in batches by mesh shape (one
IlpCaches per batch): every job once, and the same plan as one by one."""
from __future__ import annotations

from pathlib import Path

import pytest

import meshplan
import meshplan.dp_search.solver as solver_mod
from meshplan.api import trace_step
from meshplan.dp_search import Session
from meshplan.dp_search.search import plan_pipeline
from meshplan.dp_search.solver import batches
from meshplan.models import build_model
from meshplan.plan import LogicalMesh
from meshplan.request import PipelineOptions

ROOT = Path(__file__).resolve().parents[1]


def test_batches_keep_one_mesh_shape_and_share_the_work():
    a, b = LogicalMesh(("x", "y"), (2, 4)), LogicalMesh(("x",), (8,))
    keys = [("k", i) for i in range(21)]
    mesh_of = {k: (a if k[1] % 3 else b) for k in keys}
    parts = batches(keys, mesh_of, workers=2)
    assert sorted(k for p in parts for k in p) == sorted(keys)      # every job once
    assert all(len({mesh_of[k].shape for k in p}) == 1 for p in parts)
    assert max(len(p) for p in parts) == 3                         # ceil(21 / (4 * 2))
    assert [len(p) for p in batches(keys[:5], mesh_of, workers=2)] == [1] * 5


@pytest.mark.slow      # (13 s on the 2-core machine)
def test_workers_plan_as_one_process_does(monkeypatch):
    m = build_model("gpt", {"layers": "2", "hidden": "64", "batch": "8", "seq_len": "16",
                            "heads": "2", "vocab": "64"})
    g = trace_step(m.train_step, m.abstract_args, tuple(m.batch_argnums), "gpt")[0]
    cluster = meshplan.load_cluster(ROOT / "examples/clusters/dgx-a100-x1.json")
    opts = PipelineOptions(num_micro_batches=(1,), schedules=("1f1b",))
    sent: list = []
    real = solver_mod.LayerSolver._send

    def counted(self, todo):
        sent.append(len(todo))
        return real(self, todo)
    monkeypatch.setattr(solver_mod.LayerSolver, "_send", counted)
    alone = plan_pipeline(g, cluster, meshplan.PipeshardParallel(), options=opts,
                          session=Session(workers=1)).to_json()
    assert not sent
    pooled = plan_pipeline(g, cluster, meshplan.PipeshardParallel(), options=opts,
                           session=Session(workers=2)).to_json()
    assert sent and max(sent) >= 8          # (the workers did solve a batch)
    assert pooled == alone
