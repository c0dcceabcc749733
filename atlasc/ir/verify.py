"""The IR verifier: SSA, topological order, no dangling values, op contracts, shapes.

`verify(graph)` raises VerificationError whose message names the node; `.details` holds the whole
graph printed with that node marked. Passes run it after every step in tests and under `--verify`.
"""

from __future__ import annotations

from atlasc.errors import AtlasError, VerificationError
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph
from atlasc.ir.ops import OPS, TensorType
from atlasc.ir.printer import format_graph


def _fail(graph: Graph, node, message: str):
    err = VerificationError(message)
    err.details = format_graph(graph, mark=node, note=message)
    raise err


def verify(graph: Graph) -> None:
    """Check every structural and typing invariant of `graph` (see module docstring)."""
    defined: set[int] = set()
    names: dict[str, object] = {}

    def define(v, node):
        if id(v) in defined:
            _fail(graph, node, f"value %{v.name} is defined twice")
        if v.is_constant:
            _fail(graph, node, f"constant %{v.name} is also defined by a node")
        prev = names.get(v.name)
        if prev is not None and prev is not v:
            _fail(graph, node, f"two values are named %{v.name}")
        names[v.name] = v
        defined.add(id(v))

    for v in graph.inputs:
        define(v, None)
    for n in graph.nodes:
        op = OPS.get(n.op)
        if op is None:
            _fail(graph, n, f"node {n.name}: op {n.op} is not registered")
        lo, hi = op.num_inputs
        if not (lo <= len(n.inputs) and (hi < 0 or len(n.inputs) <= hi)):
            _fail(graph, n, f"node {n.name}: {n.op} takes {lo}..{hi if hi >= 0 else 'n'} inputs, got {len(n.inputs)}")
        lo, hi = op.num_outputs
        if not (lo <= len(n.outputs) and (hi < 0 or len(n.outputs) <= hi)):
            _fail(graph, n, f"node {n.name}: {n.op} has {lo}..{hi if hi >= 0 else 'n'} outputs, got {len(n.outputs)}")
        for i in n.inputs:
            if i is not None and not i.is_constant and id(i) not in defined:
                _fail(graph, n, f"node {n.name} reads %{i.name} before it is defined (or it dangles)")
        try:
            attrs = op.fill_attrs(n.attrs)
            inferred = op.infer([None if i is None else TensorType(i.dtype, i.shape) for i in n.inputs], attrs)
        except AtlasError as e:
            _fail(graph, n, f"node {n.name} ({n.op}): {e.message}")
        for o, t in zip(n.outputs, inferred):
            if o.dtype != t.dtype or tuple(o.shape) != tuple(t.shape):
                _fail(graph, n, f"node {n.name} ({n.op}): output %{o.name} is {o.dtype}{S.shape_str(o.shape)}, "
                                f"the op's rule gives {t.dtype}{S.shape_str(t.shape)}")
        for o in n.outputs:
            define(o, n)
    for o in graph.outputs:
        if not o.is_constant and id(o) not in defined:
            _fail(graph, None, f"graph output %{o.name} is never defined")
    for v in graph.all_values():
        for d in v.shape:
            unknown = S.symbols_of(d) - graph.symbols.keys()
            if unknown:
                _fail(graph, None, f"value %{v.name} uses undeclared symbol(s) {sorted(unknown)}")
