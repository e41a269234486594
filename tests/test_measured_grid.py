"""benchmarks/measured_grid.py: its statistics on synthetic numbers and its
configuration grid (nothing is planned or run here)."""
import importlib.util
import math
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def grid():
    sys.path.insert(0, str(BENCH))            # measured_grid imports _fake_devices
    try:
        spec = importlib.util.spec_from_file_location("measured_grid", BENCH / "measured_grid.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["measured_grid"] = module          # (its dataclasses look it up)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    yield module
    sys.modules.pop("measured_grid", None)


def test_mape_known_values(grid):
    assert grid.mape([1.0, 2.0], [1.0, 2.0]) == 0.0
    # |1.1 - 1| / 1 = 10 %, |1 - 2| / 2 = 50 %  -> 30 %
    assert grid.mape([1.1, 1.0], [1.0, 2.0]) == pytest.approx(30.0)
    assert math.isnan(grid.mape([], []))


def test_spearman_perfect_reversed_and_degenerate(grid):
    meas = [0.3, 0.1, 0.2, 0.5]
    assert grid.spearman([3.0, 1.0, 2.0, 5.0], meas) == pytest.approx(1.0)
    # a monotone but non-linear prediction ranks the same
    assert grid.spearman([9.0, 1.0, 4.0, 25.0], meas) == pytest.approx(1.0)
    assert grid.spearman([-3.0, -1.0, -2.0, -5.0], meas) == pytest.approx(-1.0)
    assert math.isnan(grid.spearman([1.0, 2.0], [1.0, 2.0]))        # too few points
    assert math.isnan(grid.spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant


def test_auto_position(grid):
    assert grid.auto_position(1.0, [2.0, 3.0]) == (1.0, 1, 3)        # auto fastest
    ratio, rank, n = grid.auto_position(3.0, [1.5, 2.0, 4.0])
    assert (ratio, rank, n) == (2.0, 3, 4)


def test_predicted_fastest_ratio_and_pass_disagreement(grid):
    k, ratio = grid.predicted_fastest_ratio([0.5, 0.2, 0.9], [2.0, 3.0, 1.0])
    assert k == 1 and ratio == pytest.approx(3.0)
    assert grid.predicted_fastest_ratio([1.0, 2.0], [1.0, 2.0]) == (0, 1.0)
    assert grid.pass_disagreement(1.0, 1.0) == 0.0
    assert grid.pass_disagreement(0.9, 1.1) == pytest.approx(20.0)


def test_ratio_by_and_summary(grid):
    def row(pp, pred, meas, method="manual"):
        return {"pp": pp, "method": method, "config": f"{method} pp={pp} {pred}",
                "status": "ok", "predicted_s": pred, "measured_s": meas,
                "pass_disagreement_pct": 1.0}
    rows = [row(1, 1.0, 1.0), row(2, 4.0, 1.0), row(2, 1.0, 1.0), row(4, 2.0, 4.0),
            row(1, 0.5, 0.8, "auto"),
            {"pp": 8, "method": "manual", "config": "refused one", "status": "refused: x",
             "predicted_s": None, "measured_s": None}]
    by = grid.ratio_by([r for r in rows if r["measured_s"]], "pp")
    assert by[2] == (pytest.approx(2.0), 2)                          # geomean of 4 and 1
    s = grid.summarize(rows)
    assert (s["configurations"], s["measured"], s["refused"], s["errors"]) == (6, 5, 1, 0)
    assert s["auto_rank"] == 1 and s["auto_of"] == 5 and s["auto_ratio"] == pytest.approx(1.0)
    assert s["predicted_fastest"].startswith("auto")
    assert s["predicted_fastest_ratio"] == pytest.approx(1.0)
    assert s["fastest_ms"] == pytest.approx(800.0)
    assert s["median_ratio"] == pytest.approx(1.0)                   # 1, 4, 1, 0.5, 0.625


def test_grid_has_40_distinct_valid_manual_configurations(grid):
    todo = grid.run_list(["gpt", "moe"])
    manual = [(m, c) for m, c in todo if not c.auto]
    assert len(set(manual)) == len(manual) >= 40
    assert sum(c.auto for _, c in todo) == 2                         # one Auto() per model
    for _, c in manual:
        assert c.dp * c.tp * c.pp == 8
        assert c.mb >= 1 and 16 % (c.dp * c.mb) == 0                # the batch splits
        method = c.method()                                          # Manual validates itself
        assert method.request(8) is not None
    # every factor varies
    cs = [c for _, c in manual]
    assert {c.pp for c in cs} == {1, 2, 4, 8}
    assert {c.tp for c in cs} == {1, 2, 4, 8}
    assert {c.remat for c in cs} == {False, True}
    assert len({c.mb for c in cs}) >= 3 and len({c.schedule for c in cs}) == 2
    quick = grid.run_list(["gpt"], quick=True)
    assert 2 <= len(quick) <= 6


def test_scaled_cluster_scales_one_term_and_keeps_the_rest(grid):
    import json
    import meshplan
    path = BENCH / "results" / "measured_grid_cluster.json"
    data = json.loads(path.read_text())
    flops = grid.scaled_cluster(data, "device.peak_flops", 0.5)
    assert flops["device"]["peak_flops"] == {k: v * 0.5 for k, v in
                                             data["device"]["peak_flops"].items()}
    launch = grid.scaled_cluster(data, "device.achieved.kernel_launch_s", 2.0)
    assert launch["device"]["achieved"]["kernel_launch_s"] == pytest.approx(
        2 * data["device"]["achieved"]["kernel_launch_s"])
    # the copy differs in that one number; the original is untouched
    launch["device"]["achieved"]["kernel_launch_s"] = data["device"]["achieved"]["kernel_launch_s"]
    assert launch == data and data == json.loads(path.read_text())
    # every term the sensitivity table scales is there, and loads
    for term in grid.SENSITIVITY_TERMS:
        meshplan.ClusterSpec.from_dict(grid.scaled_cluster(data, term, 2.0))
    for bad in ("device.kind", "device.no_such_term", "nowhere.at.all"):
        with pytest.raises(ValueError, match="no number"):
            grid.scaled_cluster(data, bad, 2.0)


def test_sensitivity_needs_a_recorded_run(grid, capsys):
    with pytest.raises(SystemExit):
        grid.parse(["--sensitivity"])
    assert "--repredict" in capsys.readouterr().err


def test_agreement_between_passes_and_runs(grid, tmp_path):
    head = "model,method,dp,tp,pp,mb,remat,schedule,pass1_ms,pass2_ms,measured_ms\n"
    rows = [("manual", 8, 1), ("manual", 4, 2), ("manual", 2, 4), ("auto", 1, 1)]
    one = head + "".join(f"gpt,{m},{dp},{tp},1,1,no,1f1b,{p},{p + 1},{p + 0.5}\n"
                         for (m, dp, tp), p in zip(rows, (10, 20, 30, 40)))
    # the second run ranks the configurations in reverse; its second pass
    # swaps the first two; a row it did not measure is left out
    two = head + "".join(f"gpt,{m},{dp},{tp},1,1,no,1f1b,{p},{q},{p}\n"
                         for (m, dp, tp), p, q in zip(rows, (40, 30, 20, 10), (30, 40, 20, 10)))
    two += "gpt,manual,1,8,1,1,no,1f1b,,,\n"
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(one)
    b.write_text(two)
    assert set(grid.recorded_times(str(b))) == {("gpt", m, str(dp), str(tp), "1", "1", "no",
                                                 "1f1b") for m, dp, tp in rows}
    lines = grid.agreement([str(a), str(b)], ["gpt"])
    assert lines == [f"gpt {a}: passes 1.000 (4 rows)", f"gpt {b}: passes 0.800 (4 rows)",
                     f"gpt {a} vs {b}: -1.000 (4 rows)"]
