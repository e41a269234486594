"""The calls a jaxpr walk sees through: those that only group equations
(``jit``, ``custom_jvp_call``, ``remat2`` ...), by the param holding their
(Closed)Jaxpr.  Shared by the flattener (:mod:`.walk`) and the analyses of
a cond's or loop's body (:mod:`.cond`, :mod:`.scaling`, :mod:`.unstack`)."""
from __future__ import annotations

from typing import Any

# primitive name -> name of the param holding the inlined (Closed)Jaxpr
INLINE_CALLS: dict[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "custom_lin": None,  # type: ignore[dict-item]  # never inlined; listed for clarity
}
INLINE_CALLS = {k: v for k, v in INLINE_CALLS.items() if v is not None}
REMAT_CALLS = frozenset({"remat2", "checkpoint", "remat"})


def _closed_parts(j: Any) -> tuple[Any, tuple[Any, ...]]:
    """(open jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        return j.jaxpr, tuple(j.consts)
    return j, ()
