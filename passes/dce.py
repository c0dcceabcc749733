"""dce: dead-code elimination.

Matches: nodes none of whose outputs reach a graph output.
Guarantees: graph outputs and stateful nodes (KV-cache writes) are kept; the graph verifies.
"""

from __future__ import annotations

from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats


def dce(program: Program) -> tuple[Program, RewriteStats]:
    """Remove dead nodes from every entry."""
    stats = RewriteStats()
    for graph in program.entries.values():
        before = len(graph.nodes)
        graph.cleanup()
        if before - len(graph.nodes):
            stats.applied["dead node => removed"] = before - len(graph.nodes)
    return program, stats
