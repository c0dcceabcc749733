"""entry-points: split the model into the entry points the runtime calls.

Matches, for a decoder (inputs `past_key_values.{i}.key/value`, outputs `present.{i}.key/value`):

    past_i_k ──┐
               Concat(axis=2) ──> present_i_k ──> attention ...
    new_k ─────┘
    =>
    new_k ──> KVAppend{layer=i, kind=key, past=past_seq} ──> present_i_k (a view of the cache) ──> ...

and builds two entries sharing weights and the cache: `prefill` (seq >= 1 new tokens per sequence)
and `decode` (seq = 1). The past inputs and present outputs disappear: the cache
`[layers, 2, max_batch, kv_heads, max_seq, head_dim]` is persistent state, written in place, and
the past length is a run-time symbol. An encoder gets one `forward` entry.

Requires: canonicalize (single-input Concats removed). Guarantees: each entry verifies; running
prefill then decode on the reference interpreter with a KV-cache state reproduces the original
graph's logits; no node copies the past.
"""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value
from atlasc.ir.ops.prologue import QUANTIZED
from atlasc.ir.program import KVCacheInfo, Program
from atlasc.passes.rewrite import RewriteStats


def _decline(msg: str) -> ShapeError:
    return ShapeError(f"cannot make the KV cache in place: {msg}",
                      hint="atlasc expects present = Concat(past, new, axis=2) per layer, the past read nowhere else")


def _rewrite_cache(graph: Graph, sig, stats: RewriteStats) -> tuple[KVCacheInfo, str]:
    producers = graph.producers()
    outputs = {o.name: o for o in graph.outputs}
    first = graph.input(sig.past[min(sig.past)][0])
    if len(first.shape) != 4:
        raise _decline(f"{first.name} is not [batch, kv_heads, past, head_dim]")
    _, heads, past, head_dim = first.shape
    past_sym = S.as_symbol(past)
    if past_sym is None or not isinstance(heads, int) or not isinstance(head_dim, int):
        raise _decline(f"{first.name} has shape {S.shape_str(first.shape)}; expected static heads/head_dim "
                       "and a symbolic past length")
    removed_inputs, removed_outputs = set(), set()
    for layer, names in sig.past.items():
        if layer not in sig.present:
            raise _decline(f"layer {layer} has a past but no present output")
        for kind, past_name, present_name in zip(("key", "value"), names, sig.present[layer]):
            past_v = graph.input(past_name)
            present = outputs[present_name]
            node = producers.get(id(present))
            if node is None or node.op != "Concat" or len(node.inputs) != 2 or node.inputs[0] is not past_v:
                raise _decline(f"{present_name} is not Concat({past_name}, new)")
            if node.attrs["axis"] % 4 != 2:
                raise _decline(f"{present_name} concatenates on axis {node.attrs['axis']}, not the sequence axis")
            if len(graph.users(past_v)) != 1:
                raise _decline(f"{past_name} is read outside its Concat")
            if past_v.shape != first.shape or past_v.dtype != first.dtype:
                raise _decline(f"{past_name} differs in shape or dtype from {first.name}")
            idx = graph.nodes.index(node)
            graph.nodes[idx] = Node("KVAppend", [node.inputs[1]], [present],
                                    {"layer": layer, "kind": kind, "past": S.sym(past_sym)}, name=f"kv_{kind}_{layer}")
            removed_inputs.add(past_name)
            removed_outputs.add(present_name)
            stats.applied["Concat(past, new) => KVAppend(new)"] = stats.applied.get(
                "Concat(past, new) => KVAppend(new)", 0) + 1
    graph.inputs = [v for v in graph.inputs if v.name not in removed_inputs]
    graph.outputs = [v for v in graph.outputs if v.name not in removed_outputs]
    graph.cleanup()
    info = KVCacheInfo(layers=len(sig.past), kv_heads=heads, head_dim=head_dim, max_batch=0, max_seq=0,
                       dtype=first.dtype)
    return info, past_sym


def entry_points(program: Program) -> tuple[Program, RewriteStats]:
    """Build `prefill` + `decode` for decoders, `forward` for everything else."""
    stats = RewriteStats()
    (graph,) = program.entries.values()
    opts = program.options
    sig = graph.metadata.get("decoder")
    if sig is None or not sig.present or not sig.input_ids:
        program.kind = "encoder"
        graph.name = "forward"
        program.entries = {"forward": graph}
        roles = {}
        first = graph.inputs[0] if graph.inputs else None
        if first is not None and first.shape and S.as_symbol(first.shape[0]):
            roles["batch"] = S.as_symbol(first.shape[0])
        if first is not None and len(first.shape) > 1 and S.as_symbol(first.shape[1]):
            roles["seq"] = S.as_symbol(first.shape[1])
        program.roles = roles
        program.bounds = {"forward": {s: (opts.max_batch if s == roles.get("batch") else opts.max_seq)
                                      for s in graph.symbols}}
        program.bindings = {"forward": {}}
        _set_symbol_bounds(graph, program.bounds["forward"])
        return program, stats

    program.kind = "decoder"
    info, past = _rewrite_cache(graph, sig, stats)
    ids = graph.input(sig.input_ids)
    batch, seq = S.as_symbol(ids.shape[0]), S.as_symbol(ids.shape[1])
    if not batch or not seq:
        raise ShapeError(f"input_ids must be [batch, seq] with symbolic dims, got {S.shape_str(ids.shape)}")
    program.kv_cache = KVCacheInfo(info.layers, info.kv_heads, info.head_dim, opts.max_batch, opts.max_seq,
                                   info.dtype)
    program.roles = {"batch": batch, "seq": seq, "past": past}
    _append_sampling(graph, stats)
    prefill = graph
    prefill.name = "prefill"
    decode = graph.clone("decode").substitute({seq: 1})
    if opts.prefill_logits == "last":
        _last_position_logits(prefill, stats)
    program.entries = {"prefill": prefill, "decode": decode}
    program.bounds = {
        "prefill": {batch: opts.max_batch, seq: opts.max_seq, past: opts.max_seq - 1},
        "decode": {batch: opts.max_batch, past: opts.max_seq - 1},
    }
    program.bindings = {"prefill": {}, "decode": {seq: 1}}
    for name, g in program.entries.items():
        _set_symbol_bounds(g, program.bounds[name])
    return program, stats


SAMPLE_PARAMS = "sample_params"  # float32[3]: temperature, top_p, unused
SAMPLE_STATE = "sample_state"  # int64[3]: seed, step, top_k
NEXT_TOKENS = "next_tokens"  # int64[batch]


def _append_sampling(graph: Graph, stats: RewriteStats) -> None:
    """Sample the next token on the device: logits -> Sample -> next_tokens (a new graph output)."""
    logits = graph.outputs[0]
    if len(logits.shape) != 3:
        raise ShapeError(f"the decoder's first output {logits.name} is not [batch, seq, vocab] logits")
    fparams = Value(SAMPLE_PARAMS, "float32", (3,))
    iparams = Value(SAMPLE_STATE, "int64", (3,))
    tokens = Value(NEXT_TOKENS, "int64", (logits.shape[0],))
    graph.inputs += [fparams, iparams]
    graph.nodes.append(Node("Sample", [logits, fparams, iparams], [tokens], name="sample_next_token"))
    graph.outputs.append(tokens)
    stats.applied["logits => Sample(logits) (next token on the device)"] = 1


def _last_position_logits(graph: Graph, stats: RewriteStats) -> None:
    """Prefill computes logits for the last position only: the LM head reads hidden[:, S-1:S].

    Left padding keeps every sequence's last real token at position S - 1, so next-token sampling is
    unchanged while the head's FLOPs and the logits buffer shrink by S. Between the head and the
    output only Casts are allowed (anything else might mix positions)."""
    producers = graph.producers()
    logits = graph.outputs[0]
    chain = []
    node = producers.get(id(logits))
    while node is not None and node.op == "Cast":
        chain.append(node)
        node = producers.get(id(node.inputs[0]))
    if node is None or node.op not in ("Linear", *QUANTIZED) or len(node.inputs[0].shape) != 3:
        raise ShapeError(f"--prefill-logits last: the decoder's logits {logits.name} do not come from a linear "
                         "LM head over [batch, seq, hidden]", hint="compile with --prefill-logits all")
    if any(len(graph.users(v)) != 1 for v in [node.outputs[0], *(c.outputs[0] for c in chain[1:])]):
        raise ShapeError("--prefill-logits last: the LM head's output has other readers",
                         hint="compile with --prefill-logits all")
    h = node.inputs[0]
    b, s, k = h.shape
    last = Value(h.name + "__last", h.dtype, (b, 1, k))
    graph.nodes.insert(graph.nodes.index(node), Node("Slice", [h], [last], {
        "starts": (S.add(s, -1),), "ends": (s,), "axes": (1,), "steps": (1,)}, name=f"last_position:{h.name}"))
    node.inputs = [last, *node.inputs[1:]]
    for n in [node, *chain]:  # the head and the Casts after it now see one position
        out = n.outputs[0]
        out.shape = (b, 1, *out.shape[2:])
    stats.applied["prefill logits => last position only"] = 1


def _set_symbol_bounds(graph: Graph, upper: dict[str, int]) -> None:
    for s, info in list(graph.symbols.items()):
        graph.symbols[s] = SymbolInfo(info.lower, upper.get(s, info.upper))
