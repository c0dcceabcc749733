"""simplify-decode-mask: the decode step's attention mask made from attention_mask by one elementwise kernel.

At decode the query is the last position, so every cached key is at or before it and the causal part
of the mask allows everything; what is left is the padding: m[b, 0, 0, j] = 0 where attention_mask[b, j]
is nonzero, else a fill (the dtype's lowest value or -inf; for a bool mask: True / False). Exports still
build the whole causal + padding machinery (ranges, index grids, GatherND, comparisons): ~10 kernels
of every decode step.

Matches an Attention of the `decode` entry whose mask input [B, 1, 1, T] is computed from the graph
input `attention_mask` [B, T] alone (and symbols): that slice is evaluated on random left-padded masks
at two symbol settings and must equal where(attention_mask != 0, 0, fill) bit for bit, for one fill in
FILLS. Rewrites the mask as Unsqueeze(Where(Equal(attention_mask, 0), fill, 0), [1, 2]) (bool masks:
Unsqueeze(Not(Equal(...)))): fuse-elementwise then makes it one kernel, dce drops the old slice. The
mask stays a materialized [B, 1, 1, T] tensor (a few bytes per key): the Attention kernels are the ones
GPU-validated with additive and bool masks.

Requires: entry-points and fuse-attention (the mask is the Attention's fourth input); runs before dce
and fuse-elementwise. Guarantees: the new mask equals the old one on every probe (bit for bit).
"""

from __future__ import annotations

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
from atlasc.ir.interpreter import interpret
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

MASK_INPUT = "attention_mask"
PROBE_SIZES = ((3, 5), (2, 9))  # (value of the first symbol, of the others): batch and past differ
RULE = "decode mask from attention_mask (ranges, GatherND, ...) => Where(attention_mask == 0, fill, 0)"


def _slice(graph: Graph, target: Value) -> tuple[list[Node], set[str]]:
    """The nodes target depends on (graph order) and the graph inputs they read."""
    producers = graph.producers()
    keep, inputs, stack = set(), set(), [target]
    input_names = {v.name for v in graph.inputs}
    while stack:
        v = stack.pop()
        n = producers.get(id(v))
        if n is None:
            if not v.is_constant and v.name in input_names:
                inputs.add(v.name)
            continue
        if id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(i for i in n.inputs if i is not None)
    return [n for n in graph.nodes if id(n) in keep], inputs


def mask_input(graph: Graph) -> Value | None:
    """The graph's attention_mask input when it is [batch, keys] of an integer or bool type, else None."""
    am = next((v for v in graph.inputs if v.name == MASK_INPUT), None)
    return am if am is not None and am.dtype in ("int64", "int32", "bool") and len(am.shape) == 2 else None


def mask_slice(graph: Graph, mask: Value) -> list[Node] | str:
    """The nodes (graph order) that compute mask from attention_mask alone, or why it is not so computed."""
    nodes, reads = _slice(graph, mask)
    if not nodes:
        return "the mask is a graph input"
    if reads != {MASK_INPUT}:
        return f"the mask reads {', '.join(sorted(reads - {MASK_INPUT})) or 'no input'}"
    return nodes


def _fills(dtype: str) -> list:
    if dtype == "bool":
        return [None]
    dt = to_numpy(dtype)
    return [dt.type(np.finfo(dt).min), dt.type(-np.inf)]


def _expected(am: np.ndarray, dtype: str, fill) -> np.ndarray:
    keep = am != 0
    if dtype == "bool":
        return keep[:, None, None, :]
    dt = to_numpy(dtype)
    return np.where(keep, dt.type(0), fill).astype(dt)[:, None, None, :]


def _probe(graph: Graph, am: Value, nodes: list[Node], mask: Value) -> object | str:
    """The fill that makes the slice equal where(am != 0, 0, fill) at every probe, or why none does."""
    syms = sorted(graph.symbols)
    candidates = _fills(mask.dtype)
    for sizes in PROBE_SIZES:
        env = {s: sizes[0] if i == 0 else sizes[1] + i for i, s in enumerate(syms)}
        sub = Graph("probe")
        sub.symbols = {s: SymbolInfo(0, None) for s in syms}
        sub.inputs, sub.nodes, sub.outputs = [am], nodes, [mask]
        rng = np.random.default_rng(11)
        shape = tuple(S.evaluate(d, env) for d in am.shape)
        feed = np.ones(shape, to_numpy(am.dtype))
        for b in range(shape[0]):  # left padding of every length, one row unpadded
            feed[b, : int(rng.integers(0, shape[1])) if b else 0] = 0
        try:
            got = interpret(sub, {am.name: feed}, symbols=env)[mask.name]
        except Exception:  # noqa: BLE001 - any failure means "not this pattern"
            return "the mask slice does not evaluate on its own"
        candidates = [f for f in candidates if got.shape == _expected(feed, mask.dtype, f).shape and
                      np.array_equal(got, _expected(feed, mask.dtype, f))]
        if not candidates:
            return "the mask is not where(attention_mask != 0, 0, fill) (a causal part, a window, or another fill)"
    return candidates[0]


def _why_not(graph: Graph, att: Node) -> str | tuple[Value, object, list[Node]]:
    mask = att.inputs[3] if len(att.inputs) > 3 else None
    if mask is None:
        return "no mask"
    if att.attrs.get("key_mask"):
        return "mask-as-lengths made the Attention read attention_mask itself"
    am = mask_input(graph)
    if am is None:
        return f"no [batch, keys] {MASK_INPUT} input"
    if len(mask.shape) != 4 or not all(S.dim(d) == S.dim(1) for d in mask.shape[1:3]):
        return "the mask is not [batch, 1, 1, keys]"
    if any(S.dim(a) != S.dim(b) for a, b in zip((mask.shape[0], mask.shape[3]), am.shape)):
        return f"the mask's batch and keys are not {MASK_INPUT}'s"
    nodes = mask_slice(graph, mask)
    if isinstance(nodes, str):
        return nodes
    fill = _probe(graph, am, nodes, mask)
    if isinstance(fill, str):
        return fill
    return am, fill, nodes


def _new_mask(graph: Graph, am: Value, mask: Value, fill) -> tuple[Value, list[Node]]:
    base = f"{mask.name}__from_{MASK_INPUT}"
    zero = constant(f"{base}.zero", np.zeros((), to_numpy(am.dtype)))
    is_pad = Value(f"{base}.pad", "bool", am.shape)
    nodes = [Node("Equal", [am, zero], [is_pad], {}, name=f"{base}.equal")]
    if mask.dtype == "bool":
        flat = Value(f"{base}.keep", "bool", am.shape)
        nodes.append(Node("Not", [is_pad], [flat], {}, name=f"{base}.not"))
    else:
        dt = to_numpy(mask.dtype)
        flat = Value(f"{base}.add", mask.dtype, am.shape)
        nodes.append(Node("Where", [is_pad, constant(f"{base}.fill", np.array(fill, dt)),
                                    constant(f"{base}.open", np.zeros((), dt))], [flat], {}, name=f"{base}.where"))
    out = Value(base, mask.dtype, mask.shape)
    nodes.append(Node("Unsqueeze", [flat], [out], {"axes": (1, 2)}, name=f"{base}.unsqueeze"))
    return out, nodes


def simplify_graph(graph: Graph, stats: RewriteStats) -> None:
    done: dict[int, Value] = {}
    for att in [n for n in graph.nodes if n.op == "Attention"]:
        mask = att.inputs[3] if len(att.inputs) > 3 else None
        if mask is not None and id(mask) in done:
            att.inputs[3] = done[id(mask)]
            continue
        found = _why_not(graph, att)
        if isinstance(found, str):
            stats.declined[f"{RULE} at {att.name}"] = found
            continue
        am, fill, _ = found
        new, nodes = _new_mask(graph, am, mask, fill)
        graph.nodes[graph.nodes.index(att):graph.nodes.index(att)] = nodes
        done[id(mask)] = new
        att.inputs[3] = new
        stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
    graph.toposort()


def simplify_decode_mask(program: Program) -> tuple[Program, RewriteStats]:
    """Rebuild the decode entry's attention masks from attention_mask (a no-op with fusion off)."""
    stats = RewriteStats()
    if program.options.fusion and program.kind == "decoder" and "decode" in program.entries:
        simplify_graph(program.entries["decode"], stats)
    return program, stats
