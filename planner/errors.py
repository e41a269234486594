"""The error hierarchy of meshplan.

Every error a user can provoke is a :class:`MeshplanError` that also subclasses
the matching builtin, so ``except ValueError`` keeps working.  Messages say what
to change, not where the code tripped.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any


class MeshplanError(Exception):
    """Root of all errors raised by meshplan on purpose."""


class ClusterSpecError(MeshplanError, ValueError):
    """A cluster description is malformed; the message names the JSON path."""

    def __init__(self, path: str, problem: str):
        self.path = path
        self.problem = problem
        super().__init__(f"cluster spec {path}: {problem}")


class TraceError(MeshplanError, ValueError):
    """The function could not be traced into a Graph."""


class UnsupportedPrimitiveError(MeshplanError, NotImplementedError):
    """A primitive that meshplan cannot plan even with a fallback."""


class InfeasiblePlanError(MeshplanError, RuntimeError):
    """No plan fits the memory budget.

    ``budget_bytes`` is the per-device memory available, ``needed_bytes`` the
    smallest per-device peak meshplan could find (``None`` when unknown).
    """

    def __init__(self, message: str, *, budget_bytes: int | None = None,
                 needed_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        super().__init__(message)


class SolverError(MeshplanError, RuntimeError):
    """The ILP back end failed or is not installed."""


class PlanFormatError(MeshplanError, ValueError):
    """A plan JSON is malformed or of an unknown format version."""


class StalePlanError(MeshplanError, ValueError):
    """A saved plan does not belong to the function / arguments it is used with."""


class CallError(MeshplanError, TypeError):
    """A call Python or jax.jit would refuse as a TypeError (an unknown
    keyword, a missing argument, a jax.jit option parallelize does not
    take): both kinds catch it."""


class ModelConfigError(MeshplanError, ValueError):
    """Unknown built-in model or a bad --model-arg."""


class RuntimeStageError(MeshplanError, RuntimeError):
    """A stage of a running plan failed; the message names the stage."""


class CheckpointError(MeshplanError, RuntimeError):
    """A checkpoint is missing, incomplete (an interrupted save) or does not
    match the state it is restored into; the message names the path."""


def batch_rows(leaves: "list[tuple[int, str]]") -> int | None:
    """The batch size of the batch arguments' leaves, given as (dimension 0,
    name) pairs (None without any); leaves that disagree are refused, naming
    two of them."""
    if not leaves:
        return None
    first = leaves[0]
    other = next((x for x in leaves if x[0] != first[0]), None)
    if other is not None:
        raise MeshplanError(
            f"the batch arguments' leaves disagree on the batch size, which is their dimension "
            f"0: {first[1]} has {first[0]} rows, {other[1]} has {other[0]}; name the arguments "
            "that hold the batch in batch_argnums (it is (1,) unless given), put the batch "
            "first in each of their leaves, and pass a leaf that is no batch as another argument")
    return first[0]


def argument_leaf(path: Any) -> str:
    """``argument N[path]``: a leaf of the step's arguments by its pytree
    path in the tuple of them (as ``jax.tree_util`` gives it)."""
    import jax
    return f"argument {path[0].idx}{jax.tree_util.keystr(tuple(path[1:]))}"


class DeletedArgumentError(RuntimeStageError, ValueError):
    """An argument array was deleted (donated to an earlier call); a
    ValueError too, as jax raises for one."""


def deleted_argument(where: str) -> RuntimeStageError:
    """The error for an array a call was given after an earlier call took
    it over (donated): ``where`` names it."""
    return DeletedArgumentError(
        f"{where} was donated to an earlier call (of this step or of another jitted function) "
        "and has been deleted; pass the value that call returned in its place")


def mark_step_failure(e: BaseException, step: str) -> None:
    """Note on ``e``, an exception the user's step raised while meshplan
    traced it at its own arguments, that it did: it is re-raised as it is (as
    jax.jit raises it), and the CLI reports it in one line
    (:func:`step_failure`)."""
    e.add_note(f"(raised while meshplan traced {step!r} to plan it, at the arguments' own shapes)")
    import jax
    if isinstance(e, jax.errors.ConcretizationTypeError) or (
            isinstance(e, ValueError) and "static arguments" in str(e)):
        # (a Python flag among the arguments: every argument is traced)
        e.add_note("(meshplan.parallelize traces every argument as an array, as jax.jit without "
                   "static_argnums does: where a Python flag or option is passed as an "
                   "argument, bind it with functools.partial(step, flag=...) before "
                   "parallelizing)")
    try:
        e.meshplan_step = step      # type: ignore[attr-defined]
    except AttributeError:          # (an exception type without a __dict__)
        pass


def step_failure(e: BaseException) -> str | None:
    """One line for an exception :func:`mark_step_failure` marked, else None."""
    step = getattr(e, "meshplan_step", None)
    if step is None:
        return None
    return (f"the step {step!r} raised {type(e).__name__} while meshplan traced it: "
            f"{' '.join(str(e).split())}")


def warn(message: str) -> None:
    """``warnings.warn`` at the user's line: the first frame outside meshplan
    (how deep inside meshplan a warning is raised varies; the user's line is
    what they can act on)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "meshplan":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level + 1)
