"""ZB-H1 (meshplan.schedule, cost_model.pipeline.zb_h1_iteration_s): the
order checked by simulation (every F, B and W once, dependences kept, no
deadlock, activations within 1F1B's largest bound) and the iteration-time
formula against an event simulation of that order."""
import random

import pytest

from meshplan.cost_model.pipeline import zb_h1_iteration_s
from meshplan.schedule import max_in_flight, schedule_order


def _deps(kind, s, i, p):
    if kind == "F":
        return [("F", s - 1, i)] if s else []
    if kind == "B":
        return [("F", s, i)] + ([("B", s + 1, i)] if s + 1 < p else [])
    return [("B", s, i)]


def _simulate(p, m, f, b, w):
    """Each stage runs its order one program after another, a program
    starting once the stage is free and its inputs are done; returns (the
    step's end, per stage the most micro-batches between F and W)."""
    orders = [schedule_order("zb-h1", s, p, m) for s in range(p)]
    dur = {"F": f, "B": b, "W": w}
    end, free, pos = {}, [0.0] * p, [0] * p
    live, peak = [0] * p, [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                deps = _deps(kind, s, i, p)
                if any(d not in end for d in deps):
                    break
                assert (kind, s, i) not in end, "a program twice"
                start = max([free[s]] + [end[d] for d in deps])
                free[s] = end[(kind, s, i)] = start + dur[kind][s]
                live[s] += {"F": 1, "B": 0, "W": -1}[kind]
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                moved = True
        assert moved, "deadlock"
    assert set(end) == {(k, s, i) for k in "FBW" for s in range(p) for i in range(m)}
    return max(free), peak


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 2), (2, 4), (3, 3), (3, 7), (4, 2), (4, 4),
                                 (4, 8), (8, 16)])
def test_order_complete_and_bounded(p, m):
    one = [1.0] * p
    _, peak = _simulate(p, m, one, one, one)
    # every stage keeps at most 1F1B's largest bound (its first stage's)
    assert max(peak) <= min(p, m)
    assert tuple(peak) == max_in_flight("zb-h1", p, m)
    for s in range(p):
        order = schedule_order("zb-h1", s, p, m)
        assert len(order) == len(set(order)) == 3 * m
        at = {x: n for n, x in enumerate(order)}
        for i in range(m):
            assert at[("F", i)] < at[("B", i)] < at[("W", i)]
        # 1F1B's warm-up; B in micro-batch order
        assert order[:min(p - s - 1, m)] == [("F", i) for i in range(min(p - s - 1, m))]
        assert [i for k, i in order if k == "B"] == list(range(m))


def test_w_delayed_by_stage():
    """Stage s of p runs its first W once it holds p micro-batches: s W's later than stage 0."""
    p, m = 4, 8
    for s in range(p):
        order = schedule_order("zb-h1", s, p, m)
        first_w = order.index(("W", 0))
        assert sum(1 for k, _ in order[:first_w] if k == "B") == s + 1


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("fbw", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1, 1, 2)])
def test_formula_exact_for_equal_stages(p, m, fbw):
    F, B, W = fbw
    if W > B and m < p:
        pytest.skip("documented: the formula is exact for W <= B or m >= p")
    got = zb_h1_iteration_s([F] * p, [B] * p, [W] * p, m)
    sim, _ = _simulate(p, m, [F] * p, [B] * p, [W] * p)
    assert got == pytest.approx(sim)
    if m >= p and W <= B:
        # the paper's bubble, against 1F1B's (p - 1)(F + B + W)
        assert got == pytest.approx(m * (F + B + W) + (p - 1) * (F + B - W))


def test_formula_close_for_unequal_stages():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(200):
        p, m = rng.randint(2, 6), rng.randint(1, 16)
        f = [rng.uniform(0.5, 2) for _ in range(p)]
        b = [x * rng.uniform(0.8, 1.3) for x in f]
        w = [x * rng.uniform(0.5, 1.2) for x in b]
        sim, _ = _simulate(p, m, f, b, w)
        worst = max(worst, abs(zb_h1_iteration_s(f, b, w, m) / sim - 1))
    assert worst < 0.15


def test_beats_1f1b_by_the_w_it_hides():
    p, m, F, B, W = 4, 8, 1.0, 1.0, 1.0
    one_f1b = m * (F + B + W) + (p - 1) * (F + B + W)
    assert zb_h1_iteration_s([F] * p, [B] * p, [W] * p, m) == one_f1b - 2 * (p - 1) * W
