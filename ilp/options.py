"""How the ILP solvers run: one typed object, parsed once at the edge.

The algorithms of :mod:`meshplan.ilp` read no environment variables; the API
and the CLI call :meth:`SolverOptions.from_env` once and pass the result down
(``solve_intra_op(..., options=...)``).  ``SolverOptions()`` is how meshplan
runs with none of the variables set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class SolverOptions:
    # write every MIP handed to HiGHS to this file (an LP/MPS dump with
    # readable names); None: no dump.  MESHPLAN_ILP_DUMP
    dump_path: str | None = None
    # HiGHS's own presolve ("off", "on", "choose"); off by default: on our
    # problems its probing costs more than it saves.  MESHPLAN_HIGHS_PRESOLVE
    highs_presolve: str = "off"
    # the back end's log on stdout.  MESHPLAN_ILP_LOG=1
    log: bool = False
    # print the dynamic programming's table sizes and work.  MESHPLAN_DP_DEBUG
    dp_debug: bool = False
    # A layer ILP with its state capped (the stage DP's caps,
    # meshplan.dp_search.solver.TIGHTEN) may stop at a plan within this
    # fraction of its optimum: HiGHS finds such a layer's best plan early and
    # then spends most of its seconds proving the last percent (gpt-1.3b's
    # 12 hardest, benchmarks/capped_gap.py: 63 s exact, 30 s at 1%, at most
    # 0.23% above the optimum), while the caps are steps of 19%.
    # 0: exact.  MESHPLAN_CAPPED_GAP
    capped_gap: float = 0.01

    @property
    def names(self) -> bool:
        """Whether the MIP needs readable variable and row names (for a dump)."""
        return bool(self.dump_path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SolverOptions":
        """The options the ``MESHPLAN_*`` variables of ``env`` (default:
        ``os.environ``) ask for; unset ones keep their defaults."""
        env = os.environ if env is None else env
        log = env.get("MESHPLAN_ILP_LOG", "0") or "0"
        try:
            verbose = bool(int(log))
        except ValueError:
            raise ValueError(f"MESHPLAN_ILP_LOG={log!r}: use 0 or 1") from None
        gap = env.get("MESHPLAN_CAPPED_GAP", "0.01") or "0.01"
        try:
            capped_gap = float(gap)
        except ValueError:
            capped_gap = -1.0
        if not 0 <= capped_gap < 1:
            raise ValueError(f"MESHPLAN_CAPPED_GAP={gap!r}: use a fraction in [0, 1), e.g. 0.01")
        return cls(dump_path=env.get("MESHPLAN_ILP_DUMP") or None,
                   highs_presolve=env.get("MESHPLAN_HIGHS_PRESOLVE", "off"),
                   log=verbose,
                   dp_debug=bool(env.get("MESHPLAN_DP_DEBUG")), capped_gap=capped_gap)
