"""choose-decode-path: whether a quantized decode projection takes its activations as int8.

Matches every LinearQ4 / LinearQ8 (alone, or inside NormLinearQ / NormLinearRotary) whose rows are at
most 8 at run time (decode) and whose K and group size fit the dp4a kernels (atlasc/ir/ops/quant.py:
act8_why_not). With ATLAS_INT4_PATH=w4a8 (int4) or ATLAS_INT8_PATH=w8a8 (int8) such a node gets
act = "int8": its kernel quantizes x per row to int8 in shared memory and accumulates dp4a products in
int32 (codegen/act_int8.cu; references in atlasc/ir/ops/quant.py). The defaults, w4a16 and w8a16, leave
the nodes as they are (float activations: quant.cu's tensor-core path). The int8 activations are not
the default: their kernels have not yet run on a GPU (no table of measured paths per arch and batch
bucket exists yet), and they add the error of quantizing activations (the compile's accuracy report
measures it on a decode step per calibration prompt: atlasc/accuracy.py decode_act_report).

Requires: fuse-linear-prologue (it runs after it, on the fused nodes). Guarantees: only the attribute
`act` changes, and the node's reference then computes the int8-activation result; the choice is in the
artifact's IR.
"""

from __future__ import annotations

import os

from atlasc.errors import UsageError
from atlasc.ir.graph import Graph, Node
from atlasc.ir.ops.prologue import PROLOGUE_SMEM_BYTES, staging_bytes
from atlasc.ir.ops.quant import act8_why_not
from atlasc.passes.fuse_linear_prologue import rows_upper
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

# op -> (environment variable, its values: float activations first, then int8 ones)
PATHS = {"LinearQ4": ("ATLAS_INT4_PATH", ("w4a16", "w4a8")), "LinearQ8": ("ATLAS_INT8_PATH", ("w8a16", "w8a8"))}
RULES = {"LinearQ4": "LinearQ4 (decode) => act int8 (W4A8, dp4a)",
         "LinearQ8": "LinearQ8 (decode) => act int8 (W8A8, dp4a)"}


def path_choice(op: str) -> str:
    """The path chosen for op's decode nodes (default: float activations); UsageError for an unknown value."""
    env, values = PATHS[op]
    path = os.environ.get(env, "") or values[0]
    if path not in values:
        raise UsageError(f"{env}={path!r} is not a decode path (expected one of: {', '.join(values)})")
    return path


def _projection(node: Node) -> str | None:
    """LinearQ4 / LinearQ8 when the node computes one of them (fused or not), else None."""
    op = node.attrs.get("linear", node.op) if node.op in ("NormLinearQ", "NormLinearRotary") else node.op
    return op if op in PATHS else None


def choose_graph(graph: Graph, upper: dict[str, int], int8_ops: set[str], stats: RewriteStats) -> None:
    for node in graph.nodes:
        op = _projection(node)
        if op not in int8_ops:
            continue
        x = node.inputs[0]
        rows = rows_upper(x, upper)
        group = int(node.attrs.get("group_size", 0))
        why = "its rows have no upper bound" if rows is None else act8_why_not(4 if op == "LinearQ4" else 8,
                                                                              group, x.shape[-1], rows)
        if not why:  # every block keeps the int8 rows (and a fused norm's staged rows) in shared memory
            smem = rows * x.shape[-1] + (staging_bytes(rows, x.shape[-1], x.dtype) if node.op != op else 0)
            if smem > PROLOGUE_SMEM_BYTES:
                why = f"its rows need {smem // 1024} KB of shared memory (at most {PROLOGUE_SMEM_BYTES // 1024} KB)"
        if why:
            stats.declined[f"{RULES[op]} at {node.name}"] = why
            continue
        node.attrs["act"] = "int8"
        stats.applied[RULES[op]] = stats.applied.get(RULES[op], 0) + 1


def choose_decode_path(program: Program) -> tuple[Program, RewriteStats]:
    """Mark decode int4 / int8 projections for int8 activations as ATLAS_INT4_PATH / ATLAS_INT8_PATH say."""
    stats = RewriteStats()
    int8_ops = {op for op, (_, values) in PATHS.items() if path_choice(op) == values[1]}
    if int8_ops:
        for entry, graph in program.entries.items():
            choose_graph(graph, program.bounds.get(entry, {}), int8_ops, stats)
    return program, stats
