"""fuse-attention: decomposed softmax attention => one `Attention` node (GQA, reads the KV cache).

Matches (every exporter spelling: the chains between the marked values are recognized by what they
compute, not by how they are written):

    Q' = chain_q(Q)          (scalar scales, reshapes/transposes that cancel)
    K' = chain_k(K)          (repeat_kv: Unsqueeze/Expand/Reshape, the transpose to [.., D, T], scales)
    V' = chain_v(V)          (repeat_kv)
    S  = MatMul(Q', K')  [* c]  [+ mask]
    P  = Softmax(S, axis=-1) [-> Where(IsNaN(P), 0, P)]     (cast to float32 and back allowed around it)
    O  = MatMul(P, V')
    =>
    O  = Attention(Q, K, V, mask){scale = c_q * c_k * c}    (kv head = head // (Hq / Hkv))

A chain is accepted when it is made only of movement ops and multiplications/divisions by scalar
constants, and when evaluating it on random data at two sets of symbol values equals the expected
function (c * repeat_kv(K)^T for K, c * Q for Q, repeat_kv(V) for V). The repeat_kv copies of the
cache then disappear: the fused kernel indexes the KV head directly. The mask subgraph stays as it is
(an additive [B, 1, S, T] tensor, small at decode). Then `Reshape(Transpose(O, 0 2 1 3), [B, S, H*D])`
becomes the attention's own output layout (`out_bshd`): the kernel writes [B, S, H*D] directly.

Requires: entry-points (K and V are then the KV-cache views), canonicalize. Guarantees: outputs
equal the decomposed graph's within float rounding (tests compare on every fixture).
"""

from __future__ import annotations

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value
from atlasc.ir.interpreter import interpret
from atlasc.ir.program import Program
from atlasc.passes.rewrite import Match, RewriteStats, Rule, apply_rules

CHAIN_OPS = {"Reshape", "Transpose", "Expand", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Mul", "Div"}
PROBE_SIZES = ((2, 3, 5, 7), (3, 5, 2, 11))  # symbol values of the two probes (distinct, so axes can't mix)


def _scalar_const(v: Value | None) -> bool:
    return v is not None and v.is_constant and v.data.size == 1


def _chain(graph: Graph, value: Value, producers) -> tuple[Value, list[Node]]:
    """Walk up single-input movement/scalar ops from value; return (source, nodes in order)."""
    nodes = []
    while True:
        node = producers.get(id(value))
        if node is None or node.op not in CHAIN_OPS:
            break
        if node.op in ("Mul", "Div"):
            a, b = node.inputs
            if not _scalar_const(b) or a.is_constant:
                break
        nodes.append(node)
        value = node.inputs[0]
    return value, list(reversed(nodes))


def _candidates(source: Value, nodes: list[Node]) -> list[tuple[Value, list[Node]]]:
    """Every 4-D value along a chain as a possible [B, H, S, D] source, the chain's start first."""
    out = []
    for i in range(len(nodes) + 1):
        src = source if i == 0 else nodes[i - 1].outputs[0]
        if len(src.shape) == 4:
            out.append((src, nodes[i:]))
    return out


def _probe(graph: Graph, source: Value, nodes: list[Node], out: Value, expected) -> float | None:
    """The constant c with chain(x) == c * expected(x) on random x at two symbol settings, else None."""
    syms = sorted(graph.symbols)
    c_seen = None
    for sizes in PROBE_SIZES:
        env = {s: sizes[i % len(sizes)] + 4 * (i // len(sizes)) for i, s in enumerate(syms)}
        sub = Graph("probe")
        sub.symbols = {s: SymbolInfo(0, None) for s in syms}  # probe sizes may exceed the compiled maxima
        sub.inputs = [source]
        sub.nodes = nodes
        sub.outputs = [out]
        shape = tuple(S.evaluate(d, env) for d in source.shape)
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32).astype(source.dtype)
        try:
            got = interpret(sub, {source.name: x}, symbols=env)
        except Exception:  # noqa: BLE001 - any failure means "not this pattern"
            return None
        y = got[out.name].astype(np.float64)
        e = expected(x.astype(np.float64))
        if y.shape != e.shape:
            return None
        k = int(np.argmax(np.abs(e)))
        if e.flat[k] == 0:
            return None
        c = y.flat[k] / e.flat[k]
        if not np.allclose(y, c * e, rtol=1e-2, atol=1e-3 * np.abs(e).max()):
            return None
        if c_seen is not None and not np.isclose(c, c_seen, rtol=1e-3):
            return None
        c_seen = c
    return c_seen


def _repeat(x, group):
    return np.repeat(x, group, axis=1)


def _skip_cast(value: Value, node: Node | None, producers) -> tuple[Value, Node | None]:
    """(value, its producer), stepping over one Cast (fp16 exports cast around the softmax)."""
    if node is not None and node.op == "Cast":
        value = node.inputs[0]
        node = producers.get(id(value))
    return value, node


def _match(graph: Graph, node: Node):
    """Anchor: O = MatMul(P, V'). Walk to the softmax, the scores and the three chains."""
    producers = graph.producers()
    p_val, v_prime = node.inputs
    p_node = producers.get(id(p_val))
    # optional nan guard Where(IsNaN(P), 0, P) and casts around the softmax
    if p_node is not None and p_node.op == "Where":
        cond = producers.get(id(p_node.inputs[0]))
        if cond is None or cond.op != "IsNaN" or cond.inputs[0] is not p_node.inputs[2]:
            return "Where before the MatMul is not a NaN guard"
        p_val = p_node.inputs[2]
        p_node = producers.get(id(p_val))
    p_val, p_node = _skip_cast(p_val, p_node, producers)
    if p_node is None or p_node.op != "Softmax":
        return "the left operand is not a softmax"
    if p_node.attrs["axis"] % len(p_val.shape) != len(p_val.shape) - 1:
        return "softmax is not over the last axis"
    s_val = p_node.inputs[0]
    s_val, s_node = _skip_cast(s_val, producers.get(id(s_val)), producers)
    mask = None
    if s_node is not None and s_node.op == "Add":
        a, b = s_node.inputs
        pa = producers.get(id(a))
        scores_first = pa is not None and (pa.op == "MatMul" or
                                           (pa.op in ("Mul", "Div") and _scalar_const(pa.inputs[1])))
        s_val, mask = (a, b) if scores_first else (b, a)
        s_node = producers.get(id(s_val))
    c_extra = 1.0
    if s_node is not None and s_node.op in ("Mul", "Div") and _scalar_const(s_node.inputs[1]):
        c = float(s_node.inputs[1].data.reshape(-1)[0])
        c_extra = c if s_node.op == "Mul" else 1.0 / c
        s_val = s_node.inputs[0]
        s_node = producers.get(id(s_val))
    if s_node is None or s_node.op != "MatMul":
        return "the scores are not a MatMul"
    q_prime, k_prime = s_node.inputs
    if len(q_prime.shape) != 4 or len(k_prime.shape) != 4 or len(v_prime.shape) != 4:
        return "not 4-D attention"
    chains = [_candidates(*_chain(graph, x, producers)) for x in (q_prime, k_prime, v_prime)]
    if not all(chains):
        return "a chain source is not [batch, heads, seq, head_dim]"
    found = None
    for q_src, q_nodes in chains[0]:  # the longest chains first; GPT-2's ends at its head transpose
        for k_src, k_nodes in chains[1]:
            hq, hk = q_src.shape[1], k_src.shape[1]
            if not isinstance(hq, int) or not isinstance(hk, int) or hq % hk:
                continue
            group = hq // hk
            cq = _probe(graph, q_src, q_nodes, q_prime, lambda x: x)
            ck = _probe(graph, k_src, k_nodes, k_prime, lambda x, g=group: np.swapaxes(_repeat(x, g), -1, -2))
            if cq is None or ck is None:
                continue
            for v_src, v_nodes in chains[2]:
                if v_src.shape[1] != hk:
                    continue
                cv = _probe(graph, v_src, v_nodes, v_prime, lambda x, g=group: _repeat(x, g))
                if cv is not None:
                    found = (q_src, k_src, v_src, cq, ck, cv)
                    break
            if found:
                break
        if found:
            break
    if found is None:
        return "the Q/K/V chains are not a repeat_kv/transpose/scale of [B, H, S, D] tensors"
    q_src, k_src, v_src, cq, ck, cv = found
    if not np.isclose(cv, 1.0, rtol=1e-3):
        return "V is scaled"
    d = q_src.shape[3]
    scale = float(cq * ck * c_extra)
    if mask is not None and mask.dtype not in ("float32", "float16", "bool"):
        return f"mask dtype {mask.dtype}"
    out = node.outputs[0]
    new = Value(out.name + "__attn", out.dtype, out.shape)
    inputs = [q_src, k_src, v_src] + ([mask] if mask is not None else [])
    if not isinstance(d, int):
        return "head_dim is not static"
    return Match(out, new, [Node("Attention", inputs, [new], {"scale": scale}, name=f"attention:{out.name}")])


def _match_bshd(graph: Graph, node: Node):
    """Anchor: Reshape(Transpose(Attention(...), perm 0 2 1 3), [B, S, H * Dv]) of a 4-D attention."""
    producers = graph.producers()
    tr = producers.get(id(node.inputs[0]))
    if tr is None or tr.op != "Transpose" or list(tr.attrs.get("perm") or ()) != [0, 2, 1, 3]:
        return "not a head transpose"
    att = producers.get(id(tr.inputs[0]))
    if att is None or att.op != "Attention" or len(att.inputs[0].shape) != 4 or att.attrs.get("out_bshd"):
        return "the transpose does not read a 4-D Attention"
    if len(graph.users(att.outputs[0])) != 1 or any(o is att.outputs[0] for o in graph.outputs) or \
            any(o is not None and (graph.users(o) or any(o is g for g in graph.outputs)) for o in att.outputs[1:]):
        return "the attention output has other readers"
    b, h, s, dv = att.outputs[0].shape
    out = node.outputs[0]
    if tuple(S.dim(d) for d in out.shape) != (S.dim(b), S.dim(s), S.mul(h, dv)):
        return "the reshape is not to [B, S, H * Dv]"
    new = Value(out.name + "__bshd", out.dtype, out.shape)
    attrs = {**att.attrs, "out_bshd": 1}
    return Match(out, new, [Node("Attention", list(att.inputs), [new], attrs, name=f"attention:{out.name}")])


RULES = [Rule("MatMul(Softmax(MatMul(Q, K^T) * c + mask), V) => Attention(Q, K, V, mask)", ("MatMul",), _match)]
LAYOUT_RULES = [Rule("Reshape(Transpose(Attention, 0 2 1 3), [B, S, H*D]) => Attention{out_bshd}", ("Reshape",),
                     _match_bshd)]


def fuse_attention(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse every decomposed attention of every entry (a no-op with fusion disabled)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    for name, graph in program.entries.items():
        program.entries[name] = apply_rules(apply_rules(graph, RULES, stats), LAYOUT_RULES, stats)
    return program, stats
