"""The ladder of layer-state caps a stage tries (dp_search.stages): a
halving that overshoots into caps with no plan has the steps it jumped
bisected, on synthetic layer states."""
import types

from meshplan.dp_search.solver import TIGHTEN
from meshplan.dp_search.stages import StageCosts


def _costs(budget: float, states: dict[int, float | None]) -> StageCosts:
    """A StageCosts whose layers' largest state under ladder step s is
    ``states[s]`` (None: no plan)."""
    c = object.__new__(StageCosts)
    c.lay = types.SimpleNamespace(budget=budget)
    step = {t: s for s, t in enumerate(TIGHTEN)}
    c._largest_state = lambda gi, gj, m, k, tighten: states[step[tighten]]
    return c


def test_the_tightest_cap_with_plans_is_found_between_a_halving():
    budget = 100.0
    # plans down to step 10 (each a little under its cap), none from 11 on
    states = {s: (budget / TIGHTEN[s] * 0.99 if s <= 10 else None) for s in range(len(TIGHTEN))}
    asked = [t for t, k in _costs(budget, states)._bisect(0, 0, 0, 0, 8, 12, states[8])]
    assert TIGHTEN[10] in asked and TIGHTEN[11] in asked
    assert all(TIGHTEN[8] < t < TIGHTEN[12] for t in asked) and len(asked) <= 2


def test_a_cap_above_the_layers_state_is_passed_over():
    budget = 100.0
    # the layers' state at step 8 is already under step 10's cap: steps 9
    # and 10 would plan the same, only step 11 is asked
    states = {s: None for s in range(len(TIGHTEN))}
    states[8] = budget / TIGHTEN[10] * 0.9
    asked = [t for t, k in _costs(budget, states)._bisect(0, 0, 0, 0, 8, 12, states[8])]
    assert asked == [TIGHTEN[11]]
