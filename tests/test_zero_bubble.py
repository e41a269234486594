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
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("fbw", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1, 1, 2)])
def test_equal_stages(p, m, fbw):
    F, B, W = fbw
    got = zb_h1_iteration_s([F] * p, [B] * p, [W] * p, m)
    assert got == pytest.approx(_simulate(p, m, [F] * p, [B] * p, [W] * p)[0])
    if m >= p and W <= B:
        # the paper's bubble, against 1F1B's (p - 1)(F + B + W)
        assert got == pytest.approx(m * (F + B + W) + (p - 1) * (F + B - W))
    # never worse than 1F1B's m (F + B + W) + (p - 1)(F + B + W)
    assert got <= (m + p - 1) * (F + B + W) + 1e-9


@pytest.mark.parametrize("merged", [False, True])
def test_unequal_stages(merged):
    """Random stages (``merged``: the first stage's backward one program, as
    the runtime runs it) against the simulation, and the W hidden."""
    rng = random.Random(0)
    for _ in range(100):
        p, m = rng.randint(2, 6), rng.randint(1, 16)
        f = [rng.uniform(0.5, 2) for _ in range(p)]
        b = [x * rng.uniform(0.8, 1.3) for x in f]
        w = [x * rng.uniform(0.5, 1.2) for x in b]
        if merged:
            b[0], w[0] = b[0] + w[0], 0.0
        got = zb_h1_iteration_s(f, b, w, m)
        assert got == pytest.approx(_simulate(p, m, f, b, w)[0])
        per = [x + y + z for x, y, z in zip(f, b, w)]
        assert got >= m * max(per) - 1e-9


def test_two_stages_hide_the_last_stages_w():
    """p = 2, the first stage's backward whole: the second stage paces, and
    the first stage's last backward waits for its B only, not its W: it
    ends under the second stage's two trailing W's."""
    f, b, w, m = [1.0, 1.0], [2.0, 1.0], [0.0, 1.5], 8
    one_f1b = m * 3.5 + 3.0     # m t_max + the other stage's F + B
    got = zb_h1_iteration_s(f, b, w, m)
    assert got == pytest.approx(f[0] + m * 3.5) and got < one_f1b
