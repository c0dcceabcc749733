"""schedule: fix each entry's execution order.

Matches: every entry. Produces: nodes in a topological order that keeps the existing order where it
is valid (the exporter's order, which already keeps a layer's tensors close together), so a node's
position is its step in the launch schedule. Guarantees: every value is defined before it is read;
the order is deterministic.
"""

from __future__ import annotations

from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats


def schedule(program: Program) -> tuple[Program, RewriteStats]:
    stats = RewriteStats()
    for name, graph in program.entries.items():
        graph.toposort()
        stats.applied[f"{name}: steps"] = len(graph.nodes)
    return program, stats
