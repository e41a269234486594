"""Count the collectives of a compiled program from its optimized HLO text.

``compiled.as_text()`` (``jax.jit(...).lower(...).compile()``) is the HLO one
device runs after SPMD partitioning.  Each collective instruction looks like::

    %all-reduce = f32[16,32]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, ...
    %all-to-all = (f32[1,64]{1,0}, ..., /*index=5*/f32[1,64]{1,0}, ...) all-to-all(...), ...
    %ag-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%x), ...
    %ag-done = f32[64,16]{1,0} all-gather-done(%ag-start)

What counts (the definition of ``comm_bytes_per_device`` in DESIGN.md): the
sum, over collective instructions, of the bytes of each one's *result* on one
device.  A tuple-shaped result counts all its elements; ``/*index=N*/``
comments inside long tuples are stripped first.  Every instruction counts
once, wherever it sits (a collective in a while body counts once, not once
per trip); :func:`collective_bytes_per_call` counts it once per trip where XLA
knows the trip count (``known_trip_count``: a rolled ``lax.scan``).

Asynchronous pairs count once, at the ``-start``, with the size of what the
pair produces:

* if the matching ``-done`` (the one whose operand is the start) is in the
  text, its result shape is the collective's result;
* otherwise the start's own shape decides.  ``all-reduce-start`` returns the
  reduced value itself (an array, or a tuple of them when combined).  The
  other starts return ``(operands, results, context...)``: XLA prints
  ``all-gather-start`` as ``(operand, result)`` (combined:
  ``((op0, op1), (res0, res1))``), ``collective-permute-start`` as
  ``(operand, result[, u32[], u32[]])`` and the async wrappers of
  ``reduce-scatter`` / ``all-to-all`` as ``((operands), result, s32[])``.
  So trailing scalar ``u32[]``/``s32[]`` context elements are dropped, and
  of what remains the second element (or, for a flat tuple of 2n arrays, the
  last n) is the result.

The ``-done`` instructions themselves are never counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Union

__all__ = ("Collective", "KINDS", "parse_collectives", "collective_bytes",
           "collective_bytes_per_call", "summary", "shape_bytes", "parse_shape",)

KINDS: tuple[str, ...] = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                          "collective-permute")

# Bits per element of the HLO primitive types.
_DTYPE_BITS: Mapping[str, int] = MappingProxyType({
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "token": 0, "opaque": 0,
})
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?")
_COLLECTIVE_OP = re.compile(r"^(?P<kind>%s)(?P<suffix>-start|-done)?$" % "|".join(KINDS))
# a computation's first line: ``%name (params) -> shape {`` or ``ENTRY %name ... {``
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return (n * dtype_bits(self.dtype) + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


Shape = Union[Array, tuple["Shape", ...]]


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the per-device program."""
    kind: str                   # one of KINDS ("-start" dropped)
    result_bytes: int           # bytes of its result on one device
    shapes: tuple[str, ...]     # the arrays counted, e.g. ("f32[8,16]", "f32[16]")
    replica_groups_text: str    # replica_groups=... (source_target_pairs=... for permutes)
    line: str                   # the HLO line, comments stripped
    name: str = ""              # the instruction name
    is_async: bool = False      # a -start / -done pair
    # times one call runs it: the known trip counts of the while loops
    # around it (a rolled lax.scan's body), 1 outside any
    runs: int = 1


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO type name (``f32``, ``bf16``, ``f8e4m3fn``, ...)."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    m = re.fullmatch(r"[suf](\d+)", dtype)
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}")


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

def parse_shape(text: str) -> Shape:
    """An HLO shape (an array or a possibly nested tuple), layouts ignored."""
    text = _COMMENT.sub("", text).strip()
    shape, end = _parse_shape_at(text, 0)
    if text[end:].strip():
        raise ValueError(f"trailing text after HLO shape: {text!r}")
    return shape


def _parse_shape_at(text: str, i: int) -> tuple[Shape, int]:
    while i < len(text) and text[i].isspace():
        i += 1
    if text.startswith("(", i):
        items: list[Shape] = []
        i += 1
        while True:
            while i < len(text) and text[i] in " ,":
                i += 1
            if i >= len(text):
                raise ValueError(f"unbalanced tuple shape: {text!r}")
            if text[i] == ")":
                return tuple(items), i + 1
            item, i = _parse_shape_at(text, i)
            items.append(item)
    m = _ARRAY.match(text, i)
    if not m:
        raise ValueError(f"cannot read an HLO shape at {text[i:i + 40]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group("dims").split(",") if d.strip())
    dtype_bits(m.group("dtype"))  # refuse unknown types early
    return Array(m.group("dtype"), dims), m.end()


def arrays(shape: Shape) -> Iterator[Array]:
    if isinstance(shape, Array):
        yield shape
    else:
        for s in shape:
            yield from arrays(s)


def shape_bytes(shape: Shape | str) -> int:
    """Bytes of all arrays in ``shape`` (tuples summed)."""
    if isinstance(shape, str):
        shape = parse_shape(shape)
    return sum(a.nbytes for a in arrays(shape))


def _start_result(kind: str, shape: Shape) -> Shape:
    """The result part of a ``-start`` instruction's shape (see module doc)."""
    if kind == "all-reduce" or isinstance(shape, Array):
        return shape
    items = list(shape)
    while (len(items) > 2 and isinstance(items[-1], Array) and not items[-1].dims
           and items[-1].dtype in ("u32", "s32")):
        items.pop()
    if len(items) == 2:
        return items[1]
    if len(items) % 2 == 0 and all(isinstance(x, Array) for x in items):
        return tuple(items[len(items) // 2:])
    return tuple(items)


# ---------------------------------------------------------------------------
# Instructions
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Instr:
    name: str
    shape_text: str
    opcode: str
    operands: str
    attrs: str
    line: str
    computation: str = ""       # the computation it belongs to


def _balanced(text: str, i: int) -> int:
    """Index just past the bracket group opening at ``text[i]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for j in range(i, len(text)):
        c = text[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    return len(text)


def _instructions(text: str) -> Iterator[_Instr]:
    computation = ""
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        header = _HEADER.match(line)
        if header:
            computation = header.group("name")
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group("rest")
        if rest.startswith("("):
            end = _balanced(rest, 0)
        else:
            sp = rest.find(" ")
            end = sp if sp >= 0 else len(rest)
        shape_text, tail = rest[:end], rest[end:].lstrip()
        om = re.match(r"([\w\-]+)\(", tail)
        if not om:
            continue
        close = _balanced(tail, om.end() - 1)
        yield _Instr(m.group("name"), shape_text, om.group(1), tail[om.end():close - 1],
                     tail[close:], line.strip(), computation)


def _runs(instrs: list[_Instr]) -> dict[str, int]:
    """computation -> how many times one call of the program runs it: the
    product of the known trip counts of the ``while`` loops around it (1 for
    the entry, and where XLA does not know a count)."""
    loops = []
    for ins in instrs:
        if ins.opcode == "while":
            m = _TRIP_COUNT.search(ins.attrs)
            loops.append((ins.computation, _attr(ins.attrs, "body").lstrip("%"),
                          int(m.group(1)) if m else 1))
    runs: dict[str, int] = {}
    for _ in range(len(loops) + 1):     # (nested loops: until nothing changes)
        changed = False
        for outer, body, n in loops:
            r = runs.get(outer, 1) * n
            if runs.get(body) != r:
                runs[body], changed = r, True
        if not changed:
            break
    return runs


def _attr(attrs: str, key: str) -> str:
    """The value of ``key=...`` in an attribute list (up to a top-level comma)."""
    m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
    if not m:
        return ""
    i, depth = m.end(), 0
    for j in range(i, len(attrs)):
        c = attrs[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            return attrs[i:j].strip()
    return attrs[i:].strip()


def _operand_names(operands: str) -> list[str]:
    """Names of the operands (``%x`` or, in typed printing, ``f32[2] %x``)."""
    names = []
    depth, start = 0, 0
    for j, c in enumerate(operands + ","):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            token = operands[start:j].strip().split()
            if token:
                names.append(token[-1].lstrip("%"))
            start = j + 1
    return names


def _as_text(hlo: Any) -> str:
    return hlo if isinstance(hlo, str) else hlo.as_text()


def parse_collectives(hlo: Any) -> list[Collective]:
    """The collectives of an HLO module text (or of anything with ``as_text()``)."""
    instrs = list(_instructions(_as_text(hlo)))
    runs = _runs(instrs)
    done_shape: dict[str, str] = {}
    for ins in instrs:
        m = _COLLECTIVE_OP.match(ins.opcode)
        if m and m.group("suffix") == "-done":
            for name in _operand_names(ins.operands)[:1]:
                done_shape[name] = ins.shape_text
    out = []
    for ins in instrs:
        m = _COLLECTIVE_OP.match(ins.opcode)
        if not m or m.group("suffix") == "-done":
            continue
        kind = m.group("kind")
        is_async = m.group("suffix") == "-start"
        if is_async and ins.name in done_shape:
            result = parse_shape(done_shape[ins.name])
        elif is_async:
            result = _start_result(kind, parse_shape(ins.shape_text))
        else:
            result = parse_shape(ins.shape_text)
        groups = _attr(ins.attrs, "replica_groups") or _attr(ins.attrs, "source_target_pairs")
        counted = tuple(arrays(result))
        out.append(Collective(kind=kind, result_bytes=sum(a.nbytes for a in counted),
                              shapes=tuple(str(a) for a in counted),
                              replica_groups_text=groups, line=ins.line, name=ins.name,
                              is_async=is_async, runs=runs.get(ins.computation, 1)))
    return out


def collective_bytes(hlo: Any) -> int:
    """Sum over the collectives of their result bytes on one device."""
    return sum(c.result_bytes for c in parse_collectives(hlo))


def collective_bytes_per_call(hlo: Any) -> int:
    """:func:`collective_bytes` with each collective counted as many times as
    one call runs it (a rolled loop's body once per trip: ``Collective.runs``)."""
    return sum(c.result_bytes * c.runs for c in parse_collectives(hlo))


def summary(hlo: Any, per_call: bool = False) -> dict[str, tuple[int, int]]:
    """kind -> (number of collectives, their result bytes), kinds present only;
    ``per_call``: each counted as many times as one call runs it
    (:func:`collective_bytes_per_call`)."""
    acc: dict[str, tuple[int, int]] = {}
    for c in parse_collectives(hlo):
        n, b = acc.get(c.kind, (0, 0))
        runs = c.runs if per_call else 1
        acc[c.kind] = (n + runs, b + runs * c.result_bytes)
    return acc


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

# opcodes inside a fused computation that make its kernel a matmul or a reduction
_MATMUL_OPS = frozenset({"dot", "convolution"})
_REDUCE_OPS = frozenset({"reduce", "reduce-window"})
# a library matmul (cuBLAS, oneDNN) called as a custom call
_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
# top-level opcodes that launch no kernel of their own
_NO_KERNEL_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                            "while", "call", "conditional", "after-all", "opt-barrier"})


def kernel_summary(hlo: Any) -> dict[str, tuple[int, int]]:
    """The kernels of a compiled program: kind -> (how many, the bytes of
    their results on one device).  A kernel is an instruction outside any
    fused or applied computation (a fusion, an unfused dot, a copy...); its
    kind is ``matmul`` where it is or fuses a dot or convolution or calls a
    library GEMM, ``reduction`` where it reduces, else ``loop``; and
    ``collective``: the collectives of :func:`parse_collectives` with their
    result bytes.  Each counts once per call of the program (a loop body
    once per trip, where XLA knows the count)."""
    instrs = list(_instructions(_as_text(hlo)))
    runs = _runs(instrs)
    body: dict[str, set[str]] = {}
    for ins in instrs:
        body.setdefault(ins.computation, set()).add(ins.opcode)
    # (a fusion's body, a reduce's or a sort's computation: no kernels of
    # their own; a plain call's body runs its kernels where it is called)
    inner = {_attr(ins.attrs, key).lstrip("%") for ins in instrs if ins.opcode != "call"
             for key in ("calls", "to_apply", "comparator")} - {""}
    acc: dict[str, tuple[int, int]] = {}

    def add(kind: str, n: int, nbytes: int) -> None:
        n0, b0 = acc.get(kind, (0, 0))
        acc[kind] = (n0 + n, b0 + nbytes)

    for ins in instrs:
        if ins.computation in inner or ins.opcode in _NO_KERNEL_OPS \
                or _COLLECTIVE_OP.match(ins.opcode):
            continue
        ops = body.get(_attr(ins.attrs, "calls").lstrip("%"), set()) | {ins.opcode}
        library = ins.opcode == "custom-call" and _GEMM_TARGET.search(
            _attr(ins.attrs, "custom_call_target"))
        kind = ("matmul" if ops & _MATMUL_OPS or library
                else "reduction" if ops & _REDUCE_OPS else "loop")
        k = runs.get(ins.computation, 1)
        add(kind, k, k * shape_bytes(ins.shape_text))
    for c in parse_collectives(hlo):
        add("collective", c.runs, c.runs * c.result_bytes)
    return acc
