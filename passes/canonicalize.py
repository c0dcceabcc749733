"""canonicalize: remove exporter noise so that later patterns see one spelling.

Matches (each rule named after its rewrite):
    Identity(x)                         => x
    Cast(x: T, to=T)                    => x
    Reshape / Expand / Squeeze / Unsqueeze / Flatten / Transpose / Slice with output type == input type
                                        => x   (no-op movement)
    Concat(x)                           => x   (single input)
    Div(1, x)                           => Reciprocal(x)
    Pow(x, 2)                           => Mul(x, x)
    Op(c, x) with c constant, Op commutative
                                        => Op(x, c)   (constants on the right)
Requires: an imported, verified graph. Guarantees: same outputs (reference-equivalent, bit-exact for
these rules), graph outputs keep their names, the graph verifies.
"""

from __future__ import annotations

from atlasc.ir.graph import Graph, Node, Value
from atlasc.ir.program import Program
from atlasc.passes.rewrite import Match, RewriteStats, Rule, apply_rules

COMMUTATIVE = ("Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal")
MOVEMENT = ("Reshape", "Expand", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Slice")


def _scalar_const(v: Value | None, value: float) -> bool:
    return v is not None and v.is_constant and v.data.size == 1 and float(v.data.reshape(-1)[0]) == value


def _identity(graph: Graph, node: Node):
    return Match(node.outputs[0], node.inputs[0])


def _same_type_cast(graph: Graph, node: Node):
    x = node.inputs[0]
    if node.attrs["to"] != x.dtype:
        return f"casts {x.dtype} to {node.attrs['to']}"
    return Match(node.outputs[0], x)


def _noop_movement(graph: Graph, node: Node):
    x, y = node.inputs[0], node.outputs[0]
    if x.shape != y.shape or x.dtype != y.dtype:
        return "changes the shape"
    if node.op == "Transpose" and tuple(node.attrs.get("perm") or ()) != tuple(range(len(x.shape))):
        return "permutes axes"
    if node.op == "Slice" and any(s != 1 for s in node.attrs["steps"]):
        return "has a non-unit step"
    if node.op == "Slice" and any(s != 0 for s in node.attrs["starts"]):
        return "starts past 0"
    return Match(y, x)


def _single_concat(graph: Graph, node: Node):
    if len(node.inputs) != 1:
        return f"{len(node.inputs)} inputs"
    return Match(node.outputs[0], node.inputs[0])


def _div_one(graph: Graph, node: Node):
    a, b = node.inputs
    if not _scalar_const(a, 1.0):
        return "numerator is not the constant 1"
    if b.dtype not in ("float32", "float16", "float64"):
        return "integer division"
    if a.shape and len(a.shape) > len(b.shape):
        return "the constant broadcasts the result"
    out = node.outputs[0]
    if out.shape != b.shape:
        return "the constant broadcasts the result"
    new = Value(out.name + "__recip", out.dtype, out.shape)
    return Match(out, new, [Node("Reciprocal", [b], [new])])


def _pow_two(graph: Graph, node: Node):
    x, e = node.inputs
    if not _scalar_const(e, 2.0):
        return "exponent is not the constant 2"
    out = node.outputs[0]
    if out.shape != x.shape:
        return "the exponent broadcasts the result"
    new = Value(out.name + "__sq", out.dtype, out.shape)
    return Match(out, new, [Node("Mul", [x, x], [new])])


def _constants_right(graph: Graph, node: Node):
    a, b = node.inputs[0], node.inputs[-1]
    if len(node.inputs) != 2 or not a.is_constant or b.is_constant:
        return "already canonical"
    out = node.outputs[0]
    new = Value(out.name + "__c", out.dtype, out.shape)
    return Match(out, new, [Node(node.op, [b, a], [new], dict(node.attrs))])


RULES = [
    Rule("Identity(x) => x", ("Identity",), _identity),
    Rule("Cast(x: T, to=T) => x", ("Cast",), _same_type_cast),
    Rule("no-op movement => x", MOVEMENT, _noop_movement),
    Rule("Concat(x) => x", ("Concat",), _single_concat),
    Rule("Div(1, x) => Reciprocal(x)", ("Div",), _div_one),
    Rule("Pow(x, 2) => Mul(x, x)", ("Pow",), _pow_two),
    Rule("Op(c, x) => Op(x, c)", COMMUTATIVE, _constants_right),
]


def canonicalize(program: Program) -> tuple[Program, RewriteStats]:
    """Apply RULES to every entry to a fixpoint."""
    stats = RewriteStats()
    for name, graph in program.entries.items():
        program.entries[name] = apply_rules(graph, RULES, stats)
    return program, stats

