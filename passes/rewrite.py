"""A tiny rewrite engine: rules declared as data, applied to a fixpoint, counted and explained.

A `Rule` names its rewrite ("Pow(x, 2) => Mul(x, x)"), the ops it anchors on, a `match` function
that returns either a `Match` (what to do) or a string saying why the candidate is declined, and
nothing else: the driver applies matches under one safety rule (a replaced value that is a graph
output keeps its name through an Identity) and keeps statistics for `-v` / `-vv`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from atlasc.ir.graph import Graph, Node, Value


@dataclass
class Match:
    """Replace `old` (an output of the anchor) by `new`, after inserting `new_nodes` before the anchor."""

    old: Value
    new: Value
    new_nodes: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class Rule:
    name: str
    ops: tuple[str, ...]
    match: Callable[[Graph, Node], Match | str]


@dataclass
class RewriteStats:
    applied: dict[str, int] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # "rule at node" -> reason (for -vv)


def _renames_an_io(graph: Graph, old: Value, new: Value) -> bool:
    """True when old is a graph output that new cannot stand in for (new is an input, constant or output)."""
    return any(o is old for o in graph.outputs) and (
        new.is_constant or any(i is new for i in graph.inputs) or any(o is new for o in graph.outputs))


def replace_value(graph: Graph, old: Value, new: Value) -> None:
    """Every reader of old reads new (a graph output's name moves to new)."""
    graph.replace_all_uses(old, new)


def apply_rules(graph: Graph, rules: list[Rule], stats: RewriteStats, max_rounds: int = 20) -> Graph:
    """Apply rules until none fires (or max_rounds); returns the cleaned, topologically sorted graph."""
    by_op: dict[str, list[Rule]] = {}
    for r in rules:
        for op in r.ops:
            by_op.setdefault(op, []).append(r)
    for _ in range(max_rounds):
        fired = False
        for node in list(graph.nodes):
            if node not in graph.nodes:
                continue
            for rule in by_op.get(node.op, ()):
                m = rule.match(graph, node)
                if not isinstance(m, str) and _renames_an_io(graph, m.old, m.new) and not m.new_nodes:
                    m = "its output is a graph output fed directly by an input, constant or other output"
                if isinstance(m, str):
                    stats.declined[f"{rule.name} at {node.name}"] = m
                    continue
                idx = graph.nodes.index(node)
                graph.nodes[idx:idx] = m.new_nodes
                replace_value(graph, m.old, m.new)
                stats.applied[rule.name] = stats.applied.get(rule.name, 0) + 1
                fired = True
                break
        graph.cleanup()
        if not fired:
            break
    return graph.toposort()
