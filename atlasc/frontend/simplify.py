"""Graph clean-up after import: common-subexpression elimination and dead-code elimination."""

from __future__ import annotations

import numpy as np

from atlasc.ir.graph import Graph


def _attr_key(v):
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (tuple, list)):
        return tuple(_attr_key(x) for x in v)
    return (type(v).__name__, v)


SMALL_CONSTANT_BYTES = 1 << 16  # constants up to this size are deduplicated by content


def cse(graph: Graph) -> Graph:
    """Merge nodes with the same op, inputs and attributes, and equal small constants.

    Guarantees: the graph computes the same outputs; graph outputs keep their names.
    """
    const_seen: dict = {}
    const_map: dict[int, object] = {}
    for c in graph.constants():
        if c.data.nbytes <= SMALL_CONSTANT_BYTES:
            key = (c.data.dtype.str, c.data.shape, c.data.tobytes())
            const_map[id(c)] = const_seen.setdefault(key, c)
    seen: dict = {}
    replace: dict[int, object] = {}
    keep = []
    for n in graph.nodes:
        n.inputs = [None if i is None else replace.get(id(i), const_map.get(id(i), i)) for i in n.inputs]
        key = (n.op, tuple(id(i) if i is not None else None for i in n.inputs), len(n.outputs),
               tuple(sorted((k, _attr_key(v)) for k, v in n.attrs.items())))
        prev = seen.get(key)
        if prev is None:
            seen[key] = n
            keep.append(n)
            continue
        for old, new in zip(n.outputs, prev.outputs):
            replace[id(old)] = new
    graph.nodes = keep
    outputs = []
    for o in graph.outputs:
        new = replace.get(id(o))
        if new is None:
            outputs.append(o)
            continue
        # keep the public output name: route it through an Identity
        from atlasc.ir.graph import Node

        graph.nodes.append(Node("Identity", [new], [o]))
        outputs.append(o)
    graph.outputs = outputs
    return graph.toposort().cleanup()
