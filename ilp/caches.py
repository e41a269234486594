"""Memo tables of the ILP builder, owned by the caller.

Resharding costs depend only on the mesh model, the tensor's shape and bytes
and the two layouts; the layouts of an input only on its shape and the mesh
shape.  Every value here is a function of its key, so sharing one
:class:`IlpCaches` across ``solve_intra_op`` calls (the layer ILPs of a
pipeline search) changes no result, only the time it takes.  ``None`` where a
function takes ``caches`` means a fresh one for that call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cost_model.mesh import MeshModel
from ..cost_model.sharding import ISpec, enumerate_specs


@dataclass
class ReshardMemo:
    """The resharding memo of one mesh model."""
    # (shape, nbytes, source, destination) -> reshard_steps(...)
    steps: dict[tuple, tuple] = field(default_factory=dict)
    # (kind, axes, bytes) -> (seconds, bytes) of one collective of a resharding
    collectives: dict[tuple, tuple] = field(default_factory=dict)
    # (shape, nbytes, sources, destination) -> (seconds, bytes) per source
    columns: dict[tuple, tuple] = field(default_factory=dict)


@dataclass
class IlpCaches:
    """Memo tables that may be shared by many ILPs (not by threads).

    At most ``max_meshes`` mesh models are remembered: the memo is emptied
    when one more arrives."""
    max_meshes: int = 64
    _reshard: dict[MeshModel, ReshardMemo] = field(default_factory=dict, repr=False)
    _specs: dict[tuple, tuple[ISpec, ...]] = field(default_factory=dict, repr=False)
    # mesh shape -> {(source, destination) -> reshard_moves(...)}: the steps of
    # a resharding for any size, on any mesh model of that shape
    _moves: dict[tuple[int, ...], dict] = field(default_factory=dict, repr=False)

    def reshard(self, mm: MeshModel) -> ReshardMemo:
        if mm not in self._reshard and len(self._reshard) >= self.max_meshes:
            self._reshard.clear()
        return self._reshard.setdefault(mm, ReshardMemo())

    def moves(self, mesh_shape: tuple[int, ...]) -> dict:
        """The resharding moves found so far on meshes of ``mesh_shape``."""
        return self._moves.setdefault(mesh_shape, {})

    def specs(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[ISpec, ...]:
        """:func:`~meshplan.cost_model.sharding.enumerate_specs`, remembered."""
        key = (shape, mesh_shape)
        hit = self._specs.get(key)
        if hit is None:
            hit = self._specs[key] = enumerate_specs(shape, mesh_shape)
        return hit
