"""plan-memory: one arena for the whole program, offsets for every value of every entry.

    | weights | kv_cache | io: dims buffer, each entry's inputs and outputs | activations |

- weights: every constant of every entry (shared by reference), in first-use order, read-only;
- kv_cache: `[layers, 2, max_batch, kv_heads, max_seq, head_dim]`; a KVAppend output (and the two `present`
  outputs of QKVRotary / NormLinearRotary / LinearRotary) is a strided view of its layer's key or value slot, not a
  buffer of its own;
- io: the int64 dims buffer (symbol values), then each entry's inputs (side by side, smallest upper bound
  first) and outputs, never reused; the decode step's entries first (the narrowest, split-decode's, first
  of all), so the runtime's staged upload of a step sends the dims and its inputs in one copy; a decode
  step's input ids share its next_tokens' slot (tokens_slot_input);
- activations: every other value gets an interval [step defined, last step read] over its entry's
  schedule and an offset by best fit (largest buffers first, the smallest free gap among buffers
  whose intervals overlap). Entries never run at once, so they share the region.

Sizes are evaluated at the symbols' compile-time maxima (with past + seq <= max_seq); every offset
and size is a multiple of ALIGNMENT. Requires: entry-points, schedule. Guarantees (checked by
`check_plan`): no two values live at the same step overlap, everything is aligned and inside its
region, the activation region is at most the naive sum.
"""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import itemsize
from atlasc.ir.graph import Graph, Value
from atlasc.ir.memory import ALIGNMENT, MemoryPlan, Placement, Region, align
from atlasc.ir.program import Program
from atlasc.passes.entry_points import NEXT_TOKENS
from atlasc.passes.rewrite import RewriteStats


def dim_upper(d, upper: dict[str, int], roles: dict[str, str], max_seq: int | None) -> int:
    """An upper bound of dim d with symbols at their maxima and, for decoders, past + seq <= max_seq."""
    naive = S.evaluate(d, upper)
    past, seq = roles.get("past"), roles.get("seq")
    if max_seq is None or not isinstance(d, S.Expr) or past not in upper:
        return naive
    syms = S.symbols_of(d)
    if past not in syms:
        return naive
    # linear in past and seq, never both in one monomial: the maximum sits at a vertex of the simplex
    for mono, _ in d.terms:
        if not all(isinstance(a, str) for a in mono):
            return naive
        if mono.count(past) > 1 or mono.count(seq) > 1 or (past in mono and seq in mono):
            return naive
    seq_max = upper.get(seq, 1) if seq else 1
    vertices = [{past: max_seq - seq_max, **({seq: seq_max} if seq in upper else {})},
                {past: 0, **({seq: min(seq_max, max_seq)} if seq in upper else {})}]
    best = max(S.evaluate(d, {**upper, **v}) for v in vertices)
    return min(naive, best)


def value_bytes(v: Value, upper, roles, max_seq) -> int:
    n = 1
    for d in v.shape:
        n *= max(dim_upper(d, upper, roles, max_seq), 0)
    return n * itemsize(v.dtype)


def lifetimes(graph: Graph) -> dict[str, tuple[int, int]]:
    """Activation name -> (defining step, last reading step) over the entry's schedule."""
    live: dict[str, tuple[int, int]] = {}
    for step, node in enumerate(graph.nodes):
        for o in node.outputs:
            live[o.name] = (step, step)
        for i in node.inputs:
            if i is not None and i.name in live:
                live[i.name] = (live[i.name][0], step)
    return live


def best_fit(buffers: list[tuple[str, int, tuple[int, int]]]) -> tuple[dict[str, int], int]:
    """Offsets for (name, size, interval) so that buffers alive together never overlap; returns (offsets, end)."""
    placed: list[tuple[int, int, tuple[int, int]]] = []  # offset, size, interval
    offsets: dict[str, int] = {}
    order = sorted(buffers, key=lambda b: (-b[1], b[2][0], b[0]))
    for name, size, (start, stop) in order:
        busy = sorted((o, s) for o, s, (a, b) in placed if a <= stop and start <= b)
        best, best_gap, cursor = None, None, 0
        for off, sz in busy:
            gap = off - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, align(off + sz))
        if best is None:
            best = cursor
        offsets[name] = best
        placed.append((best, size, (start, stop)))
    end = max((o + s for o, s, _ in placed), default=0)
    return offsets, align(end)


def io_order(program: Program) -> list[str]:
    """The entries in the order their io is placed after the dims buffer: the decode steps (Program.decode_steps:
    split-decode's narrow one first), then the others as the program lists them. The first one's inputs begin
    right after the dims buffer: the step run once per generated token uploads both at once."""
    first = program.decode_steps()
    return first + [e for e in program.entries if e not in first]


def tokens_slot_input(program: Program, entry: str) -> str | None:
    """The input ids of a decode step that may share one slot with its next_tokens output, or None.

    A decode step reads its input ids first (the embedding) and writes next_tokens last (the sampling), so one
    slot serves both: the next step finds its input ids where this step left its tokens, and the runtime's
    pipelined loop needs no device copy between steps (runtime/gpu.py submit). Only when the ids are int64
    [batch, 1] (next_tokens' bytes) and every node reading them runs before the one writing next_tokens."""
    graph = program.entries[entry]
    sig = program.entries["prefill"].metadata.get("decoder") if "prefill" in program.entries else None
    if entry == "prefill" or sig is None:
        return None
    ids = next((v for v in graph.inputs if v.name == sig.input_ids), None)
    tokens = next((v for v in graph.outputs if v.name == NEXT_TOKENS), None)
    if ids is None or tokens is None or ids.dtype != "int64" or tokens.dtype != "int64" or \
            tuple(ids.shape) != (tokens.shape[0], 1):
        return None
    writer = next((i for i, n in enumerate(graph.nodes) if any(o is tokens for o in n.outputs)), None)
    readers = [i for i, n in enumerate(graph.nodes) if any(x is ids for x in n.inputs)]
    if writer is None or any(i >= writer for i in readers):
        return None
    return ids.name


def plan_memory(program: Program) -> tuple[Program, RewriteStats]:
    stats = RewriteStats()
    roles = program.roles
    max_seq = program.options.max_seq if program.kind == "decoder" else None
    symbols = tuple(sorted({s for g in program.entries.values() for s in g.symbols} |
                           {s for b in program.bindings.values() for s in b}))
    # -- weights ------------------------------------------------------------------------------
    weights: dict[str, int] = {}
    consts: dict[int, Value] = {}
    cursor = 0
    for graph in program.entries.values():
        for c in graph.constants():
            if id(c) in consts:
                continue
            if c.name in weights:
                raise ShapeError(f"two different constants are named {c.name}")
            consts[id(c)] = c
            weights[c.name] = cursor
            cursor = align(cursor + c.data.nbytes)
    weights_bytes = cursor
    # -- kv cache -----------------------------------------------------------------------------
    kv = program.kv_cache
    kv_offset = weights_bytes
    kv_bytes = 0
    if kv is not None:
        n = 1
        for x in kv.shape:
            n *= x
        kv_bytes = align(n * itemsize(kv.dtype))
    # -- io -----------------------------------------------------------------------------------
    io_offset = kv_offset + kv_bytes
    dims_offset = io_offset
    cursor = io_offset + align(8 * max(len(symbols), 1))
    io: dict[str, dict[str, Placement]] = {}
    for entry in io_order(program):
        graph = program.entries[entry]
        upper = program.bounds.get(entry, {})
        io[entry] = {}
        # inputs smallest first (stable), side by side: the runtime's staged upload copies adjacent inputs in one
        # piece, and an input whose bytes grow with the sequence (an attention mask) then comes last
        inputs = sorted(graph.inputs, key=lambda v: value_bytes(v, upper, roles, max_seq))
        ids = tokens_slot_input(program, entry)
        for v in [*inputs, *graph.outputs]:
            if v.name in io[entry] or v.is_constant or v.name == ids:
                continue
            size = align(max(value_bytes(v, upper, roles, max_seq), 1))
            io[entry][v.name] = Placement("io", cursor, size)
            if ids is not None and v.name == NEXT_TOKENS:
                io[entry][ids] = io[entry][v.name]
            cursor += size
    io_bytes = cursor - io_offset
    act_offset = cursor
    # -- activations (entries share the region) -------------------------------------------------
    plans: dict[str, MemoryPlan] = {}
    act_bytes = 0
    for entry, graph in program.entries.items():
        upper = program.bounds.get(entry, {})
        live = lifetimes(graph)
        aliases = find_aliases(graph, set(io[entry]))
        for name, root in aliases.items():  # the root's buffer lives as long as its last alias is read
            if root in live:
                live[root] = (live[root][0], max(live[root][1], live[name][1]))
        buffers, placements = [], {}
        for node in graph.nodes:
            for index, o in enumerate(node.outputs):
                if o.name in io[entry] or o.name in aliases:
                    continue
                kind = cache_kind(node, index)
                if kind is not None:
                    placements[o.name] = _kv_view(node.attrs["layer"], kind, kv, kv_offset)
                    continue
                size = align(max(value_bytes(o, upper, roles, max_seq), 1))
                buffers.append((o.name, size, live[o.name]))
        offsets, end = best_fit(buffers)
        for name, size, _ in buffers:
            placements[name] = Placement("activations", act_offset + offsets[name], size)
        for c in consts.values():
            placements[c.name] = Placement("weights", weights[c.name], align(c.data.nbytes))
        placements.update(io[entry])
        for name, root in aliases.items():
            placements[name] = placements[root]
        naive = sum(size for _, size, _ in buffers)
        plan = MemoryPlan(placements=placements, activation_peak=end, activation_naive=naive,
                          dims_offset=dims_offset, symbols=symbols,
                          lifetimes={name: interval for name, _, interval in buffers}, aliases=aliases)
        if aliases:
            stats.applied[f"{entry}: reshape-like outputs sharing their input's bytes"] = len(aliases)
        plans[entry] = plan
        act_bytes = max(act_bytes, end)
        stats.applied[f"{entry}: activation peak bytes"] = end
        stats.applied[f"{entry}: activation naive bytes"] = naive
    regions = {
        "weights": Region("weights", 0, weights_bytes),
        "kv_cache": Region("kv_cache", kv_offset, kv_bytes),
        "io": Region("io", io_offset, io_bytes),
        "activations": Region("activations", act_offset, act_bytes),
    }
    for plan in plans.values():
        plan.regions = regions
        plan.arena_bytes = act_offset + act_bytes
    program.plans = plans
    return program, stats


ALIAS_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity")


def find_aliases(graph: Graph, io_names: set[str]) -> dict[str, str]:
    """Value -> root value for reshape-like outputs that can share their input's bytes.

    The input must be stored contiguously (an activation, an entry input or a constant; not a cache
    view, itself possibly an alias) and the output must not be an entry output (those have their own
    io buffers the caller reads)."""
    producers = {id(o): (n, i) for n in graph.nodes for i, o in enumerate(n.outputs)}
    aliases: dict[str, str] = {}
    for node in graph.nodes:
        if node.op not in ALIAS_OPS or len(node.outputs) != 1 or not node.inputs:
            continue
        x, o = node.inputs[0], node.outputs[0]
        if o.name in io_names or x.dtype != o.dtype:
            continue
        src = producers.get(id(x))
        if src is not None and cache_kind(*src) is not None:
            continue
        aliases[o.name] = aliases.get(x.name, x.name)
    return aliases


def cache_kind(node, index: int) -> str | None:
    """"key" / "value" when output `index` of node is a view of the KV cache, else None."""
    if node.op == "KVAppend":
        return node.attrs["kind"]
    if node.op == "QKVRotary" and index > 0:
        return ("key", "value")[index - 1]
    if node.op in ("NormLinearRotary", "LinearRotary") and index in (1, 2):  # (q, present_k, present_v[, sum])
        return ("key", "value")[index - 1]
    return None


def _kv_view(layer: int, kind: str, kv, kv_offset: int) -> Placement:
    slot = layer * 2 + ("key", "value").index(kind)
    per_slot = kv.max_batch * kv.kv_heads * kv.max_seq * kv.head_dim
    strides = (kv.kv_heads * kv.max_seq * kv.head_dim, kv.max_seq * kv.head_dim, kv.head_dim, 1)
    return Placement("kv_cache", kv_offset + slot * per_slot * itemsize(kv.dtype),
                     per_slot * itemsize(kv.dtype), strides)


def check_plan(program: Program) -> list[str]:
    """Every violated planner guarantee, as messages (empty when the plan is sound)."""
    problems = []
    for entry in program.entries:
        plan = program.plans[entry]
        for name, p in plan.placements.items():
            if p.offset % ALIGNMENT:
                problems.append(f"{entry}: {name} at unaligned offset {p.offset}")
            region = plan.regions[p.region]
            if p.offset < region.offset or p.offset + p.nbytes > region.offset + region.nbytes:
                problems.append(f"{entry}: {name} lies outside region {p.region}")
        slots: dict[int, set[str]] = {}  # inputs and outputs by offset: one slot each, save a step's ids and tokens
        graph = program.entries[entry]
        for v in {*graph.inputs, *graph.outputs}:
            if not v.is_constant:
                slots.setdefault(plan.placements[v.name].offset, set()).add(v.name)
        shared = {NEXT_TOKENS, tokens_slot_input(program, entry)}
        problems += [f"{entry}: io values {sorted(names)} share one slot" for names in slots.values()
                     if len(names) > 1 and names != shared]
        acts = [(n, plan.placements[n], iv) for n, iv in plan.lifetimes.items()]
        for i, (a, pa, (s1, e1)) in enumerate(acts):
            for b, pb, (s2, e2) in acts[i + 1:]:
                if s1 <= e2 and s2 <= e1 and pa.offset < pb.offset + pb.nbytes and pb.offset < pa.offset + pa.nbytes:
                    problems.append(f"{entry}: {a} and {b} are live together and overlap")
        if plan.activation_peak > plan.activation_naive and plan.activation_naive:
            problems.append(f"{entry}: activation peak exceeds the naive sum")
    return problems
