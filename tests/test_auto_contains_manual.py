"""Property: the search contains every hand plan.  On random small models
and clusters, ``Auto()`` never predicts a slower iteration than a ``Manual``
configuration of the grid (dp x tp x pp x micro-batches x remat x schedule x
sequence parallelism, those that fit), by the same cost model.

Left out of the grid, because Auto does not search them by design:
- ``schedule="interleaved"``: Auto searches GPipe and 1F1B unless told
  (``Auto(schedule=(..., "interleaved"))``), and Manual cuts finer layers
  for its 2 pp chunks (meshplan.dp_search.interleave);
- a stage of ``dp * tp`` devices that does not tile a host (3 devices on
  hosts of 4): Auto's submeshes never straddle hosts (Alpa's shapes);
- ``pp`` above the layers Auto's layering has: Manual then cuts finer
  layers for its stages, Auto keeps one stage per layer at most;
- a ``model`` axis longer than a host with ``dp > 1`` (a stage of two hosts
  on a (2, 4) mesh over hosts of 2): Auto keeps every axis but the first
  inside a host on stages that span hosts.
"""
from __future__ import annotations

import itertools
import pathlib
import random
from dataclasses import replace

import pytest

import meshplan
from meshplan.api import plan_graph, retracer
from meshplan.cluster import parse_cluster
from meshplan.dp_search import Session
from meshplan.dp_search.layers import assign_layers
from meshplan.dp_search.problem import default_layers
from meshplan.errors import InfeasiblePlanError
from meshplan.models import build_model
from meshplan.trace import trace

# (seed: a few cases run in CI; each plans one Auto and its grid)
SEEDS = (0, 1, 2)
GRID_SIZE = 14          # Manual configurations sampled per case (all that fit count)
TOLERANCE = 1e-9        # relative: float sums in a different order
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "clusters"


def random_cluster(rng: random.Random) -> meshplan.ClusterSpec:
    hosts, dph = rng.choice([(1, 2), (1, 4), (2, 2), (2, 4)])
    return parse_cluster({
        "format": "meshplan.cluster/1", "name": f"fake-{hosts}x{dph}",
        "num_hosts": hosts, "devices_per_host": dph, "num_devices": hosts * dph,
        "device": {"kind": "fake", "memory_bytes": rng.choice([2**22, 2**24, 2**30]),
                   "memory_bandwidth_bytes_per_s": 1e12,
                   "peak_flops": {"float32": rng.choice([1e12, 1e13])}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": rng.choice([1e10, 1e11]),
                                 "latency_s": 1e-6},
                  "inter_host": {"bandwidth_bytes_per_s": rng.choice([1e9, 1e10]),
                                 "latency_s": 5e-6}}})


def random_model(rng: random.Random):
    batch = rng.choice([8, 12, 24])
    if rng.random() < 0.5:
        return build_model("mlp", {"layers": rng.choice([2, 3, 4]), "hidden": rng.choice([32, 64]),
                                   "in_dim": 16, "out_dim": 8, "batch": batch})
    return build_model("gpt", {"layers": rng.choice([2, 3]), "hidden": 32, "heads": 2,
                               "seq_len": 8, "vocab": 64, "batch": batch})


def grid(cluster: meshplan.ClusterSpec, batch: int, layers: int):
    D, dph = cluster.num_devices, cluster.devices_per_host
    for pp in range(1, D + 1):
        for tp in range(1, D // pp + 1):
            if D % (pp * tp):
                continue
            dp, n = D // (pp * tp), D // pp
            if pp > layers or (dph % n and n % dph) or (tp > dph and dp > 1):
                continue
            for mb in (b for b in range(1, batch + 1) if batch % b == 0):
                if (batch // mb) % dp:
                    continue
                for remat in (None, True, False):
                    staged = pp > 1 or mb > 1 or remat is True
                    for schedule, sp in itertools.product(("1f1b", "gpipe"), (False, True)):
                        if sp and not (staged and tp > 1):
                            continue    # (sequence parallelism splits over the model axis)
                        yield meshplan.Manual(dp=dp, tp=tp, pp=pp, num_micro_batches=mb,
                                              remat=remat, schedule=schedule,
                                              sequence_parallel=sp)


# (seed 0, the slowest, runs with -m slow; seeds 1 and 2 with -m extended)
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow if s == 0 else
                                               pytest.mark.extended) for s in SEEDS])
def test_auto_is_no_slower_than_any_manual_plan(seed):
    rng = random.Random(seed)
    cluster, m = random_cluster(rng), random_model(rng)
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    auto = plan_graph(graph, cluster, meshplan.Auto(), retrace=rt, session=session)
    layers = assign_layers(graph, default_layers=default_layers(graph, cluster)).num_layers
    configs = list(grid(cluster, m.config["batch"], layers))
    checked = []
    for method in rng.sample(configs, min(GRID_SIZE, len(configs))):
        try:
            manual = plan_graph(graph, cluster, method, retrace=rt, session=session)
        except InfeasiblePlanError:
            continue                # does not fit: not a plan Auto must beat
        checked.append(method)
        t_auto, t_manual = auto.predicted.iteration_s, manual.predicted.iteration_s
        assert t_auto <= t_manual * (1 + TOLERANCE), (
            f"{cluster.name}, {m.config}: Auto {t_auto:.6g} s ({len(auto.stages)} stages, "
            f"{auto.num_micro_batches} micro-batches) slower than {method} {t_manual:.6g} s")
    assert checked, "no Manual configuration of the grid fits: the case tests nothing"


def test_micro_batch_counts_include_the_divisors_hand_plans_use():
    from meshplan.dp_search.search import micro_batch_candidates
    got = micro_batch_candidates(1536, None)
    # Megatron-LM's 24 and 48 of 1536 (32 replicas, micro-batches of 2 and 1 each)
    assert {24, 48, 1, 2, 4, 8, 16, 32, 64} <= set(got) and max(got) == 96
    assert all(1536 % b == 0 for b in got)
    assert micro_batch_candidates(1024, None) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.slow      # (plans a 32-stage hand plan and Auto on 512 GPUs: ~50 s)
def test_more_stages_than_layer_groups_contain_the_hand_plan():
    """A hand plan with more stages (32) than the search's 16 layer groups is
    inside the search: Auto is no slower than it."""
    from meshplan.dp_search.problem import layer_problems
    cluster = parse_cluster({
        "format": "meshplan.cluster/1", "name": "fake-4x8", "num_hosts": 4,
        "devices_per_host": 8, "num_devices": 32,
        "device": {"kind": "fake", "memory_bytes": 2**30, "memory_bandwidth_bytes_per_s": 1e12,
                   "peak_flops": {"float32": 1e13}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
                  "inter_host": {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6}}})
    m = build_model("mlp", {"layers": 36, "hidden": 16, "in_dim": 16, "out_dim": 8,
                            "batch": 32})
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    lay = layer_problems(graph, 32, cluster, meshplan.Auto().request(32).pipeline)
    assert len(lay.groups) == 16 and 32 in [S for S, _, _ in lay.many_stages]
    session = Session(workers=1)
    auto = plan_graph(graph, cluster, meshplan.Auto(num_micro_batches=32), retrace=rt,
                      session=session)
    manual = plan_graph(graph, cluster, meshplan.Manual(dp=1, tp=1, pp=32, num_micro_batches=32),
                        retrace=rt, session=session)
    assert len(manual.stages) == 32
    assert auto.predicted.iteration_s <= manual.predicted.iteration_s * (1 + TOLERANCE)


def test_auto_is_no_slower_than_one_program_on_every_device():
    """Stages of one micro-batch run one after the other: Auto compares its
    searched pipeline with ShardParallel's whole-graph plan then too.  (On
    devices with a launch cost per program, a 2-layer MLP's two stages of
    four devices, 205 us, were chosen over one program on all eight, 158 us.)"""
    cluster = parse_cluster({
        "format": "meshplan.cluster/1", "name": "fake-1x8", "num_hosts": 1,
        "devices_per_host": 8, "num_devices": 8,
        "device": {"kind": "fake", "memory_bytes": 2**30, "memory_bandwidth_bytes_per_s": 2e10,
                   "peak_flops": {"float32": 5e10},
                   "achieved": {"kernel_launch_s": 5e-6, "program_dispatch_s": 2e-5,
                                "shared_host_compute": True}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e10, "latency_s": 1e-5},
                  "inter_host": {"bandwidth_bytes_per_s": 1e9, "latency_s": 5e-5}}})
    m = build_model("mlp", {"layers": 2, "hidden": 32, "in_dim": 32, "out_dim": 10,
                            "batch": 16, "optimizer": "sgd"})
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    auto = plan_graph(graph, cluster, meshplan.Auto(), retrace=rt, session=session)
    shard = plan_graph(graph, cluster, meshplan.ShardParallel(), retrace=rt, session=session)
    assert auto.predicted.iteration_s <= shard.predicted.iteration_s * (1 + TOLERANCE), (
        auto.predicted.iteration_s, len(auto.stages), auto.num_micro_batches,
        shard.predicted.iteration_s)


@pytest.mark.extended
def test_auto_is_no_slower_than_one_program_where_its_pipeline_is():
    """Case 37 of the generator, a 3-layer gpt on two devices: the search's
    best pipeline is 2 stages of 3 micro-batches, 38.4 us; the hand plan
    Manual(dp=2, pp=1) of one micro-batch is 35.1 us as one program (45.2
    us as the sum of its layers, each planned on its own), and the
    whole-graph ILP's one program 34.3 us.  The search prices the
    one-program hand plans, and a one-stage plan then meets the whole-graph
    ILP (planning._plan_request)."""
    rng = random.Random(37)     # (case 37 of the generator: a 3-layer gpt on two devices)
    cluster, m = random_cluster(rng), random_model(rng)
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    auto = plan_graph(graph, cluster, meshplan.Auto(), retrace=rt, session=session)
    hand = plan_graph(graph, cluster, meshplan.Manual(dp=2, tp=1, pp=1, num_micro_batches=1),
                      retrace=rt, session=session)
    assert auto.predicted.iteration_s <= hand.predicted.iteration_s * (1 + TOLERANCE)


def test_the_hand_plans_beside_a_searched_plan_share_its_stage_count():
    """The search also prices the Manual configurations of its plan's stage
    count: every (dp, tp) of a stage's devices, over the micro-batch counts
    the search starts from and the plan's own, each count only where dp
    splits its rows; tensor parallel across hosts only without data
    parallel; every schedule searched but interleaved (1F1B for one stage);
    none for baselines or interleaved plans."""
    from meshplan.planning import hand_made_options
    cluster = random_cluster(random.Random(0))
    cluster = parse_cluster({**cluster.to_dict(), "num_hosts": 4, "devices_per_host": 2,
                             "num_devices": 8})
    opts = meshplan.Auto().request(8).pipeline
    got = hand_made_options(opts, cluster, 8, 2, 4, "gpipe")
    # 4 devices a stage, a batch of 8: dp 4 splits 1 or 2 micro-batches only;
    # tp 4 crosses hosts of 2, allowed with dp 1 only
    assert [(o.fixed, o.num_micro_batches) for o in got] == \
        [((4, 1, 2), (1, 2)), ((2, 2, 2), (1, 2, 4)), ((1, 4, 2), (1, 2, 4, 8))]
    assert all(o.input_filter == "model" and o.num_stages == 2
               and o.schedules == ("1f1b", "gpipe", "zb-h1") for o in got)
    # a count beyond the search's first ones (a batch of 512, 128 won)
    assert hand_made_options(opts, cluster, 512, 2, 128, "1f1b")[-1].num_micro_batches \
        == (1, 2, 4, 8, 16, 32, 64, 128)
    # counts the method fixes stay fixed
    assert {o.num_micro_batches for o in hand_made_options(
        replace(opts, num_micro_batches=(2,)), cluster, 8, 2, 2, "1f1b")} == {(2,)}
    one = hand_made_options(opts, cluster, 8, 1, 1, "none")
    assert [o.fixed for o in one] == [(8, 1, 1), (4, 2, 1), (1, 8, 1)]
    assert {o.schedules for o in one} == {("1f1b",)}
    assert hand_made_options(opts, cluster, 8, 2, 4, "interleaved") == []
    assert hand_made_options(replace(opts, data_parallel_stages=True), cluster, 8, 2, 4,
                             "gpipe") == []
    assert [o.fixed for o in hand_made_options(replace(opts, tp_within_host=True), cluster,
                                               8, 1, 1, "none")] \
        == [(8, 1, 1), (4, 2, 1)]


def test_hand_plans_passed_over_for_their_state_fit_nothing():
    """The search skips a hand plan whose parameters and optimizer state,
    split over its model axis and stages alone, exceed a device's budget
    (planning._holds_state): each one skipped is refused when planned."""
    from meshplan.graph import OPT_STATE, PARAM
    from meshplan.planning import _holds_state
    m = build_model("mlp", {"layers": 4, "hidden": 256, "in_dim": 64, "out_dim": 8,
                            "batch": 64})
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    state = graph.role_bytes(PARAM) + graph.role_bytes(OPT_STATE)
    # (a budget, 0.9 of the memory, of 0.42 of the state: above a quarter, below half)
    cluster = parse_cluster({
        "format": "meshplan.cluster/1", "name": "fake-1x4", "num_hosts": 1,
        "devices_per_host": 4, "num_devices": 4,
        "device": {"kind": "fake", "memory_bytes": int(state * 0.42 / 0.9),
                   "memory_bandwidth_bytes_per_s": 1e12, "peak_flops": {"float32": 1e13}},
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
                  "inter_host": {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6}}})
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step")
    session = Session(workers=1)
    request = meshplan.Auto().request(4)
    skipped = 0
    for dp, tp, pp in [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2)]:
        if _holds_state(graph, cluster, request, tp * pp):
            continue
        skipped += 1
        with pytest.raises(InfeasiblePlanError):
            plan_graph(graph, cluster, meshplan.Manual(dp, tp, pp, num_micro_batches=2),
                       retrace=rt, session=session)
    assert skipped == 3     # (ways 1 and 2; 4 ways pass)


@pytest.mark.slow      # (plans wresnet-2b on 8 V100s: ~35 s)
def test_a_hand_plan_of_the_searched_shape_is_no_faster():
    """plan_quality's wresnet-2b on 8 V100s: the search's free layer plans on
    its (2, 4) mesh with 64 micro-batches were predicted 47.43 s, the hand plan
    Manual(2, 4, 1, 64) 46.47 s (its layers agree on how each micro-batch's
    rows are cut).  The search prices the hand plans of its own shape too."""
    from meshplan.planning import HAND_MADE_NOTE
    cluster = meshplan.load_cluster(EXAMPLES / "aws-p3.16xlarge-x1.json")
    m = build_model("wresnet-2b")
    graph = trace(m.train_step, *m.abstract_args, batch_argnums=m.batch_argnums, name="step")
    rt = retracer(m.train_step, m.abstract_args, m.batch_argnums, "step", graph=graph)
    session = Session(workers=1)
    auto = plan_graph(graph, cluster, meshplan.Auto(num_micro_batches=64), retrace=rt,
                      session=session)
    manual = plan_graph(graph, cluster, meshplan.Manual(2, 4, 1, 64), retrace=rt,
                        session=session)
    assert auto.predicted.iteration_s <= manual.predicted.iteration_s * (1 + TOLERANCE)
    assert HAND_MADE_NOTE in auto.notes


@pytest.mark.extended
def test_a_one_stage_plan_by_the_whole_graph_ilp_does_not_claim_hand_layouts():
    """moe on the 8 local devices: the search's one stage takes a hand plan's
    layouts, then the whole-graph ILP's plan of that stage, as fast, replaces
    it; the plan's notes say what it is, not what it replaced."""
    from meshplan.explain import ONE_STAGE_NOTE
    from meshplan.planning import HAND_MADE_NOTE
    m = build_model("moe")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=meshplan.ClusterSpec.local(),
                      method=meshplan.Auto(num_micro_batches=1))
    assert ONE_STAGE_NOTE in p.notes and HAND_MADE_NOTE not in p.notes
