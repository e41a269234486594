"""A one-stage plan of a step whose ``lax.scan`` over stacked layers
recomputes (``jax.checkpoint`` / ``nn.remat`` inside the scanned body), run
with the scan rolled.

The planner unrolls such a scan (:mod:`meshplan.trace.unstack`) and plans one
input per layer.  Unrolled, XLA schedules every layer's recomputation in one
program and keeps less of the saving than the loop, whose body holds one
layer's recomputation at a time (``benchmarks/results/checkpoint_memory.md``:
a flax ``nn.scan(nn.remat(Block))`` decoder took 2.5x ``jax.jit``'s
temporaries unrolled).  Where every layer of a stacked leaf got the same
layout, the plan's layouts are the stacked leaf's too, unsplit along the
layers, and the user's step runs as written under ``jax.jit`` with them: the
numbers and the memory are ``jax.jit``'s.  Inside the scanned body XLA
propagates the layouts from the parameters and the batch; the plan's
constraints on the body's intermediates are not applied there.  So the
rolled program is compiled first and kept only where it communicates no more
than the plan predicts (:meth:`RolledScan.comm_bytes`, each collective of
the loop body once per trip): a flax decoder under ``Manual(dp=1, tp=8)``
rolled moved 137.6 MB a step where the plan predicted 26.3.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .hlo import collective_bytes_per_call
from .shard import FastPathMiss

__all__ = ("RolledScan", "rolled_shardings")


def _stacked(pieces: Sequence[Any]) -> NamedSharding | None:
    """One sharding for the stack of ``pieces``' per-layer shardings: theirs,
    unsplit along the new leading axis; None where the layers differ."""
    first = pieces[0]
    if first is None or any(p is None or p.spec != first.spec or p.mesh != first.mesh
                            for p in pieces):
        return None
    return NamedSharding(first.mesh, PartitionSpec(None, *first.spec))


def _restack(flat: Sequence[Any], counts: Sequence[int]) -> list[Any] | None:
    """``flat`` per-leaf shardings of the per-layer form, as one per leaf of
    the stacked form (``counts``: how many layers a leaf is split into, 0
    where it is not); None where some stacked leaf's layers differ."""
    out, k = [], 0
    for m in counts:
        if m:
            s = _stacked(flat[k:k + m])
            if s is None:
                return None
            out.append(s)
            k += m
        else:
            out.append(flat[k])
            k += 1
    return out


def rolled_shardings(p: Any, unstacked: Any, abstract: Sequence[Any]
                     ) -> tuple[Any, tuple[Any, ...], Any] | None:
    """``(mesh, in_shardings, out_shardings)`` of the user's stacked step for the
    one-stage plan ``p`` of its per-layer rewrite ``unstacked`` (traced at the
    stacked ``abstract``): each per-layer layout stacked; None where the
    layers of a leaf were planned apart (the step then runs unrolled)."""
    split = unstacked.split(abstract)
    mesh, ins, outs = p.shardings(*split, step=unstacked.fn)
    with_path, in_tree = jax.tree_util.tree_flatten_with_path(tuple(abstract))
    counts = [int(x.shape[0]) if unstacked._splits(int(path[0].idx), x) else 0
              for path, x in with_path]
    flat_in = _restack(jax.tree_util.tree_leaves(ins), counts)
    out_tree, out_mask = unstacked._out
    flat_out = _restack(jax.tree_util.tree_leaves(outs, is_leaf=lambda x: x is None), out_mask)
    if flat_in is None or flat_out is None:
        return None
    return (mesh, jax.tree_util.tree_unflatten(in_tree, flat_in),
            jax.tree_util.tree_unflatten(out_tree, flat_out))


class RolledScan:
    """The user's step under ``jax.jit`` with the plan's layouts stacked
    (see the module doc): called, lowered and fast-called like the
    runtime's other executables."""

    def __init__(self, fn: Callable, shardings: tuple[Any, tuple[Any, ...], Any],
                 abstract: Sequence[Any], donate_argnums: tuple[int, ...]) -> None:
        # (mesh, in_shardings, out_shardings): what step.shardings(...) gives
        self.stacked_shardings = shardings
        _, ins, outs = shardings
        self.jitted = jax.jit(fn, in_shardings=ins, out_shardings=outs,
                              donate_argnums=donate_argnums)
        self._avals = [(tuple(x.shape), x.dtype) for x in jax.tree_util.tree_leaves(tuple(abstract))]
        self._tree = jax.tree_util.tree_structure(tuple(abstract))

    def __call__(self, *args: Any) -> Any:
        return self.jitted(*args)

    def call_fast(self, args: tuple[Any, ...]) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self._tree or [(tuple(x.shape), x.dtype) for x in leaves] != self._avals:
            raise FastPathMiss("another signature")
        return self.jitted(*args)

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*args)

    def comm_bytes(self, abstract: Sequence[Any]) -> int:
        """Bytes of the collectives one call runs on one device, as XLA
        compiled the program for ``abstract`` (``jax.jit`` keeps the
        compilation for the calls)."""
        return collective_bytes_per_call(self.jitted.lower(*abstract).compile().as_text())
