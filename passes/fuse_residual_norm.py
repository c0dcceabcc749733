"""fuse-residual-norm: a residual add feeding a normalization joins it (one kernel, the sum kept).

Matches (after fuse-rmsnorm; LayerNormalization is imported natively):

    s = Add(a, b)      (same shape and dtype, no broadcast, neither a constant)
    y = RMSNormalization(s, w)        =>  y, s = AddRMSNormalization(a, b, w)
    y = LayerNormalization(s, w[, c]) =>  y, s = AddLayerNormalization(a, b, w[, c])

over the last axis only (and a LayerNormalization without its mean / inv-std outputs). The sum stays
an output: the residual stream reads it on. Requires: fuse-rmsnorm. Guarantees: bit-identical on the
CPU (the sum is rounded to the dtype like the Add, then normalized by the norm's own reference).
"""

from __future__ import annotations

from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph, Node, Value
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

FUSED = {"RMSNormalization": "AddRMSNormalization", "LayerNormalization": "AddLayerNormalization"}


def _same_shape(*values: Value) -> bool:
    shapes = {tuple(S.dim(d) for d in v.shape) for v in values}
    return len(shapes) == 1


def _why_not(norm: Node, add: Node | None, graph: Graph) -> str | None:
    if add is None or add.op != "Add":
        return "the input is not an Add"
    a, b = add.inputs
    s = norm.inputs[0]
    if not _same_shape(a, b, s) or a.dtype != b.dtype or a.is_constant or b.is_constant:
        return "the add broadcasts or reads a constant"
    if (norm.attrs.get("axis", -1) % len(s.shape)) != len(s.shape) - 1:
        return "the norm is not over the last axis"
    extra = [o for o in norm.outputs[1:] if o is not None and (graph.users(o) or any(o is g for g in graph.outputs))]
    if extra:
        return "the norm's statistics outputs are read"
    return None


def fuse_graph(graph: Graph, stats: RewriteStats) -> None:
    producers = graph.producers()
    for norm in [n for n in graph.nodes if n.op in FUSED]:
        op = FUSED[norm.op]
        rule = f"{norm.op}(Add(a, b), ...) => {op}(a, b, ...)"
        add = producers.get(id(norm.inputs[0]))
        why = _why_not(norm, add, graph)
        if why:
            stats.declined[f"{rule} at {norm.name}"] = why
            continue
        s, y = norm.inputs[0], norm.outputs[0]
        y_new = Value(y.name + "__res", y.dtype, y.shape)
        s_new = Value(s.name + "__sum", s.dtype, s.shape)
        attrs = {"axis": -1, "epsilon": norm.attrs["epsilon"]}
        fused = Node(op, [*add.inputs, *norm.inputs[1:]], [y_new, s_new], attrs, name=f"residual_norm:{y.name}")
        graph.nodes.insert(graph.nodes.index(add), fused)
        graph.replace_all_uses(s, s_new)
        graph.replace_all_uses(y, y_new)
        stats.applied[rule] = stats.applied.get(rule, 0) + 1
    graph.cleanup()
    graph.toposort()


def fuse_residual_norm(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse residual adds into the norms they feed, in every entry (a no-op with fusion disabled)."""
    stats = RewriteStats()
    if program.options.fusion:
        for graph in program.entries.values():
            fuse_graph(graph, stats)
    return program, stats
