"""fold-norm-scale: an RMSNorm's scale g moves into the weight its output feeds, W := T(W g) (column k times g[k]),
and the norm keeps a scale of ones, in every entry at once.

What for: the copy-engine projection (codegen/linear_tma.py) reads x through its shared-memory stages as the copy
engine wrote them; with g in the weight it needs from x only each row's 1 / rms, which it sums from the stages
while the tensor cores multiply them (linear_tma.cu NORM). Multiplying x by g in the stages instead measured up to
2.5x slower on the H200 (docs/perf.md v31). fuse-linear-prologue calls this module: `foldable` and `folded` before it
fuses (the copy-engine norms fuse only over weights that can fold), `fold` after, for the weights those norms read.

A weight W can fold when it is a float16 constant [N, K] and every reader of it, in every entry, is a float16
Linear / LinearGated / LinearRotary (W its weight input) whose x is the only read output of an RMSNormalization or
AddRMSNormalization with one and the same constant scale g [K] (or, after fuse-linear-prologue, a NormLinear /
NormLinearRotary with that g), and T(W g) is finite. Folding rewrites W's readers to the new weight and their
norms (or fused norms) to a shared constant of ones. Guarantees: the same function up to one float16 rounding of
W g (the reference before and after agrees to float16 tolerance, not bit for bit); the norm's sum output, the
weights' names and the other readers of g are unchanged.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.program import Program

NORMS = ("RMSNormalization", "AddRMSNormalization")
PROJECTIONS = {"Linear": 1, "LinearGated": 1, "LinearRotary": 3}  # op -> its weight input
FUSED = {"NormLinear": 3, "NormLinearRotary": 5}  # op -> its weight input (g: input 2)
CHUNK_ROWS = 1024  # rows of W converted at a time (float32 temporaries of a few MB per thread)
RULE = "RMSNorm(h, g) -> W  =>  RMSNorm(h, 1) -> T(W g)"


def _scale_of(graph: Graph, producers: dict, node: Node, index: int) -> Value | None:
    """The norm scale g feeding reader `node` of a weight at input `index`; None where it is not such a reader."""
    if node.op in FUSED and index == FUSED[node.op]:
        if node.attrs.get("linear", "Linear") != "Linear" or node.inputs[0].dtype != "float16":
            return None
        return node.inputs[2]
    if node.op not in PROJECTIONS or index != PROJECTIONS[node.op] or node.inputs[0].dtype != "float16":
        return None
    x = node.inputs[0]
    p = producers.get(id(x))
    if p is None or p.op not in NORMS or p.outputs[0] is not x:
        return None
    if len(graph.users(x)) != 1 or any(x is o for o in graph.outputs):
        return None
    return p.inputs[-1]


def foldable(program: Program) -> dict[int, Value]:
    """{id(W): g} for the weights whose readers allow a fold (the module docstring's conditions but the last:
    `folded` checks that T(W g) is finite), over all entries."""
    scale: dict[int, Value] = {}
    bad: set[int] = set()
    for graph in program.entries.values():
        bad.update(id(v) for v in graph.outputs)  # a weight that is also an output keeps its value
        producers = graph.producers()
        for node in graph.nodes:
            for index, w in enumerate(node.inputs):
                if w is None or not w.is_constant:
                    continue
                g = _scale_of(graph, producers, node, index)
                ok = (g is not None and g.is_constant and w.dtype == "float16" and len(w.shape) == 2
                      and tuple(g.shape) == (w.shape[1],) and g.dtype == w.dtype)
                if not ok or scale.setdefault(id(w), g) is not g:
                    bad.add(id(w))
    return {key: g for key, g in scale.items() if key not in bad}


def folded(program: Program, w: Value, g: Value) -> np.ndarray | None:
    """T(W g) (rows converted in chunks, on all cores, into program.new_array), or None where a value overflows
    float16."""
    data = program.new_array(w.data.shape, np.float16)
    scale = g.data.astype(np.float32)

    def rows(i: int) -> bool:  # numpy releases the GIL: chunks convert in parallel threads
        with np.errstate(over="ignore"):
            chunk = (w.data[i:i + CHUNK_ROWS].astype(np.float32) * scale).astype(np.float16)
        data[i:i + CHUNK_ROWS] = chunk
        return bool(np.all(np.isfinite(chunk)))

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        finite = list(pool.map(rows, range(0, w.data.shape[0], CHUNK_ROWS)))
    return data if all(finite) else None


def fold(program: Program, weights: dict[int, tuple[Value, Value, np.ndarray]]) -> int:
    """Replace each weight W of `weights` ({id(W): (W, g, T(W g))}) by its folded data in every entry, and the scale
    g of the norms (or fused norms) feeding it by ones; returns how many weights folded."""
    new = {key: constant(w.name, data) for key, (w, _, data) in weights.items()}
    ones: dict[int, Value] = {}
    for _, g, _ in weights.values():
        ones.setdefault(id(g), constant(f"{g.name}__folded", np.ones(g.shape, np.float16)))
    for graph in program.entries.values():
        producers = graph.producers()
        for node in graph.nodes:
            for index, w in enumerate(node.inputs):
                if w is None or id(w) not in new:
                    continue
                g1 = ones[id(weights[id(w)][1])]
                if node.op in FUSED:
                    node.inputs[2] = g1
                else:
                    producers[id(node.inputs[0])].inputs[-1] = g1
                node.inputs[index] = new[id(w)]
    return len(new)
