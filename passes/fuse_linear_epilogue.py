"""fuse-linear-epilogue: at up to 32 rows, the only reader of a float16 Linear runs inside the Linear's kernel.

Matches, where the Linear's rows (its input's leading dims) are at most EPILOGUE_MAX_M at run time (linear.cu's
decode paths: the decode entry of batch 9..32, whose rows are more than a prologue may stage; also a prefill whose
batch x seq cannot exceed 32) and fuse-linear-prologue left the Linear alone:

    z = Linear(x, w[, bias]); y = FusedElementwise(z[.., :H], z[.., H:])  =>  y = LinearGated(x, w[, bias])
    z = Linear(x, w[, bias]); q, pk, pv = QKVRotary(z[, cos, sin])  =>  q, pk, pv = LinearRotary(x, cos, sin, w[, bias])

(the gated form: an elementwise program over the two halves of the Linear's output of its dtype, SwiGLU on the
merged gate/up projection; the rotary form: the merged QKV projection, the rotary and the KV-cache append). The
kernel computes each output pair once and writes what the epilogue makes of it (linear.cu LinGated / LinRotary,
the epilogues NormLinear uses at up to 8 rows): the projection's output is never stored and one launch less per
layer. A Llama decode layer at batch 9..32 becomes 7 kernels: AddRMSNormalization, LinearRotary, Attention,
Linear (o), AddRMSNormalization, LinearGated, Linear (down) (in an sm90-only compile fuse-linear-prologue has
already fused the second norm into the gate/up projection: 6, ATLAS_TMA_NORM). H200, 8 layers
of Llama-3-8B shapes at batch 32 (docs/perf.md v29): QKV + QKVRotary 25.3-25.7 + 11.0-11.3 us -> LinearRotary
28.5-28.9 us, gate/up + SwiGLU 87.4-88.0 + 6.2 us -> LinearGated 85.2-86.6 us; the decode step replayed
2001.7 -> 1869.3 us.

Only float16 projections on sm80+ (the paired MMA decode; its GEMV fallback, for x rows the MMA cannot read, runs one
row at a time: linear_epilogue.py). ATLAS_LINEAR_EPILOGUE=0 turns the pass off (A/B timing); quantized projections
keep their epilogues separate.
Requires: fuse-linear-prologue (it runs after it: where a prologue fused, the epilogue went with it).
Guarantees: the reference of a fused op is the composition of the two it replaced (bit-identical on the CPU);
graph outputs keep their names.
"""

from __future__ import annotations

from atlasc.errors import env_switch
from atlasc.ir.archs import min_arch
from atlasc.ir.graph import Graph, Node
from atlasc.ir.ops.epilogue import EPILOGUE_MAX_M
from atlasc.ir.program import Program
from atlasc.passes.fuse_linear_prologue import gated_epilogue, rotary_epilogue, rows_upper
from atlasc.passes.rewrite import RewriteStats

ENV = "ATLAS_LINEAR_EPILOGUE"
GATED_RULE = "FusedElementwise(z[.., :H], z[.., H:]) of z = Linear(..) => LinearGated(..)"
ROTARY_RULE = "QKVRotary(Linear(..)) => LinearRotary(..)"


def epilogue_enabled() -> bool:
    """ATLAS_LINEAR_EPILOGUE (default 1); UsageError (exit 2) unless 0 or 1."""
    return env_switch(ENV, True)


def _why_not(lin: Node, upper: dict[str, int], archs: tuple[str, ...]) -> str | None:
    x, w = lin.inputs[0], lin.inputs[1]
    if x.dtype != "float16" or not w.is_constant or w.dtype != x.dtype:
        return "not a float16 input with a constant float16 weight (the paired MMA decode's)"
    if archs and min_arch(archs) < 80:
        return "an arch below sm80 (no MMA decode: the paired GEMV would read the weights once per row)"
    rows = rows_upper(x, upper)
    if rows is None or rows > EPILOGUE_MAX_M:
        return f"its rows may exceed {EPILOGUE_MAX_M} (prefill: the tiled paths have no epilogue)"
    return None


def _fused(graph: Graph, lin: Node) -> tuple[Node, Node, str] | None:
    """(the fused node, the reader it absorbed, the rule), or None when the reader is neither form."""
    rest = list(lin.inputs[1:])  # w[, bias]
    rot = rotary_epilogue(graph, lin)
    if rot is not None:
        cos, sin = (rot.inputs[1], rot.inputs[2]) if len(rot.inputs) > 1 else (None, None)
        attrs = {k: rot.attrs[k] for k in ("q_heads", "kv_heads", "head_dim", "layer", "past")}
        node = Node("LinearRotary", [lin.inputs[0], cos, sin, *rest], list(rot.outputs), attrs,
                    name=f"linear_rotary:{lin.name}")
        return node, rot, ROTARY_RULE
    epi = gated_epilogue(graph, lin)
    if epi is not None:
        attrs = {"epilogue": epi[0].attrs["program"], "gate_input": epi[1]}
        node = Node("LinearGated", [lin.inputs[0], *rest], list(epi[0].outputs), attrs,
                    name=f"linear_gated:{lin.name}")
        return node, epi[0], GATED_RULE
    return None


def fuse_graph(graph: Graph, upper: dict[str, int], stats: RewriteStats, archs: tuple[str, ...] = ()) -> None:
    """Fuse each decode Linear's gated or rotary reader into it (see the module docstring)."""
    for lin in [n for n in graph.nodes if n.op == "Linear"]:
        found = _fused(graph, lin)
        if found is None:
            continue
        fused, reader, rule = found
        why = _why_not(lin, upper, archs)
        if why:
            stats.declined[f"{rule} at {lin.name}"] = why
            continue
        graph.nodes[graph.nodes.index(reader)] = fused  # after cos / sin and the Linear's input
        graph.nodes.remove(lin)
        stats.applied[rule] = stats.applied.get(rule, 0) + 1
    graph.cleanup()
    graph.toposort()


def fuse_linear_epilogue(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse each decode Linear's only reader into it as an epilogue (a no-op with fusion off or
    ATLAS_LINEAR_EPILOGUE=0)."""
    stats = RewriteStats()
    enabled = epilogue_enabled()  # a bad value is an error with fusion off too
    if program.options.fusion and enabled:
        for entry, graph in program.entries.items():
            fuse_graph(graph, program.bounds.get(entry, {}), stats, program.options.archs)
    return program, stats
