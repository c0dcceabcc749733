"""merge-linear: linear layers that read the same input become one (Q/K/V, gate/up).

Matches:
    q = Linear(x, Wq[, bq]);  k = Linear(x, Wk[, bk]);  v = Linear(x, Wv[, bv])     (same x, constant W)
    =>
    qkv = Linear(x, concat(Wq, Wk, Wv)[, concat(bq, bk, bv)]);  q, k, v = Split(qkv, axis=-1)

One weight matrix means one kernel streaming one long stream of rows instead of three short ones
(at decode the small projections run far from the bandwidth roofline; docs/perf.md), and the input is
read once. A missing bias among biased layers becomes zeros.

Requires: fuse-linear. Guarantees: outputs equal the separate layers' up to float summation order
(each output element is the same dot product); graph outputs keep their names.
"""

from __future__ import annotations

import numpy as np

from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

RULE = "Linear(x, W1), Linear(x, W2), ... => Split(Linear(x, [W1; W2; ...]))"


def _mergeable(node: Node) -> bool:
    if node.op != "Linear":
        return False
    w = node.inputs[1]
    b = node.inputs[2] if len(node.inputs) > 2 else None
    return w.is_constant and (b is None or b.is_constant)


def _merge_group(graph: Graph, nodes: list[Node], index: int) -> None:
    x = nodes[0].inputs[0]
    weights = [n.inputs[1].data for n in nodes]
    biases = [n.inputs[2] if len(n.inputs) > 2 else None for n in nodes]
    sizes = tuple(int(w.shape[0]) for w in weights)
    w_cat = constant(f"merged_w_{index}__{nodes[0].inputs[1].name}", np.ascontiguousarray(np.concatenate(weights)))
    inputs = [x, w_cat]
    if any(b is not None for b in biases):
        parts = [b.data.reshape(-1) if b is not None else np.zeros(n, weights[0].dtype) for b, n in zip(biases, sizes)]
        inputs.append(constant(f"merged_b_{index}__{nodes[0].inputs[1].name}", np.concatenate(parts)))
    first_out = nodes[0].outputs[0]
    shape = tuple(first_out.shape[:-1]) + (sum(sizes),)
    merged = Value(f"merged_{index}__{first_out.name}", first_out.dtype, shape)
    linear = Node("Linear", inputs, [merged], name=f"merged_linear_{index}")
    split = Node("Split", [merged], [n.outputs[0] for n in nodes], {"axis": -1, "split": sizes},
                 name=f"merged_split_{index}")
    position = min(graph.nodes.index(n) for n in nodes)
    for n in nodes:
        graph.nodes.remove(n)
    graph.nodes[position:position] = [linear, split]


def merge_linear(program: Program) -> tuple[Program, RewriteStats]:
    """Merge every group of >= 2 constant-weight Linear nodes sharing an input (no-op without fusion)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    for graph in program.entries.values():
        groups: dict[int, list[Node]] = {}
        for node in graph.nodes:
            if _mergeable(node):
                groups.setdefault(id(node.inputs[0]), []).append(node)
        index = 0
        for nodes in groups.values():
            if len(nodes) < 2:
                continue
            w0 = nodes[0].inputs[1]
            same = [n for n in nodes if n.inputs[1].dtype == w0.dtype and n.inputs[1].shape[1:] == w0.shape[1:]]
            if len(same) < 2:
                stats.declined[f"{RULE} at {nodes[0].name}"] = "the weights differ in dtype or K"
                continue
            _merge_group(graph, same, index)
            index += 1
            stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
        graph.toposort()
    return program, stats
