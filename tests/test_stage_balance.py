"""A fixed number of stages cuts where the FLOPs balance (issue 19 item 1):
with one micro-batch the predicted latency is the plain sum of the stages,
and the cut used to be decided by small differences alone, leaving a stage
almost without work."""
import pathlib
from collections import Counter

import jax
import pytest

import meshplan
from meshplan.api import trace_step
from meshplan.dp_search.stage_dp import BALANCE_TOLERANCE, IDLE_SHARE, Submesh, stage_dp
from meshplan.models import build_model
from test_libraries import LIBRARIES, _tokens

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _stage_flops(plan, step, args):
    graph = trace_step(step, meshplan.api._abstract(args), tuple(plan.batch_argnums), "step")[0]
    per_layer = Counter()
    for nid, node in enumerate(graph.nodes):
        per_layer[plan.layer_of_node[nid]] += node.flops
    return [sum(per_layer[l] for l in range(s.layers[0], s.layers[1] + 1)) for s in plan.stages]


def test_near_ties_go_to_the_lighter_heaviest_stage():
    # four layers, two stages of 4 devices; the cut after layer 0 is a hair
    # cheaper (a smaller send) but leaves stage 0 with 1% of the FLOPs
    flops = [1.0, 40.0, 40.0, 19.0]
    subs = [Submesh(1, 4)]

    def cost(i, j, m, s):
        return sum(flops[i:j + 1]) + (0.0 if i == 1 else 0.5)
    plain = stage_dp(4, subs, 8, 1, cost, max_stages=2, min_stages=2)
    assert [(s.first, s.last) for s in plain.stages] == [(0, 0), (1, 3)]
    fair = stage_dp(4, subs, 8, 1, cost, max_stages=2, min_stages=2, balance=flops)
    assert [(s.first, s.last) for s in fair.stages] == [(0, 1), (2, 3)]
    assert fair.total_s <= plain.total_s * (1 + BALANCE_TOLERANCE)

    # a real difference beyond the tolerance is kept ...
    working = [20.0, 40.0, 21.0, 19.0]

    def far(i, j, m, s):
        return sum(working[i:j + 1]) + (0.0 if i == 1 else 10.0)
    r = stage_dp(4, subs, 8, 1, far, max_stages=2, min_stages=2, balance=working)
    assert [(s.first, s.last) for s in r.stages] == [(0, 0), (1, 3)]

    # ... unless it leaves a stage almost without work (under IDLE_SHARE of
    # an even share), where the layers allow every stage more
    def idle(i, j, m, s):
        return sum(flops[i:j + 1]) + (0.0 if i == 1 else 10.0)
    r = stage_dp(4, subs, 8, 1, idle, max_stages=2, min_stages=2, balance=flops)
    assert [(s.first, s.last) for s in r.stages] == [(0, 1), (2, 3)]
    assert IDLE_SHARE * sum(flops) / 2 > flops[0]
    # (where they do not, the fastest cut stands)
    lopsided = [1.0, 99.0]
    r = stage_dp(2, subs, 8, 1, lambda i, j, m, s: sum(lopsided[i:j + 1]), max_stages=2,
                 min_stages=2, balance=lopsided)
    assert [(s.first, s.last) for s in r.stages] == [(0, 0), (1, 1)]


@pytest.mark.parametrize("lib", [pytest.param("flax_nnx", marks=pytest.mark.extended),
                                 pytest.param("flax_linen", marks=pytest.mark.slow)])
def test_two_stages_of_a_two_layer_flax_model_balance_flops(lib):
    step, state = LIBRARIES[lib]()
    args = (state, _tokens())
    plan = meshplan.plan(step, *args, method=meshplan.PipeshardParallel(stages=2))
    assert len(plan.stages) == 2
    flops = _stage_flops(plan, step, args)
    assert min(flops) >= 0.4 * max(flops), flops


def test_manual_pipeline_of_a_small_mlp_leaves_no_stage_idle():
    m = build_model("mlp", {"layers": "3"})
    state, batch = jax.device_get(m.init(0))
    plan = meshplan.plan(m.train_step, state, batch, method=meshplan.Manual(dp=2, tp=2, pp=2))
    flops = _stage_flops(plan, m.train_step, (state, batch))
    assert len(flops) == 2 and min(flops) >= 0.4 * max(flops), flops


def _blocks_on_twelve_devices():
    """A gpt of 46 blocks (48 layers with its embedding and head) and two
    hosts of 6 devices."""
    m = build_model("gpt", {"layers": 46, "hidden": 32, "heads": 2, "seq_len": 8,
                            "batch": 24, "vocab": 64})
    cluster = meshplan.load_cluster(
        ROOT / "examples" / "clusters" / "aws-p3.16xlarge-x2.json").with_devices(2, 6)
    return m, cluster


def test_a_fixed_stage_count_gets_as_many_layer_groups_each():
    # 46 blocks, an embedding and a head: 48 layers, merged into at most 16
    # groups for the stage DP.  Twelve stages over 16 groups gave four of
    # them two groups and eight one; as many groups per stage balance them
    # (Megatron-LM's GPT-3 175B as 12 stages: 8 of 6 blocks, 4 of 12).
    m, cluster = _blocks_on_twelve_devices()
    method = meshplan.Manual(dp=1, tp=1, pp=12, num_micro_batches=12, schedule="1f1b")
    p = meshplan.plan(m.train_step, *m.abstract_args, cluster=cluster, method=method)
    flops = _stage_flops(p, m.train_step, m.abstract_args)
    assert len(flops) == 12
    assert max(flops) <= 1.2 * sum(flops) / 12, flops


def test_the_search_prices_equal_stages_of_the_counts_its_groups_do_not_split():
    # the same model under Auto(): its DP cuts 16 groups, so 6 and 12 stages
    # on equal submeshes (as Manual's pp = 6 or 12) are priced apart, over 12
    # groups each, or a hand plan could beat the search
    from meshplan.dp_search.problem import layer_problems
    m, cluster = _blocks_on_twelve_devices()
    graph = trace_step(m.train_step, m.abstract_args, m.batch_argnums, "step")[0]
    lay = layer_problems(graph, 1, cluster, meshplan.Auto().request(12).pipeline)
    assert len(lay.groups) == 16
    views = {v.min_stages: (len(v.groups), v.submeshes[0].size) for v in lay.many_stage_views()}
    assert views[6] == (12, 2) and views[12] == (12, 1)
    assert 2 not in views and 4 not in views        # (16 groups split evenly)
