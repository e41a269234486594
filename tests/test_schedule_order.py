"""The interleaved 1F1B order of meshplan.schedule, checked by simulation:
every (virtual stage, micro-batch) forward and backward exactly once, the
groups' orders run together without deadlock under the pipeline's
dependencies, and the activations kept stay within the schedule's bound."""
import itertools

import pytest

from meshplan.schedule import ScheduleError, group_order, max_in_flight


def _simulate(schedule, p, m, v):
    """Run every group's order one program per step where its inputs are
    ready; return the per-group in-flight peaks (chunk activations)."""
    orders = [group_order(schedule, g, p, m, v) for g in range(p)]
    n = p * v
    done, pos = set(), [0] * p
    live, peak = [0] * p, [0] * p
    while any(pos[g] < len(orders[g]) for g in range(p)):
        ready = []
        for g in range(p):
            if pos[g] == len(orders[g]):
                continue
            kind, k, i = orders[g][pos[g]]
            assert k % p == g
            deps = ([("F", k - 1, i)] if k else []) if kind == "F" else \
                [("F", k, i)] + ([("B", k + 1, i)] if k + 1 < n else [])
            if all(d in done for d in deps):
                ready.append((g, (kind, k, i)))
        assert ready, "deadlock"
        for g, task in ready:           # all groups with ready work run in lockstep
            done.add(task)
            pos[g] += 1
            live[g] += 1 if task[0] == "F" else -1
            peak[g] = max(peak[g], live[g])
    everything = {(kd, k, i) for kd in "FB" for k in range(n) for i in range(m)}
    assert done == everything
    assert sum(len(o) for o in orders) == len(everything)      # each exactly once
    return peak


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_interleaved_order_is_complete_and_deadlock_free(p, m):
    v = 2
    peak = _simulate("interleaved", p, m, v)
    for g in range(p):
        # Megatron-LM's warm-up plus the one forward of the steady state
        bound = min(m * v, 2 * (p - g - 1) + (v - 1) * p + 1)
        assert peak[g] <= bound, (g, peak[g], bound)
    # the first group keeps at most p v + p - 1 chunk activations: in whole
    # stages, p + (p - 1) / v, a little over 1F1B's p
    assert max(peak) <= p * v + p - 1


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_one_chunk_is_1f1b(p, m):
    peak = _simulate("1f1b", p, m, 1)
    assert peak == [min(m, p - g) for g in range(p)]


def test_interleaved_forwards_go_round_by_round():
    # group 0 of 2, 4 micro-batches: chunk 0 of micro-batches 0 and 1, then
    # chunk 1 (virtual stage 2) of them, then chunk 0 of 2 and 3 ...
    order = group_order("interleaved", 0, 2, 4, 2)
    fwd = [(k, i) for kind, k, i in order if kind == "F"]
    assert fwd == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]
    bwd = [(k, i) for kind, k, i in order if kind == "B"]
    assert bwd == [(2, 0), (2, 1), (0, 0), (0, 1), (2, 2), (2, 3), (0, 2), (0, 3)]


def test_in_flight_per_virtual_stage():
    f = max_in_flight("interleaved", 2, 4, 2)
    assert len(f) == 4 and all(1 <= x <= 4 for x in f)
    # the last virtual stage runs each backward right after its forward
    assert f[3] == 1
    assert max_in_flight("1f1b", 4, 8) == (4, 3, 2, 1)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_interleaved_needs_a_multiple_of_the_groups(m):
    with pytest.raises(ScheduleError, match="multiple of the 2 device groups"):
        group_order("interleaved", 0, 2, m, 2)


def test_chunks_need_the_interleaved_schedule():
    with pytest.raises(ScheduleError, match="interleaved"):
        group_order("1f1b", 0, 2, 4, 2)


def test_every_group_runs_its_own_chunks_only():
    for p, m in itertools.product((2, 4), (4, 8)):
        for g in range(p):
            assert {k % p for _, k, _ in group_order("interleaved", g, p, m, 2)} == {g}


def test_peak_kept_walks_what_each_micro_batch_keeps_until_b_and_w():
    from meshplan.schedule import peak_kept, schedule_order
    # without W a stage keeps each micro-batch whole until its B
    for p, m in ((4, 8), (2, 2)):
        for s in range(p):
            kinds = [k for k, _ in schedule_order("1f1b", s, p, m)]
            assert peak_kept(kinds, 3.0, 0.0, 0.0) == 3.0 * max_in_flight("1f1b", p, m)[s]
    # F F B W: 2 kept, B adds 0.5 (peak 2.5) and frees all but 0.7, W the 0.7
    assert peak_kept("FFBW", 1.0, 0.5, 0.7) == 2.5
    assert peak_kept("FBWFBW", 1.0, 0.5, 0.7) == 1.5
    # ZB-H1's last stage keeps each micro-batch's W part until the end
    kinds = [k for k, _ in schedule_order("zb-h1", 3, 4, 4)]
    assert kinds == ["F", "B"] * 4 + ["W"] * 4
    assert peak_kept(kinds, 1.0, 0.25, 0.5) == 1.0 + 0.25 + 3 * 0.5
