"""fuse-elementwise: chains (trees) of elementwise nodes => one FusedElementwise node.

Matches (a group grows from its root, the last node, towards its producers):

    a ──┐                                      a ──┐
        Mul ── t ──┐                               │
    b ──┘          Add ── y        =>          b ──┼── FusedElementwise ── y
              c ───┘                           c ──┘   program: t = Mul(in0, in1); y = Add(t, in2)

A producer joins the group of its consumer when
- both are of kind "elementwise" (not FusedElementwise itself) over the dtypes the kernels compute
  (no float64 anywhere in the node: its C expressions differ and nothing here needs it),
- its output has exactly one reader, a node of the group, and is not a graph output (the safety
  rule: a value used outside the group never disappears; a graph output may only be a root),
- its inputs broadcast into the group's output shape (so every step is computable per output
  element: a smaller intermediate is recomputed per element through broadcasting).
Groups of one node stay as they are.

Then a group input that is a Split or Slice along the last axis (static, step 1, no broadcast over
that axis) is read straight from the sliced tensor through the node's `slices` attribute, and the
Split/Slice disappears when nothing else reads it (SwiGLU on a merged gate/up projection: one kernel).

Requires: entry-points (+ canonicalize/dce) ran, so decode's seq = 1 no-ops are gone; works on any
entry, "main" included. Does nothing when `program.options.fusion` is False.
Guarantees: every group becomes one node whose steps run the replaced nodes' own references in
order, so outputs are bit-identical on the CPU; graph outputs keep their names (the root's output
value is reused); the groups partition the elementwise nodes; the graph verifies.
"""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir.graph import Graph, Node, Value
from atlasc.ir.ops import get
from atlasc.ir.ops.common import broadcast_shapes
from atlasc.ir.ops.fused import freeze
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

RULE = "elementwise chain => FusedElementwise"
DTYPES = ("float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def fusible(node: Node) -> str | None:
    """None when node may be a member of a group, else why not."""
    op = get(node.op)
    if op.kind != "elementwise" or node.op == "FusedElementwise":
        return f"{node.op} is not a plain elementwise op"
    if op.stateful or op.dim_attrs or len(node.outputs) != 1:
        return f"{node.op} has state, dim attributes or several outputs"
    for v in [*node.inputs, *node.outputs]:
        if v is not None and v.dtype not in DTYPES:
            return f"{v.name} is {v.dtype}"
    return None


def _broadcasts_into(shape: tuple, out: tuple) -> bool:
    try:
        return len(shape) <= len(out) and broadcast_shapes(shape, out) == tuple(out)
    except ShapeError:
        return False


def find_groups(graph: Graph, stats: RewriteStats) -> list[list[Node]]:
    """The groups (each in graph order, root last) of >= 2 nodes; declines go into stats."""
    producer = graph.producers()
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            if i is not None:
                readers.setdefault(id(i), []).append(n)
    outputs = {id(o) for o in graph.outputs}
    order = {id(n): k for k, n in enumerate(graph.nodes)}
    assigned: set[int] = set()
    groups = []
    for root in reversed(graph.nodes):
        if id(root) in assigned or fusible(root) is not None:
            continue
        assigned.add(id(root))
        out_shape = root.outputs[0].shape
        members, frontier = [root], [root]
        while frontier:
            node = frontier.pop()
            for v in node.inputs:
                p = producer.get(id(v)) if v is not None else None
                if p is None or id(p) in assigned or get(p.op).kind != "elementwise":
                    continue  # (only elementwise producers are candidates worth explaining)
                why = _decline(p, v, node, readers, outputs, out_shape)
                if why:
                    stats.declined[f"{RULE} at {p.name}"] = why
                    continue
                assigned.add(id(p))
                members.append(p)
                frontier.append(p)
        if len(members) >= 2:
            groups.append(sorted(members, key=lambda n: order[id(n)]))
    return groups


def _decline(p: Node, v: Value, consumer: Node, readers, outputs, out_shape) -> str | None:
    why = fusible(p)
    if why:
        return why
    if id(v) in outputs:
        return f"its output {v.name} is a graph output"
    users = {id(n) for n in readers.get(id(v), [])}
    if users != {id(consumer)}:
        return f"its output {v.name} has {len(users)} readers"
    for i in p.inputs:
        if i is not None and not _broadcasts_into(i.shape, out_shape):
            return f"input {i.name} does not broadcast into the group's output shape"
    return None


def fuse_group(members: list[Node]) -> Node:
    """One FusedElementwise node computing members (in graph order, root last)."""
    root = members[-1]
    step_of = {id(n.outputs[0]): k for k, n in enumerate(members)}
    inputs: list[Value] = []
    index: dict[int, int] = {}
    program = []
    for n in members:
        refs = []
        for v in n.inputs:
            if v is None:
                refs.append(None)
            elif id(v) in step_of:
                refs.append(("step", step_of[id(v)]))
            else:
                if id(v) not in index:
                    index[id(v)] = len(inputs)
                    inputs.append(v)
                refs.append(("in", index[id(v)]))
        program.append((n.op, freeze(tuple(sorted(n.attrs.items()))), tuple(refs)))
    out = root.outputs[0]
    attrs = {"program": tuple(program), "out_shape": tuple(out.shape), "out_dtype": out.dtype}
    return Node("FusedElementwise", inputs, [out], attrs, name=f"FusedElementwise:{out.name}")


def fuse_graph(graph: Graph, stats: RewriteStats) -> Graph:
    groups = find_groups(graph, stats)
    replaced = {id(n): g for g in groups for n in g}
    nodes = []
    for n in graph.nodes:
        g = replaced.get(id(n))
        if g is None:
            nodes.append(n)
        elif n is g[-1]:
            nodes.append(fuse_group(g))
            stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
    graph.nodes = nodes
    return graph.toposort()


SLICE_RULE = "FusedElementwise(Split/Slice(x, last axis)) => FusedElementwise(x){slices}"


def _last_axis_slice(node: Node, v: Value) -> tuple[int, int] | None:
    """(start, length) when v is output of a static last-axis Split/Slice of node.inputs[0], else None."""
    x = node.inputs[0]
    rank = len(x.shape)
    if rank == 0 or not isinstance(x.shape[-1], int):
        return None
    if node.op == "Split" and len(node.inputs) == 1 and node.attrs.get("axis", 0) % rank == rank - 1:
        sizes = node.attrs.get("split")
        if not sizes or not all(isinstance(z, int) for z in sizes):
            return None
        k = next(i for i, o in enumerate(node.outputs) if o is v)
        return sum(sizes[:k]), sizes[k]
    if node.op == "Slice" and len(node.inputs) == 1:
        axes, starts = node.attrs.get("axes"), node.attrs.get("starts")
        steps = node.attrs.get("steps") or (1,)
        if not axes or len(axes) != 1 or axes[0] % rank != rank - 1 or tuple(steps) != (1,):
            return None
        if not isinstance(starts[0], int) or not isinstance(v.shape[-1], int) or starts[0] < 0:
            return None
        return starts[0], v.shape[-1]
    return None


def absorb_slices(graph: Graph, stats: RewriteStats) -> Graph:
    """Let FusedElementwise nodes read last-axis Split/Slice outputs from the sliced tensor itself."""
    producer = graph.producers()
    for n in graph.nodes:
        if n.op != "FusedElementwise":
            continue
        out_last = n.outputs[0].shape[-1] if n.outputs[0].shape else None
        slices = list(n.attrs.get("slices") or [None] * len(n.inputs))
        inputs = list(n.inputs)
        for i, v in enumerate(inputs):
            p = producer.get(id(v))
            if slices[i] is not None or p is None or p.op not in ("Split", "Slice") or \
                    len(v.shape) != len(n.outputs[0].shape):
                continue
            sl = _last_axis_slice(p, v)
            if sl is None or sl[1] != out_last or p.inputs[0].dtype != v.dtype:
                stats.declined[f"{SLICE_RULE} at {n.name}"] = \
                    f"{p.name} is not a static last-axis slice of the output's width"
                continue
            inputs[i], slices[i] = p.inputs[0], sl
            stats.applied[SLICE_RULE] = stats.applied.get(SLICE_RULE, 0) + 1
        if any(sl is not None for sl in slices):
            n.inputs = inputs
            n.attrs = {**n.attrs, "slices": freeze(tuple(slices))}
    graph.cleanup()
    return graph


def fuse_elementwise(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse elementwise groups in every entry (no-op with fusion off)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    for name, graph in program.entries.items():
        program.entries[name] = absorb_slices(fuse_graph(graph, stats), stats)
    return program, stats
