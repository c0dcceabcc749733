"""fuse-rotary: merged QKV projection -> heads -> rotary -> KV-cache append  =>  one `QKVRotary` node.

Matches, anchored on an `Attention` whose K and V are `KVAppend` outputs of one layer (after
entry-points, merge-linear and fuse-attention):

    X = [B, S, (Hq + 2 Hk) * D]                  (the merged QKV projection's output)
    q' = f_q(X, cos, sin), k' = f_k(X, cos, sin), v' = f_v(X)
                                                 (Split/Slice, Reshape, Transpose, Neg, Concat, Mul, Add,
                                                  FusedElementwise ...: any spelling of rotate-half rotary)
    present_k = KVAppend(k'), present_v = KVAppend(v'), Attention(q', present_k, present_v, ...)
    =>
    q', present_k, present_v = QKVRotary(X, cos, sin){q_heads, kv_heads, head_dim, layer, past}

The region between X and the three values is found by walking forward from X through elementwise and
movement ops; its only other non-constant inputs must be two tensors that reshape to [B or 1, S, R]
(cos and sin; Unsqueeze/Reshape chains above them are walked back). It is accepted when evaluating it
on random X, cos and sin at two symbol settings equals QKVRotary's reference (either assignment of
the two tensors to cos and sin is tried). The opset-23 `RotaryEmbedding` op takes half-width tables
[.., R/2]: those are tried as cos = concat(c, c), and the fused node reads such a concatenation
(one small node per step, shared by the layers). A region with no other input at all (GPT-2: no
rotary) becomes QKVRotary(X) without tables when it is the plain split into heads. The Split,
transposes, rotary arithmetic and both KVAppend kernels then become one kernel that reads X once.

Requires: entry-points, fuse-attention. Guarantees: outputs equal the decomposed graph's within float
rounding (bit-identical when the export rotates in its own dtype, as Hugging Face exports do).
"""

from __future__ import annotations

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value
from atlasc.ir.interpreter import interpret
from atlasc.ir.ops.kvcache import rotate_half
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

MOVEMENT = {"Reshape", "Transpose", "Split", "Slice", "Unsqueeze", "Squeeze", "Identity", "Flatten"}
REGION_OPS = MOVEMENT | {"Neg", "Concat", "Mul", "Add", "Sub", "FusedElementwise", "RotaryEmbedding"}
PROBE_SIZES = ((2, 3, 5, 7), (3, 5, 2, 11))


def _source_of_v(value: Value, producers, width: int) -> Value | None:
    """The projection output X above V's new values: the highest [B, S, width] value reached by
    walking up movement ops (GPT-2 reshapes a 2-D Gemm output to [B, S, 3 * H * D] first)."""
    found = None
    while True:
        if len(value.shape) == 3 and value.shape[2] == width:
            found = value
        node = producers.get(id(value))
        if node is None or node.op not in MOVEMENT:
            return found
        value = node.inputs[0]


def _region(graph: Graph, x: Value, targets: list[Value]) -> list[Node] | str:
    """Nodes on paths from x to the targets (region ops only), in graph order."""
    users: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None:
                users.setdefault(id(v), []).append(n)
    target_ids = {id(t) for t in targets}
    forward, stack = set(), [x]
    while stack:
        v = stack.pop()
        if id(v) in target_ids:
            continue
        for n in users.get(id(v), ()):
            if n.op in REGION_OPS and id(n) not in forward:
                forward.add(id(n))
                stack.extend(n.outputs)
    producers = graph.producers()
    keep, stack = set(), list(targets)
    while stack:
        v = stack.pop()
        n = producers.get(id(v))
        if n is None or id(n) not in forward or id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(i for i in n.inputs if i is not None)
    for t in targets:
        n = producers.get(id(t))
        if n is None or id(n) not in keep:
            return f"{t.name} is not computed from {x.name} by movement and rotary arithmetic"
    return [n for n in graph.nodes if id(n) in keep]


def _rank3_source(value: Value, producers, batch, seq) -> tuple[Value, list[Node]] | None:
    """value, or an Unsqueeze/Reshape ancestor of it shaped [batch or 1, seq, R] (same element order)."""
    chain = []
    while True:
        shape = value.shape
        if len(shape) == 3 and shape[0] in (1, batch) and shape[1] == seq and isinstance(shape[2], int):
            return value, list(reversed(chain))
        node = producers.get(id(value))
        if node is None or node.op not in ("Unsqueeze", "Squeeze", "Reshape", "Identity"):
            return None
        chain.append(node)
        value = node.inputs[0]


def _expected(x, cos, sin, hq, hk, d, half=False):
    if half:
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    b, s, _ = x.shape
    heads = x.reshape(b, s, hq + 2 * hk, d).transpose(0, 2, 1, 3)
    r = cos.shape[-1]
    c = np.broadcast_to(cos, (b, s, r))[:, None]
    sn = np.broadcast_to(sin, (b, s, r))[:, None]
    return rotate_half(heads[:, :hq], c, sn), rotate_half(heads[:, hq:hq + hk], c, sn), heads[:, hq + hk:]


def _probe(graph: Graph, x: Value, cos: Value | None, sin: Value | None, nodes: list[Node], outs: list[Value],
           hq: int, hk: int, d: int, half: bool = False) -> bool:
    """Does the region compute QKVRotary's q, k, v (before the appends) at two symbol settings?"""
    syms = sorted(graph.symbols)
    for sizes in PROBE_SIZES:
        env = {s: sizes[i % len(sizes)] + 4 * (i // len(sizes)) for i, s in enumerate(syms)}
        sub = Graph("probe")
        sub.symbols = {s: SymbolInfo(0, None) for s in syms}
        sub.inputs = [v for v in (x, cos, sin) if v is not None]
        sub.nodes = nodes
        sub.outputs = outs
        rng = np.random.default_rng(7)
        feeds = {}
        for v in sub.inputs:
            shape = tuple(S.evaluate(dd, env) for dd in v.shape)
            feeds[v.name] = rng.uniform(-1, 1, shape).astype(v.dtype)
        try:
            got = interpret(sub, feeds, symbols=env)
        except Exception:  # noqa: BLE001 - any failure means "not this pattern"
            return False
        if cos is None:  # no rotary: an empty table rotates nothing
            empty = np.zeros((1, feeds[x.name].shape[1], 0), feeds[x.name].dtype)
            want = _expected(feeds[x.name], empty, empty, hq, hk, d)
        else:
            want = _expected(feeds[x.name], feeds[cos.name], feeds[sin.name], hq, hk, d, half)
        for o, w in zip(outs, want):
            y = got[o.name]
            if y.shape != w.shape or not np.allclose(y.astype(np.float64), w.astype(np.float64),
                                                     rtol=1e-2, atol=1e-2):
                return False
    return True


def _match(graph: Graph, att: Node):
    """Anchor: Attention(q', KVAppend(k'), KVAppend(v'), ...). Returns (new node, replaced nodes) or why not."""
    producers = graph.producers()
    q_val, k_val, v_val = att.inputs[:3]
    pk, pv = producers.get(id(k_val)), producers.get(id(v_val))
    if pk is None or pv is None or pk.op != "KVAppend" or pv.op != "KVAppend":
        return "K and V are not KV-cache appends"
    if (pk.attrs["kind"], pv.attrs["kind"]) != ("key", "value") or pk.attrs["layer"] != pv.attrs["layer"] \
            or S.dim(pk.attrs["past"]) != S.dim(pv.attrs["past"]):
        return "the appends are not one layer's key and value"
    if len(q_val.shape) != 4:
        return "q is not [B, H, S, D]"
    k_new, v_new = pk.inputs[0], pv.inputs[0]
    hq, hk, d = q_val.shape[1], k_new.shape[1], q_val.shape[3]
    if not all(isinstance(i, int) for i in (hq, hk, d)) or v_new.shape[1] != hk or v_new.shape[3] != d:
        return "head counts or head dims are not static and consistent"
    x = _source_of_v(v_new, producers, (hq + 2 * hk) * d)
    if x is None or x.dtype != q_val.dtype:
        return f"V does not come from one merged [B, S, ({hq} + 2*{hk}) * {d}] projection"
    batch, seq = x.shape[0], x.shape[1]
    targets = [q_val, k_new, v_new]
    region = _region(graph, x, targets)
    if isinstance(region, str):
        return region
    inside = {id(o) for n in region for o in n.outputs}
    leaves = []
    for n in region:
        for v in n.inputs:
            if v is None or v is x or v.is_constant or id(v) in inside or any(v is u for u in leaves):
                continue
            leaves.append(v)
    if not leaves:  # no rotary (GPT-2): the split into heads and the cache appends alone
        if not _probe(graph, x, None, None, region, targets, hq, hk, d):
            return "the region does not split the projection into q, k and v heads"
        return _fused(x, [x], q_val, pk, pv, k_val, v_val, hq, hk, d)
    if len(leaves) != 2:
        return f"the rotary reads {len(leaves)} tensors besides the projection (want cos and sin)"
    found = [_rank3_source(v, producers, batch, seq) for v in leaves]
    if any(f is None for f in found):
        return "cos/sin do not reshape to [batch or 1, seq, rotary_dim]"
    (a, chain_a), (b, chain_b) = found
    if a.dtype != x.dtype or b.dtype != x.dtype or a.shape[2] != b.shape[2] or a.shape[2] > d:
        return "cos/sin dtype or width do not fit the heads"
    nodes = [n for n in graph.nodes if any(n is m for m in chain_a + chain_b + region)]
    widths = [False] + ([True] if 2 * a.shape[2] <= d else [])  # full tables, or RotaryEmbedding's halves
    match = next(((cos, sin, half) for half in widths for cos, sin in ((a, b), (b, a))
                  if (half or a.shape[2] % 2 == 0) and _probe(graph, x, cos, sin, nodes, targets, hq, hk, d, half)),
                 None)
    if match is None:
        return "the region does not compute rotate-half rotary of q and k"
    cos, sin, half = match
    if half:
        cos, sin = (_doubled(graph, t) for t in (cos, sin))
    return _fused(x, [x, cos, sin], q_val, pk, pv, k_val, v_val, hq, hk, d)


def _fused(x, inputs, q_val, pk, pv, k_val, v_val, hq, hk, d):
    q_new = Value(q_val.name + "__rot", q_val.dtype, q_val.shape)
    attrs = {"q_heads": hq, "kv_heads": hk, "head_dim": d, "layer": pk.attrs["layer"], "past": pk.attrs["past"]}
    fused = Node("QKVRotary", inputs, [q_new, k_val, v_val], attrs, name=f"qkv_rotary:{q_val.name}")
    return fused, q_val, (pk, pv)


def _doubled(graph: Graph, t: Value) -> Value:
    """concat(t, t) along the last axis (made once per table and graph, after t's producer)."""
    name = t.name + "__x2"
    for n in graph.nodes:
        if n.outputs and n.outputs[0].name == name:
            return n.outputs[0]
    out = Value(name, t.dtype, (*t.shape[:-1], 2 * t.shape[-1]))
    producer = graph.producers().get(id(t))
    at = graph.nodes.index(producer) + 1 if producer is not None else 0
    graph.nodes.insert(at, Node("Concat", [t, t], [out], {"axis": -1}, name=f"rotary_table:{t.name}"))
    return out


def fuse_rotary(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse every layer's QKV split + rotary + cache append (a no-op with fusion disabled)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    rule = "QKV -> heads -> rotary -> KVAppend x2 => QKVRotary"
    for graph in program.entries.values():
        for att in [n for n in graph.nodes if n.op == "Attention"]:
            m = _match(graph, att)
            if isinstance(m, str):
                stats.declined[f"{rule} at {att.name}"] = m
                continue
            fused, q_old, appends = m
            graph.nodes = [n for n in graph.nodes if not any(n is a for a in appends)]
            graph.nodes.insert(graph.nodes.index(att), fused)
            graph.replace_all_uses(q_old, fused.outputs[0])
            stats.applied[rule] = stats.applied.get(rule, 0) + 1
        graph.cleanup()
        graph.toposort()
    return program, stats
