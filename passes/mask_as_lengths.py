"""mask-as-lengths: the Attention reads attention_mask [B, T] and applies causal / window itself.

On by default; ATLAS_MASK_LENGTHS=0 turns it off. The kernels' path (codegen/attention.cu and
flash_attention.cu, `KEYS`) passed its GPU tests on the H200 (docs/perf.md v10: kernel tests, and greedy
tokens equal to onnxruntime end to end). Without it, prefill attention reads a materialized mask element
by element (for each head: S x T values).

Matches an Attention (every entry: prefill, decode, an encoder's forward) whose mask input (a
materialized [B, 1, S, T] tensor, additive or bool) is computed from the graph input `attention_mask`
[B, T] alone (and symbols), without past inputs (K/V are the whole sequence, as the KV-cache views
of entry-points are):

    attention_mask ─> Range, LessOrEqual, GatherND, Where ... (~10-25 nodes) ─> mask ─> Attention(q, k, v, mask)
    =>
    attention_mask ─> Attention(q, k, v, attention_mask){key_mask=1, causal, window, mask_fill}

when the slice, evaluated on random left-padded masks at several symbol settings (one with T at the
compiled maximum, so a window up to max_seq shows), equals bit for bit

    mask[b, 0, s, t] = 0 (bool: True)  if attention_mask[b, t] != 0 and (not causal or t <= past + s)
                                          and (window == 0 or past + s - t < window)
                       mask_fill (bool: False, fill -inf)  otherwise,          past = T - S,

for one (causal, window, fill) among: causal or not, no window or the window seen on the longest
probe, fill the mask dtype's lowest value or -inf. Keys outside the mask keep the export's fill, so
a query row whose every key is masked (left padding in prefill) computes what it computed before.
Windows at least max_seq long cannot be told from none and are recorded as none (equal within the
compiled bounds). dce then drops the dead mask slice; simplify-decode-mask skips rewritten nodes.

Requires: entry-points, fuse-attention (the mask is the Attention's fourth input); runs before
simplify-decode-mask and dce. Guarantees: the Attention's bias (reference: key_mask_visible in
atlasc/ir/ops/nn.py) equals the old mask's on every probe, bit for bit; a mask that is anything else
(an extra term, another fill, per-head values) is declined with the reason (-vv).
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import env_switch
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value
from atlasc.ir.interpreter import interpret
from atlasc.ir.ops.nn import key_mask_visible
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats
from atlasc.passes.simplify_decode_mask import MASK_INPUT, mask_input, mask_slice

ENV = "ATLAS_MASK_LENGTHS"
RULE = "mask from attention_mask (causal + padding [+ window]) => Attention(attention_mask){key_mask}"
# (batch, seq, past) of the probes; seq is ignored where the entry fixes it (decode: 1); one more probe
# at the compiled maximum is added per entry
PROBES = ((3, 5, 4), (2, 6, 0), (2, 3, 9))


def enabled() -> bool:
    """ATLAS_MASK_LENGTHS (default 1); UsageError (exit 2) for a value other than 0 / 1."""
    return env_switch(ENV, True)


def _fills(dtype: str) -> list[float]:
    if dtype == "bool":
        return [float("-inf")]
    return [float(np.finfo(to_numpy(dtype)).min), float("-inf")]


def _closed_form(am: np.ndarray, sq: int, dtype: str, causal: int, window: int, fill: float) -> np.ndarray:
    keep = key_mask_visible(am, sq, am.shape[1], causal, window)[:, None]  # [B, 1, S, T]
    if dtype == "bool":
        return keep
    dt = to_numpy(dtype)
    return np.where(keep, dt.type(0), dt.type(fill)).astype(dt)


def _envs(graph: Graph, roles: dict, bounds: dict) -> list[dict[str, int]]:
    """Symbol values of the probes by role; the last puts T at its compiled maximum."""
    batch, seq, past = roles.get("batch"), roles.get("seq"), roles.get("past")
    syms = sorted(graph.symbols)
    upper = {s: bounds.get(s) for s in syms}
    envs = []
    for b, s, p in PROBES:
        env = {x: 7 + i for i, x in enumerate(syms)}
        env.update({k: v for k, v in ((batch, b), (seq, s), (past, p)) if k in graph.symbols})
        envs.append(env)
    env = {x: 7 + i for i, x in enumerate(syms)} | ({batch: 2} if batch in graph.symbols else {})
    if past in graph.symbols and upper.get(past):  # a decoder: few queries, T = max_seq
        s = 2 if seq in graph.symbols else 1
        env.update({past: upper[past] + 1 - s} | ({seq: s} if seq in graph.symbols else {}))
    elif seq in graph.symbols and upper.get(seq):  # an encoder: S = T, at most 512 (a [B, 1, S, S] probe)
        env[seq] = min(upper[seq], 512)
    envs.append(env)
    return envs


def _feed(shape: tuple[int, int], dtype: str, seed: int) -> np.ndarray:
    """Left padding of random lengths; row 0 unpadded, the last row fully padded (when B > 2)."""
    rng = np.random.default_rng(seed)
    am = np.ones(shape, to_numpy(dtype))
    for b in range(1, shape[0]):
        am[b, : shape[1] if b == 2 else int(rng.integers(1, shape[1] + 1))] = 0
    return am


def _probe(graph: Graph, roles: dict, bounds: dict, am: Value, nodes: list[Node], mask: Value,
           sq_dim) -> tuple[int, int, float] | str:
    """(causal, window, fill) of the closed form the slice equals on every probe, or why none does."""
    results = []
    for n, env in enumerate(_envs(graph, roles, bounds)):
        sub = Graph("probe")
        sub.symbols = {s: SymbolInfo(0, None) for s in graph.symbols}
        sub.inputs, sub.nodes, sub.outputs = [am], nodes, [mask]
        feed = _feed(tuple(S.evaluate(d, env) for d in am.shape), am.dtype, 17 + n)
        try:
            got = interpret(sub, {am.name: feed}, symbols=env)[mask.name]
        except Exception:  # noqa: BLE001 - any failure means "not this pattern"
            return "the mask slice does not evaluate on its own"
        results.append((feed, S.evaluate(sq_dim, env), got))
    feed, sq, got = results[-1]  # the longest probe: row 0 unpadded, its last query sees the window
    last = got[0, 0, -1] if got.ndim == 4 and got.shape[2] >= 1 else None
    windows = [0]
    if last is not None:
        seen = int(np.count_nonzero(last)) if mask.dtype == "bool" else int(np.count_nonzero(last == 0))
        if 0 < seen < feed.shape[1]:
            windows.append(seen)
    for causal in (1, 0):
        for window in windows:
            for fill in _fills(mask.dtype):
                if all(g.shape == (f.shape[0], 1, s, f.shape[1]) and
                       np.array_equal(g, _closed_form(f, s, mask.dtype, causal, window, fill))
                       for f, s, g in results):
                    return causal, window, fill
    return ("the mask is not causal/padding/window of attention_mask with one fill "
            "(an extra term, another fill, or positions not T - S + s)")


def _why_not(graph: Graph, roles: dict, bounds: dict, att: Node) -> str | tuple[Value, int, int, float]:
    mask = att.inputs[3] if len(att.inputs) > 3 else None
    if mask is None:
        return "no mask"
    if att.attrs.get("key_mask"):
        return "already reads attention_mask"
    if len(att.inputs) > 4:
        return "past inputs (K/V are not the whole sequence)"
    if att.attrs.get("is_causal") or (att.attrs.get("softcap") or 0) > 0:
        return "is_causal or softcap set on the node"
    if any(o is not None and (graph.users(o) or any(o is g for g in graph.outputs)) for o in att.outputs[1:]):
        return "present or qk outputs are read"
    am = mask_input(graph)
    if am is None:
        return f"no [batch, keys] {MASK_INPUT} input"
    q, k = att.inputs[0], att.inputs[1]
    rank3 = len(q.shape) == 3
    sq_dim, t_dim = (q.shape[1], k.shape[1]) if rank3 else (q.shape[2], k.shape[2])
    if len(mask.shape) != 4 or S.dim(mask.shape[1]) != S.dim(1):
        return "the mask is not [batch, 1, queries, keys]"
    if S.dim(mask.shape[0]) != S.dim(am.shape[0]) or S.dim(mask.shape[3]) != S.dim(am.shape[1]) or \
            S.dim(t_dim) != S.dim(am.shape[1]) or S.dim(mask.shape[2]) != S.dim(sq_dim):
        return f"the mask's batch / queries / keys are not {MASK_INPUT}'s and the attention's"
    nodes = mask_slice(graph, mask)
    if isinstance(nodes, str):
        return nodes
    found = _probe(graph, roles, bounds, am, nodes, mask, sq_dim)
    if isinstance(found, str):
        return found
    return (am, *found)


def rewrite_graph(graph: Graph, roles: dict, bounds: dict, stats: RewriteStats) -> None:
    done: dict[int, tuple] = {}
    for att in [n for n in graph.nodes if n.op == "Attention"]:
        mask = att.inputs[3] if len(att.inputs) > 3 else None
        found = done.get(id(mask)) if mask is not None else None
        if found is None:
            found = _why_not(graph, roles, bounds, att)
            if isinstance(found, str):
                stats.declined[f"{RULE} at {att.name}"] = found
                continue
            done[id(mask)] = found
        am, causal, window, fill = found
        att.inputs[3] = am
        att.attrs = {**att.attrs, "key_mask": 1, "causal": causal, "window": window, "mask_fill": fill}
        stats.applied[RULE] = stats.applied.get(RULE, 0) + 1


def mask_as_lengths(program: Program) -> tuple[Program, RewriteStats]:
    """Unless ATLAS_MASK_LENGTHS=0, every entry's Attention reads attention_mask directly (fusion on)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    if not enabled():
        stats.declined[RULE] = f"{ENV}=0"
        return program, stats
    for name, graph in program.entries.items():
        rewrite_graph(graph, program.roles, program.bounds.get(name, {}), stats)
    return program, stats
