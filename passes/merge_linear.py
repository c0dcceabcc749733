"""merge-linear: linear layers that read the same input become one (Q/K/V, gate/up).

Matches:
    q = Linear(x, Wq[, bq]);  k = Linear(x, Wk[, bk]);  v = Linear(x, Wv[, bv])     (same x, constant W)
    =>
    qkv = Linear(x, concat(Wq, Wk, Wv)[, concat(bq, bk, bv)]);  q, k, v = Split(qkv, axis=-1)

and the same for quantized layers (quantize runs first, so that an 8B compile never holds a float
copy of the merged weights): LinearQ8 / LinearF8 / LinearQ4 of one group size concatenate their integer weights
and scales along N. Their float weights (program.float_weights, for the accuracy report) become the
tuple of (part's layer name, float weight) under the merged node's name, so the report keeps one
error per layer of the quantize report.

One weight matrix means one kernel streaming one long stream of rows instead of three short ones
(at decode the small projections run far from the bandwidth roofline; docs/perf.md), and the input is
read once. A missing bias among biased layers becomes zeros.

Requires: fuse-linear. Guarantees: outputs equal the separate layers' up to float summation order
(each output element is the same dot product); graph outputs keep their names.
"""

from __future__ import annotations

import numpy as np

from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.ops.quant import q4_zero
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

RULE = "Linear(x, W1), Linear(x, W2), ... => Split(Linear(x, [W1; W2; ...]))"


# op -> how many leading inputs after x are constants concatenated along N (weight; weight, scale)
MERGEABLE = {"Linear": 1, "LinearQ8": 2, "LinearQ4": 2, "LinearF8": 2}


def _mergeable(node: Node) -> bool:
    if node.op not in MERGEABLE:
        return False
    k = MERGEABLE[node.op]
    consts = node.inputs[1:1 + k]
    b = node.inputs[1 + k] if len(node.inputs) > 1 + k else None
    z = q4_zero(node)
    return all(c.is_constant for c in consts) and (b is None or b.is_constant) and (z is None or z.is_constant)


def _signature(node: Node) -> tuple:
    """What must agree for nodes to merge: op, attributes, each constant's dtype and trailing dims, and
    whether LinearQ4 has zero points."""
    consts = node.inputs[1:1 + MERGEABLE[node.op]]
    return (node.op, tuple(sorted(node.attrs.items())), tuple((c.dtype, tuple(c.shape[1:])) for c in consts),
            q4_zero(node) is not None)


def _concat_rows(program: Program, parts: list[np.ndarray]) -> np.ndarray:
    """The parts stacked along axis 0, in an array from program.new_array (on disk for a compile),
    copied a block of rows at a time (a part may be a memory-mapped or transposed view)."""
    rows = sum(int(p.shape[0]) for p in parts)
    out = program.new_array((rows,) + tuple(parts[0].shape[1:]), parts[0].dtype)
    r = 0
    for p in parts:
        step = max(1, (16 << 20) // max(1, p[:1].nbytes))
        for r0 in range(0, p.shape[0], step):
            block = p[r0:r0 + step]
            out[r:r + block.shape[0]] = block
            r += block.shape[0]
    return out


def _merge_group(program: Program, graph: Graph, nodes: list[Node], index: int) -> None:
    x = nodes[0].inputs[0]
    k = MERGEABLE[nodes[0].op]
    name0 = nodes[0].inputs[1].name
    inputs = [x]
    for j in range(1, 1 + k):
        parts = [n.inputs[j].data for n in nodes]
        tag = "w" if j == 1 else "s"
        inputs.append(constant(f"merged_{tag}_{index}__{nodes[0].inputs[j].name}", _concat_rows(program, parts)))
    biases = [n.inputs[1 + k] if len(n.inputs) > 1 + k else None for n in nodes]
    sizes = tuple(int(n.inputs[1].shape[0]) for n in nodes)
    if any(b is not None for b in biases):
        dt = next(b.data.dtype for b in biases if b is not None)
        parts = [b.data.reshape(-1) if b is not None else np.zeros(n, dt) for b, n in zip(biases, sizes)]
        inputs.append(constant(f"merged_b_{index}__{name0}", np.concatenate(parts)))
    if q4_zero(nodes[0]) is not None:  # LinearQ4(x, wq, scale, bias or None, zero)
        if len(inputs) == 1 + k:
            inputs.append(None)
        inputs.append(constant(f"merged_z_{index}__{name0}", _concat_rows(program, [q4_zero(n).data for n in nodes])))
    first_out = nodes[0].outputs[0]
    shape = tuple(first_out.shape[:-1]) + (sum(sizes),)
    merged = Value(f"merged_{index}__{first_out.name}", first_out.dtype, shape)
    linear = Node(nodes[0].op, inputs, [merged], dict(nodes[0].attrs), name=f"merged_linear_{index}")
    floats = program.float_weights
    if all(n.name in floats for n in nodes):  # quantized parts: keep their float weights, not a concatenation
        linear_parts = []
        for n in nodes:
            part = floats.pop(n.name)
            linear_parts.extend(part if isinstance(part, tuple) else ((n.name, part),))
        floats[linear.name] = tuple(linear_parts)  # (the part's layer name in the quantize report, weight)
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
            sig = _signature(nodes[0])
            same = [n for n in nodes if _signature(n) == sig]
            if len(same) < 2:
                stats.declined[f"{RULE} at {nodes[0].name}"] = "the layers differ in op, dtype, K or group size"
                continue
            _merge_group(program, graph, same, index)
            index += 1
            stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
        graph.toposort()
    return program, stats
