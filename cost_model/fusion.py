"""Memory traffic of elementwise operators once XLA has fused them.

XLA fuses chains of elementwise operators (and the broadcasts feeding them)
into one loop: the intermediate values stay in registers, and only the
operands the chain reads from memory and the results it leaves in memory
cost bandwidth.  Counting every operator's result instead overstates the
time of layer norms, softmaxes, activations and the optimizer update two- to
five-fold, which makes sharding such work look far more valuable than it is.

:func:`fused_bytes` gives, per fusible operator, the bytes it moves under
that rule: the operands it reads from memory (made by a non-fusible operator
or an input of the step) plus its result when the result is materialised
(read by a non-fusible operator, or an output of the step); a reduction
whose result the fusion goes on to use is a kernel of its own, which reads
its producers' operands again (a softmax, a layer norm).
:func:`materialised` names the values that exist in memory at all, and
:func:`kept_after_fusion` what a backward keeps of its forward once fused.

``shared_written`` (``Achieved.fusion_writes_shared``, XLA's CPU back end):
a fused value that several operators read is written to memory, and each
kernel reading it reads it back.  A GPU's XLA instead makes it again in each
reading kernel, or makes it once in a multi-output fusion.  On one CPU device,
counting such values as written gave 0.90-0.96 of the bytes the compiled gpt
step's loop and reduction kernels write (batch 1 to 16), where the GPU rule
counted 0.37-0.59 of them (benchmarks/results/measured_grid.md, stop 70).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ..flops import BARRIERS, DATA_MOVEMENT, PER_ELEMENT, RANDOM, SCATTERS
from ..graph import Graph, Node

# Reductions fuse with the element-wise operators around them: XLA fuses a
# reduction's producers into its kernel; one whose result the fusion goes on
# to use ends its kernel there (:func:`_kernel_ending_reductions`).
FUSED_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"})
# (bitcast_convert_type: a dropout's random bits read as floats, in registers;
# pad: the cotangent of a slice, whose zeros the kernel reading it makes in
# registers -- a q/k/v projection's gradient, three pads summed, ran on an
# H100 as one kernel reading the three parts, priced 4x as three padded
# copies and their sums, benchmarks/results/gpu_profile.md)
LOOP_FUSIBLE = PER_ELEMENT | frozenset({"broadcast_in_dim", "squeeze", "expand_dims", "iota",
                                        "bitcast_convert_type", "pad"})
FUSIBLE = LOOP_FUSIBLE | FUSED_REDUCTIONS
# Operators that are no kernel of their own: a change of view XLA makes a
# bitcast, or a slice/pad/concatenate it fuses into the kernel reading it.
NO_KERNEL = DATA_MOVEMENT - frozenset({"transpose", "gather", "dynamic_update_slice",
                                       "select_and_gather_add"})
# A reshape of a value in the default (row-major) layout is a bitcast: the
# same bytes read another way, nothing moved.  A slice copies the region it
# takes, not its whole operand (the q/k/v slices of a fused projection:
# reading all of it three times was priced 6x what an H100 measured,
# benchmarks/results/gpu_profile.md).
BITCASTS = frozenset({"reshape"})
# Made again in every kernel reading them, on any back end (cheap: no reads)
REMADE = frozenset({"broadcast_in_dim", "iota"})
REGION_COPIES = frozenset({"slice", "dynamic_slice"})
# A gather reads the rows it takes (and its indices), not its whole operand:
# the loss's take_along_axis over a 350M gpt's logits was priced as a read of
# all 1.6 GiB of them (benchmarks/results/gpu_profile.md).
GATHERS = frozenset({"gather"})
# Updates XLA makes in the operand's buffer when nothing else reads it: the
# kernel reads and writes the updated region, not the whole operand (the
# logits' gradient of a cross-entropy is a scatter-add of the labels' terms
# into zeros: priced as a copy of the 1.6 GiB logits, 1.1 ms of a 350M gpt
# step on an H100, benchmarks/results/gpu_profile.md): the operands after the
# first (indices, updates) are read, and the updates' region read and written.
IN_PLACE = SCATTERS | frozenset({"dynamic_update_slice"})


def fused_bytes(graph: Graph, leaving: set[int] | None = None,
                shared_written: bool = False) -> dict[int, float]:
    """node id -> bytes moved, for every fusible operator of ``graph``.

    Fusible operators joined by values they pass to each other form one
    fusion, which reads each value from memory once however many of its
    operators use it: the read is charged to the first of them.  ``leaving``:
    :func:`materialised_results`, when the caller has it already (with the
    same ``shared_written``: then a value written to memory ends its fusion,
    and each fusion reading it reads it)."""
    fusible = {n.id for n in graph.nodes if n.primitive in FUSIBLE}
    producer = graph.producer
    leaving, cut = _leaving(graph, leaving, shared_written)
    fusion = _fusions(graph, fusible, cut)
    read: set[tuple[int, int]] = set()        # (fusion, tensor) already charged
    out: dict[int, float] = {}
    ends = _kernel_ending_reductions(graph, fusible)
    for n in graph.nodes:
        if n.id not in fusible:
            continue
        if n.id in ends:
            out[n.id] = ends[n.id] + sum(graph.tensors[t].nbytes for t in n.outputs
                                         if t in leaving)
            continue
        moved = 0.0
        for t in dict.fromkeys(n.inputs):
            tt = graph.tensors[t]
            if not tt.shape or (fusion[n.id], t) in read:
                continue
            p = producer.get(t)
            if p is None or p not in fusible or t in cut:
                moved += tt.nbytes
                read.add((fusion[n.id], t))
        moved += sum(graph.tensors[t].nbytes for t in n.outputs if t in leaving)
        out[n.id] = moved
    return out


def _kernel_ending_reductions(graph: Graph, fusible: set[int]) -> dict[int, float]:
    """reduction node id -> the bytes its own kernel reads, for each reduction
    whose result an element-wise operator goes on to use.

    XLA ends a kernel at such a reduction: the operators using the reduced
    value (softmax's ``exp(x - max) / sum``, a layer norm's ``(x - mean) *
    rsqrt(var)``, gradients scaled by their global norm) run in another
    kernel, which makes what they need again from memory.  So the reduction's
    kernel reads, on its own, every value in memory its element-wise
    producers read; the fusion's other operators read theirs once as before,
    as does a reduction whose result only leaves the fusion (a bias
    gradient, a loss).  A value several operators use is taken as read from
    memory, not made again from its producers.  On an H100 the attention
    softmax's kernels took 18.4 ms of a 350M gpt step that one fusion reading
    each value once priced at 9.8 (benchmarks/results/gpu_profile.md)."""
    producer, consumers = graph.producer, graph.consumers
    kind = {n.id: n.primitive for n in graph.nodes}
    ends = [n for n in graph.nodes if n.id in fusible and n.primitive in FUSED_REDUCTIONS
            and any(c in fusible for t in n.outputs for c in consumers.get(t, ()))]
    inputs_of = {n.id: n.inputs for n in graph.nodes}

    def made_here(t: int) -> int | None:
        """The producer a kernel reading ``t`` makes it with, or None where
        the kernel reads ``t`` from memory: a reduction's result, a value
        other operators read too (XLA duplicates a producer into each kernel
        using it only when it is cheap; a value several kernels use is
        written once and read), anything a non-fusible operator makes."""
        p = producer.get(t)
        if p is None or p not in fusible or kind[p] in FUSED_REDUCTIONS \
                or len(consumers.get(t, ())) > 1:
            return None
        return p

    # node -> the tensors it and the producers it makes again read from
    # memory; walked up from the reductions only (an explicit stack: element-
    # wise chains can be long)
    cone: dict[int, frozenset[int]] = {}
    for r in ends:
        stack = [r.id]
        while stack:
            n = stack[-1]
            if n in cone:
                stack.pop()
                continue
            below = [p for t in inputs_of[n] if graph.tensors[t].shape
                     for p in (made_here(t),) if p is not None and p not in cone]
            if below:
                stack.extend(below)
                continue
            reads: set[int] = set()
            for t in inputs_of[n]:
                if graph.tensors[t].shape:
                    p = made_here(t)
                    reads |= {t} if p is None else cone[p]
            cone[n] = frozenset(reads)
            stack.pop()
    return {r.id: float(sum(graph.tensors[t].nbytes for t in cone[r.id])) for r in ends}


def moved_bytes(graph: Graph, node: Node, traffic: dict[int, float]) -> float:
    """Bytes ``node`` moves: a fusible operator's share of its fusion's
    traffic (``traffic``, :func:`fused_bytes`), none for a bitcast, the
    region read and written for a slice, a gather (and its indices) or an
    update made in place, else its operands and results."""
    if node.id in traffic:
        return traffic[node.id]
    if node.primitive in BITCASTS:
        return 0.0
    if node.primitive in REGION_COPIES:
        return 2.0 * sum(graph.tensors[t].nbytes for t in node.outputs)
    if node.primitive in GATHERS:
        return float(2 * sum(graph.tensors[t].nbytes for t in node.outputs)
                     + sum(graph.tensors[t].nbytes for t in node.inputs[1:]))
    if node.primitive in IN_PLACE and _updates_in_place(graph, node):
        k = 1 if node.primitive == "dynamic_update_slice" else 2     # (the updates)
        return float(sum(graph.tensors[t].nbytes for t in node.inputs[1:])
                     + 2 * graph.tensors[node.inputs[k]].nbytes)
    return float(node.bytes_accessed)


def _updates_in_place(graph: Graph, node: Node) -> bool:
    """Whether XLA gives ``node`` its operand's buffer: an intermediate value
    nothing else reads (a step's input is the caller's, copied first)."""
    t = node.inputs[0] if node.inputs else None
    return (t is not None and t in graph.producer
            and len(graph.consumers.get(t, ())) == 1)


def fusion_bytes(graph: Graph, traffic: dict[int, float], leaving: set[int] | None = None,
                 shared_written: bool = False) -> dict[int, float]:
    """fusible node id -> bytes its whole fusion moves (the sum of
    ``traffic``, :func:`fused_bytes`, over the fusion's operators): the
    kernel's roofline, which its floor is compared with.  ``leaving`` and
    ``shared_written`` as for :func:`fused_bytes`."""
    cut = _leaving(graph, leaving, shared_written)[1]
    fusion = _fusions(graph, {n.id for n in graph.nodes if n.primitive in FUSIBLE}, cut)
    total: dict[int, float] = {}
    for i, rep in fusion.items():
        total[rep] = total.get(rep, 0.0) + traffic.get(i, 0.0)
    return {i: total[rep] for i, rep in fusion.items()}


def _leaving(graph: Graph, leaving: set[int] | None, shared_written: bool
             ) -> tuple[set[int], set[int] | frozenset[int]]:
    """(the fusible results written to memory, :func:`materialised_results`
    unless given; those of them that end a fusion: all where
    ``shared_written``, else none, a GPU's multi-output fusion keeping them
    for its other readers)."""
    if leaving is None:
        leaving = materialised_results(graph, shared_written)
    return leaving, (leaving if shared_written else frozenset())


def _fusions(graph: Graph, fusible: set[int],
             cut: set[int] | frozenset[int] = frozenset()) -> dict[int, int]:
    """fusible node id -> a representative of its fusion (the connected set of
    fusible operators passing values to each other, other than the values
    in ``cut``)."""
    parent = {i: i for i in fusible}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = graph.producer
    for n in graph.nodes:
        if n.id not in fusible:
            continue
        for t in n.inputs:
            p = producer.get(t)
            if p is not None and p in fusible and t not in cut:
                parent[find(p)] = find(n.id)
    return {i: find(i) for i in fusible}


def kernels(graph: Graph, leaving: set[int] | None = None,
            shared_written: bool = False) -> dict[int, int]:
    """node id -> kernels it launches (1), for the nodes that launch one: every
    operator that is neither fusible nor a view, and every fusible operator
    whose result is materialised (the root of a fusion; the rest of the
    chain is inside that kernel).  ``leaving`` as for :func:`fused_bytes`."""
    keep = materialised_results(graph, shared_written) if leaving is None else leaving
    out: dict[int, int] = {}
    for n in graph.nodes:
        if n.primitive in FUSIBLE:
            if any(t in keep for t in n.outputs):
                out[n.id] = 1
        elif n.primitive not in NO_KERNEL:
            out[n.id] = 1
    return out


def materialised_results(graph: Graph, shared_written: bool = False) -> set[int]:
    """Results of fusible operators that leave the fusion: read by an operator
    that is not fusible, or returned by the step; with ``shared_written``
    also those several operators read (not a broadcast or an iota, which
    every reader makes again).  (A result read by nobody is dead code, which
    XLA removes.)"""
    fusible = {n.id for n in graph.nodes if n.primitive in FUSIBLE}
    consumers = graph.consumers
    outputs = {o.tensor for o in graph.outputs}
    out: set[int] = set()
    for n in graph.nodes:
        if n.id not in fusible:
            continue
        shared = shared_written and n.primitive not in REMADE
        for t in n.outputs:
            readers = consumers.get(t, ())
            if t in outputs or any(r not in fusible for r in readers) \
                    or (shared and len(readers) > 1 and graph.tensors[t].shape):
                out.add(t)
    return out


def materialised(graph: Graph) -> set[int]:
    """Tensors that exist in memory: results of non-fusible operators, and
    results of fusible ones that a non-fusible operator reads or the step
    returns.  (A value passed only between fusible operators stays in
    registers: XLA fuses the chain, duplicating cheap producers into each
    fusion that needs them.)  For memory a reduction is not fusible: its
    operand and result may well be buffers (XLA's CPU back end keeps them),
    and the budget must not count on their fusion."""
    outputs = {o.tensor for o in graph.outputs}
    out: set[int] = set()
    for n in graph.nodes:
        if n.primitive not in LOOP_FUSIBLE:
            out.update(n.outputs)
            out.update(n.inputs)
    out.update(outputs)
    return out


# What a backward fusion can make again from the values it reads: element-wise
# operators and views (random bits and barriers aside: XLA never duplicates them).
RECOMPUTABLE = (LOOP_FUSIBLE - RANDOM - BARRIERS) | frozenset({"reshape"})


def backward_reads(graph: Graph, forward: Sequence[bool]) -> set[int]:
    """The forward values the backward's operators read, before fusion (what
    :func:`kept_after_fusion` takes for a whole step)."""
    made = graph.producer
    return {t for n in graph.nodes if not forward[n.id] for t in n.inputs
            if made.get(t) is not None and forward[made[t]]}


def kept_after_fusion(graph: Graph, forward: Sequence[bool], reads: Iterable[int],
                      members: Iterable[int] | None = None) -> frozenset[int]:
    """The forward values a backward keeps once XLA has fused it, given the
    values its traced equations read (``reads``, before fusion).

    A read value in memory anyway (made by a matmul, a reduction or other
    non-fusible operator, or read by one, or by a forward operator outside
    :data:`RECOMPUTABLE` and the reductions, which fuse their producers) is
    kept as it is.  One that lives only inside an element-wise chain (the
    GELU's tanh, the LayerNorm's centred input, softmax's exp) is made again
    by the backward fusion reading it, from the chain's inputs in memory:
    those are kept instead, when they cost fewer new bytes than the value
    itself (a dropout mask of 1 byte an element stays, rather than its random
    bits).  Values are taken producers first, so a chain's later values reuse
    what its earlier ones kept; a value kept for several readers counts once.
    Parameters, optimizer state and constants are resident or folded: never
    kept.  ``members``: the layer's nodes (a chain is not followed into
    another layer: the value entering it is kept); default all."""
    nodes, producer, consumers = graph.nodes, graph.producer, graph.consumers
    own = set(range(len(nodes))) if members is None else set(members)
    free = graph.resident_tensors
    outputs = graph.output_tensors

    def in_memory(t: int) -> bool:
        p = producer.get(t)
        if p is None or p not in own or nodes[p].primitive not in RECOMPUTABLE or t in outputs:
            return True
        return any(nodes[c].primitive not in RECOMPUTABLE and nodes[c].primitive not in
                   FUSED_REDUCTIONS for c in consumers.get(t, ()))

    kept: set[int] = set()

    def chain_inputs(t: int) -> set[int]:
        out, seen, stack = set(), {t}, list(nodes[producer[t]].inputs)
        while stack:
            u = stack.pop()
            if u in seen or u in free:
                continue
            seen.add(u)
            if u in kept or in_memory(u):
                out.add(u)
            elif forward[producer[u]]:
                stack.extend(nodes[producer[u]].inputs)
            else:
                out.add(u)
        return out

    def order(t: int) -> int:
        p = producer.get(t)
        return -1 if p is None else p
    for t in sorted(set(reads), key=order):
        if t in free or t in kept:
            continue
        if in_memory(t):
            kept.add(t)
            continue
        ins = chain_inputs(t)
        if sum(graph.tensors[u].nbytes for u in ins - kept) < graph.tensors[t].nbytes:
            kept |= ins
        else:
            kept.add(t)
    return frozenset(kept)
