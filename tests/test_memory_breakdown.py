"""Each stage's memory by what it holds, figures in readable units, and
refusals that say which part of a stage is over the budget and by how much."""
import json
import re

import pytest

import meshplan
from meshplan.layout_moves import spec_from_names
from meshplan.graph import OPT_STATE, PARAM
from meshplan.ilp import peak_parts
from meshplan.models import build_model
from meshplan.plan import MemoryBreakdown, Plan, Predicted
from meshplan.trace import trace
from meshplan.units import human_bytes, human_rate, human_time

DGX = "examples/clusters/dgx-a100-x1.json"
GPT = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 8}


def _plan(method, model="gpt", config=GPT, cluster=DGX):
    m = build_model(model, config)
    return meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.load_cluster(cluster),
                         method=method)


def _tiny_cluster(tmp_path, memory_bytes):
    data = json.loads(open(DGX).read())
    data["device"]["memory_bytes"] = memory_bytes
    (tmp_path / "tiny.json").write_text(json.dumps(data))
    return str(tmp_path / "tiny.json")


def test_units_adapt_to_the_size():
    assert human_bytes(0) == "0 B" and human_bytes(1000) == "1000 B"
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(5 * 2**20) == "5.00 MiB"
    assert human_bytes(97.3 * 2**30) == "97.3 GiB" and human_bytes(-2048) == "-2.00 KiB"
    assert human_time(2.5) == "2.50 s" and human_time(0.0123) == "12.3 ms"
    assert human_time(4.5e-6) == "4.50 µs" and human_time(0) == "0 s"
    assert human_rate(2.54e9) == "2.54 GFLOP/s" and human_rate(156e12) == "156 TFLOP/s"
    assert human_rate(3.2e6) == "3.20 MFLOP/s"


def test_breakdown_round_trips_and_old_plans_load_without_it():
    mem = MemoryBreakdown(params=10, grads=20, optimizer=40, activations=7, temporaries=3)
    pr = Predicted(1e-3, 2e-4, 80, mem)
    assert Predicted.from_dict(json.loads(json.dumps(pr.to_dict()))) == pr
    assert pr.to_dict()["memory"] == {"params": 10, "grads": 20, "optimizer": 40,
                                      "activations": 7, "temporaries": 3}
    # a figure without a breakdown (an older plan) writes no key and reads back as None
    old = Predicted(1e-3, 2e-4, 80)
    assert "memory" not in old.to_dict()
    assert Predicted.from_dict(old.to_dict()).memory is None
    assert str(mem) == "80 B = params 10 B + grads 20 B + optimizer 40 B + activations 7 B + " \
                       "temporaries 3 B"


def test_a_saved_plan_without_breakdowns_loads_and_writes_back_unchanged():
    plan = _plan(meshplan.ShardParallel())
    d = json.loads(plan.to_json())
    for st in d["stages"]:
        del st["predicted"]["memory"]
    text = json.dumps(d, indent=2)
    old = Plan.from_json(text)
    assert all(s.predicted.memory is None for s in old.stages)
    assert old.to_json() == text


def test_one_stage_breakdown_adds_up_to_the_stage_memory():
    plan = _plan(meshplan.DataParallel())
    st = plan.stages[0]
    mem = st.predicted.memory
    assert mem.total == st.predicted.memory_bytes == plan.predicted.peak_memory_bytes
    assert min(mem.params, mem.optimizer, mem.activations, mem.temporaries) >= 0
    # data parallel replicates the state: every device holds all of it
    m = build_model("gpt", GPT)
    g = trace(m.train_step, *m.abstract_args)
    assert mem.params == g.role_bytes(PARAM) and mem.optimizer == g.role_bytes(OPT_STATE)
    assert mem.activations > 0
    assert Plan.from_json(plan.to_json()).stages[0].predicted.memory == mem


def test_one_stage_breakdown_follows_the_chosen_layouts():
    plan = _plan(meshplan.ShardParallel())
    mem = plan.stages[0].predicted.memory
    assert mem.total == plan.stages[0].predicted.memory_bytes
    m = build_model("gpt", GPT)
    g = trace(m.train_step, *m.abstract_args)
    # the parameters as the plan lays them out, one shard per device
    mesh = plan.logical_mesh
    specs = dict(plan.stages[0].params)
    local = 0
    for inp in g.inputs:
        if inp.role == PARAM:
            spec = specs[inp.path]
            ways = 1
            for d in spec_from_names(spec, mesh.axes):
                for a in d:
                    ways *= mesh.shape[a]
            local += g.tensors[inp.tensor].nbytes / ways
    assert mem.params == int(local)


def test_peak_parts_adds_up_to_the_peak():
    m = build_model("gpt", GPT)
    g = trace(m.train_step, *m.abstract_args)
    # everything replicated on one device: the parts are the tensors' full sizes
    total, parts = peak_parts(g, (1,), {})
    assert parts["input:param"] == g.role_bytes(PARAM)
    assert parts["forward"] + parts["grads"] + parts["other"] > 0
    assert abs(total - sum(parts.values())) < 1


def test_pipeline_breakdown_adds_up_to_each_stage_memory():
    plan = _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2))
    assert len(plan.stages) == 2
    for st in plan.stages:
        mem = st.predicted.memory
        assert mem.total == st.predicted.memory_bytes
        assert mem.params > 0 and mem.optimizer > 0 and mem.activations > 0
        assert mem.grads >= 0 and mem.temporaries >= 0
    assert Plan.from_json(plan.to_json()).stages == plan.stages


def test_an_evaluation_steps_pipeline_holds_no_gradients():
    # (every stage was charged its parameters' bytes again as gradients,
    # where the one-stage plan of the same step holds none)
    import jax.numpy as jnp

    def eval_step(p, batch):
        x = batch["x"]
        for w in p:
            x = jnp.tanh(x @ w)
        return {"loss": jnp.mean((x - batch["y"]) ** 2)}
    p = [jnp.ones((64, 64)) * 0.01 for _ in range(4)]
    batch = {"x": jnp.ones((16, 64)), "y": jnp.zeros((16, 64))}
    plan = meshplan.plan(eval_step, p, batch, cluster=meshplan.Cluster.local(),
                         method=meshplan.PipeshardParallel(stages=2))
    assert len(plan.stages) == 2
    for s in plan.stages:
        assert s.predicted.memory.grads == 0 and s.predicted.memory.params > 0


def test_a_small_plan_prints_no_zero_figures():
    text = str(_plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2)))
    assert "0.00" not in text and "0.000" not in text, text
    line = next(l for l in text.splitlines() if l.startswith("  stage 0"))
    assert re.search(r"memory [\d.]+ KiB = params [\d.]+ KiB \+ grads .* \+ optimizer .* \+ "
                     r"activations .* \+ temporaries ", line), line
    assert re.search(r"compute [\d.]+ (µs|ms)", line), line
    assert re.search(r"[\d.]+ (MFLOP/s|GFLOP/s) per device", text), text


def test_a_manual_plan_without_recomputation_names_the_cause_and_the_excess(tmp_path):
    cluster = _tiny_cluster(tmp_path, 50_000)
    with pytest.raises(meshplan.InfeasiblePlanError) as info:
        _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2, remat=False),
              model="mlp", config={"layers": 4}, cluster=cluster)
    text = str(info.value)
    assert "\n" not in text
    assert "recomputation is off" in text and "any number of stages" not in text
    over = re.search(r"needs at least ([\d.]+) KiB per device \(parameters [\d.]+ K?i?B, "
                     r"gradients [\d.]+ K?i?B, optimizer state [\d.]+ K?i?B, activations [\d.]+ "
                     r"K?i?B for \d micro-batch\(es\) in flight, temporaries [\d.]+ K?i?B\) "
                     r"against a budget of 43\.9 KiB \(0\.9 x 48\.8 KiB\): ([\d.]+) (KiB|B) over",
                     text)
    assert over, text
    e = info.value
    assert e.needed_bytes > e.budget_bytes == int(0.9 * 50_000)
    # (the text rounds to 0.1 KiB: within half of that)
    assert over.group(3) == "B" or abs(float(over.group(2)) * 1024
                                       - (e.needed_bytes - e.budget_bytes)) <= 0.05 * 1024


def test_a_failed_search_gives_the_smallest_excess(tmp_path):
    cluster = _tiny_cluster(tmp_path, 30_000)
    # (offload="none": with its Adam state in host memory one stage would fit)
    with pytest.raises(meshplan.InfeasiblePlanError) as info:
        _plan(meshplan.Auto(offload="none"), model="mlp", config={"layers": 4}, cluster=cluster)
    text = str(info.value)
    assert "\n" not in text and "any number of stages" in text
    assert re.search(r"the closest stage is [\d.]+ (KiB|B) over the [\d.]+ KiB budget", text), text
    assert info.value.needed_bytes > info.value.budget_bytes


def test_a_stage_whose_state_alone_is_over_the_budget_says_so():
    # (the budget is below the stage's parameters and optimizer state even
    # split evenly over its devices: no layer ILP is asked, the state is the cause)
    with pytest.raises(meshplan.InfeasiblePlanError) as info:
        _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2, memory_fraction=1e-8),
              cluster="examples/clusters/dgx-a100-x1.json")
    text = str(info.value)
    assert "\n" not in text and "Manual(dp=2, tp=2, pp=2)" in text
    parts = re.search(r"needs at least ([\d.]+) (KiB|B) per device \(parameters ([\d.]+) (KiB|B), "
                      r"gradients 0 B, optimizer state ([\d.]+) (KiB|B), activations 0 B", text)
    assert parts, text
    assert float(parts.group(3)) > 0 and float(parts.group(5)) > 0
    assert "0.9 x" not in text and "1e-08 x" in text


def test_a_layer_that_fits_no_sharding_is_named_as_the_cause():
    # (the state fits split over a stage, but no layer ILP finds a sharding
    # within the budget: the refusal says so instead of giving no reason)
    with pytest.raises(meshplan.InfeasiblePlanError) as info:
        _plan(meshplan.Manual(dp=2, tp=2, pp=2, num_micro_batches=2, remat=False,
                              memory_fraction=1e-6))
    text = str(info.value)
    assert "\n" not in text
    assert ("some layer of every candidate stage has no sharding within the budget of "
            "83.9 KiB per device (1e-06 x 80.0 GiB) even on its own" in text), text
    assert "recomputation is off" in text


def test_a_pipeline_stage_holds_its_gradients_beside_its_working_set():
    """Running gradient sums (or the gradients a backward program hands the
    update program) live all step, so they add to one layer's working set;
    in one program they are counted inside it, as XLA may update each
    parameter as soon as its gradient is made."""
    from meshplan.dp_search.stages import GroupCost
    c = GroupCost(time_s=1.0, resident_bytes=300.0, saved_bytes=40.0, transient_bytes=50.0,
                  remat_time_s=1.3, boundary_bytes=10.0, activation_bytes=90.0,
                  grad_bytes=100.0, optimizer_bytes=200.0)
    staged = c.memory(keep=2, remat=False)
    assert staged.to_dict() == {"params": 100, "grads": 100, "optimizer": 200,
                                "activations": 80, "temporaries": 50}
    assert staged.total == 300 + 100 + 2 * 40 + 50
    alone = c.memory(keep=1, remat=False, one_program=True)
    assert alone.total == 300 + 40 + 50 and alone.grads == 50     # (inside the working set)
