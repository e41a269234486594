"""meshplan.tools.verify: predicted vs compiled communication and memory."""
import pytest

from meshplan.tools.verify import VerifyRow, csv_text, markdown_table, verify


@pytest.mark.parametrize("model, mesh, overrides", [
    ("gpt", (2, 4), {"layers": 1}),
    ("mlp", (8,), {"batch": 256, "hidden": 512}),
    # blocks in a lax.scan, planned and compiled unrolled (meshplan.trace.unstack)
    ("gpt", (2, 4), {"layers": 2, "scan_layers": True}),
])
def test_plan_run_as_planned_communicates_as_predicted(model, mesh, overrides):
    # the runtime pins every reshard the plan makes where it happens, so XLA
    # emits the collectives the cost model predicts
    r = verify(model, mesh, overrides=overrides)
    assert isinstance(r, VerifyRow)
    assert r.actual_comm_bytes > 0
    assert abs(r.comm_rel_error) <= 0.05, (r.predicted_by_kind, r.actual_by_kind)
    assert dict(r.predicted_by_kind)["all-reduce"] > 0
    parts = dict(r.memory_parts)
    assert r.actual_memory_bytes == (parts["argument"] + parts["output"] - parts["alias"]
                                     + parts["temp"])
    assert 0.5 < r.predicted_memory_bytes / r.actual_memory_bytes < 2.0


def test_reports():
    r = verify("gpt", (2, 4), overrides={"layers": 1})
    table = markdown_table([r])
    assert "| gpt | 2x4 |" in table and "AR:" in table
    text = csv_text([r])
    assert text.splitlines()[0].startswith("model,mesh,predicted_comm_bytes")
    assert len(text.splitlines()) == 2
