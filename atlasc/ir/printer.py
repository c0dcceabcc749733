"""A readable text form of a graph, one line per node (used by `--dump-ir` and error reports)."""

from __future__ import annotations

import numpy as np

from atlasc.ir import symbolic as S


def _attr_str(v) -> str:
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)}" if v.size > 4 else np.array2string(v.reshape(-1), separator=",")
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_attr_str(x) for x in v) + "]"
    return str(v)


def _val(v) -> str:
    if v is None:
        return "_"
    return f"%{v.name}"


def format_node(node) -> str:
    outs = ", ".join(f"%{o.name}: {o.dtype}{S.shape_str(o.shape)}" for o in node.outputs)
    attrs = ", ".join(f"{k}={_attr_str(v)}" for k, v in sorted(node.attrs.items()))
    args = ", ".join(_val(i) for i in node.inputs)
    return f"{outs} = {node.op}({args}){' {' + attrs + '}' if attrs else ''}"


def format_graph(graph, mark=None, note: str = "") -> str:
    """The whole graph as text; the node `mark` (if given) is flagged with `note`."""
    lines = [f"graph {graph.name}("]
    for v in graph.inputs:
        lines.append(f"    %{v.name}: {v.dtype}{S.shape_str(v.shape)},")
    lines.append(")")
    if graph.symbols:
        lines.append("  symbols: " + ", ".join(
            f"{k} in [{i.lower}, {'?' if i.upper is None else i.upper}]" for k, i in graph.symbols.items()))
    for c in graph.constants():
        lines.append(f"  const %{c.name}: {c.dtype}{S.shape_str(c.shape)}")
    for n in graph.nodes:
        prefix = ">>> " if n is mark else "  "
        lines.append(prefix + format_node(n) + (f"    <-- {note}" if n is mark and note else ""))
    lines.append("  return " + ", ".join(_val(o) for o in graph.outputs))
    return "\n".join(lines)
