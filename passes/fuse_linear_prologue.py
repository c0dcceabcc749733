"""fuse-linear-prologue: at decode, the op computing a Linear's input runs inside the Linear's kernel.

Matches, where the Linear's rows (its input's leading dims) are at most PROLOGUE_MAX_M at run time
and the Linear is the producer's only reader:

    x = RMSNormalization(a, g)         ; y = Linear(x, w[, bias])  =>  y = NormLinear(a, None, g, w[, bias])
    x, s = AddRMSNormalization(a, b, g); y = Linear(x, w[, bias])  =>  y, s = NormLinear(a, b, g, w[, bias])
    x = FusedElementwise(ins..)        ; y = Linear(x, w[, bias])  =>  y = ElementwiseLinear(ins.., w[, bias])

and a NormLinear's output read only by an elementwise program over its two halves (SwiGLU on the merged
gate/up projection) becomes its gated epilogue: y = NormLinear(.., epilogue=program) [.., H], computed
once per output element (as a prologue of the down projection, every block would recompute all of it).
A NormLinear read only by a QKVRotary (the merged Q/K/V projection) takes the rotary and the KV-cache
append as its paired epilogue instead: q, present_k, present_v[, s] = NormLinearRotary(a, b, g, cos, sin,
w[, bias]); the projection's output is never stored.

(norms over the last axis with a rank-1 scale of x's dtype; an elementwise program whose inputs,
after their slices, have x's shape: no broadcasting, and only for one row: ELEMENTWISE_MAX_M). The
Linear kernel computes x itself (codegen/linear_prologue.py): every block stages all rows of x in shared
memory, which costs little for a few rows and a lot for many: so decode only (PROLOGUE_MAX_M, and x
must fit staging_limit: PROLOGUE_SMEM_BYTES, less on archs with less shared memory per block), where
the launch saved matters most. A
Llama decode layer becomes 5 kernels: NormLinearRotary (norm, Q/K/V, rotary, cache append), Attention,
Linear (o), NormLinear (gate/up + SwiGLU), Linear (down).

Requires: merge-linear, fuse-residual-norm, fuse-elementwise (it runs after them). Guarantees: the
reference of a fused op is the composition of the two it replaced (bit-identical on the CPU); graph
outputs keep their names. Where copy-engine norms fuse (below), fold_norm_scale.py's guarantee holds for the
weights they read instead: every entry reading them (prefill and decode_small too) computes the same function up
to one float16 rounding of W g, not bit for bit.

Above PROLOGUE_MAX_M (the decode entry of batches 9..32: `decode` beside split-decode's decode_small) the norm
fuses the same way where the copy-engine projection will run the fused op (codegen/linear_tma.py: an sm90-only
compile, float16, rows above 8 and at most 32, K % 64 == 0), the Linear's only reader is a gated program
(gate/up + SwiGLU) and the norm's scale can fold into the weight in every entry (fold_norm_scale.py, applied
here to those weights): that kernel streams x through its stages instead of staging it and sums each row's
squares there while the tensor cores multiply (linear_tma.cu NORM). A Llama decode layer is then 6 kernels at
batches 9..32. ATLAS_TMA_NORM=0 keeps those norms separate, =all also fuses them into QKV projections over
128-dim heads (5 kernels a layer, but the QKV kernel, 48 blocks of one warpgroup, measured slower than its norm
and itself apart: docs/perf.md v31). The LM head keeps its norm kernel (its x would be streamed again by each of
~2000 blocks).

Quantized projections (LinearQ8 / LinearQ4 / LinearF8) take the norm and the gated epilogue the same way
(NormLinearQ), not an elementwise prologue (ATLAS_QUANT_PROLOGUE=0 keeps their norms separate, e.g. to
compare).
"""

from __future__ import annotations

import os

from atlasc.errors import UsageError
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph, Node
from atlasc.ir.ops.prologue import PROLOGUE_MAX_M, QUANTIZED, staging_bytes, staging_limit
from atlasc.ir.archs import COPY_ENGINE_ENV, copy_engine
from atlasc.ir.program import Program, narrowed_lower
from atlasc.passes.fold_norm_scale import RULE as FOLD_RULE
from atlasc.passes.fold_norm_scale import fold, foldable, folded
from atlasc.passes.rewrite import RewriteStats

# ElementwiseLinear only for a single row: its every block recomputes the whole program (H200, Llama-3.2-1B
# SwiGLU into the down projection, docs/perf.md v7): 18.8 us at batch 1 against 15.0 us for the unfused down
# projection plus an unprofiled SwiGLU kernel (about even), 77 us at batch 8 against 24.0 us for the unfused
# one at batch 32 (a loss). The gated epilogue takes SwiGLU instead.
ELEMENTWISE_MAX_M = 1
# ATLAS_QUANT_PROLOGUE=0 keeps quantized projections' norms separate (GPU-validated and measured on the H200,
# docs/perf.md v8: Llama-3.2-1B int4 batch 1 1.104 -> 0.904 ms/step)
QUANT_ENV = "ATLAS_QUANT_PROLOGUE"
# the rotary + cache append as the QKV projection's epilogue (NormLinearRotary), float and quantized projections
# (ATLAS_ROTARY_EPILOGUE=1, the default). H200: Llama-3.2-1B int4 batch 1 0.904 -> 0.823 ms/step (docs/perf.md
# v8); float16, 8 layers of Llama-3-8B shapes, the decode step replayed alone (examples/replay_ab.py, v17): batch
# 1 1297.8 -> 1277.2 us, batch 32 2148.6 -> 2147.1 (v8's float16 loss, 1.120 -> 1.199 ms/step on Llama-3.2-1B,
# was measured under relocatable code, v12). auto: quantized projections only; 0: never.
ROTARY_ENV = "ATLAS_ROTARY_EPILOGUE"
TMA_NORM_ENV = "ATLAS_TMA_NORM"  # the copy-engine norm prologue above PROLOGUE_MAX_M rows (docstring); default 1
TMA_NORM_MODES = ("0", "1", "all")
COPY_ENGINE_MAX_M = 32  # codegen/linear_tma.py MAX_ROWS: the x rows of a stage
COPY_ENGINE_HEAD_DIM = 128  # codegen/linear_tma.py HEAD_DIM
ROTARY_MODES = ("auto", "1", "0")


def rotary_mode() -> str:
    """ATLAS_ROTARY_EPILOGUE (default 1); UsageError (exit 2) for an unknown value."""
    mode = os.environ.get(ROTARY_ENV, "") or "1"
    if mode not in ROTARY_MODES:
        raise UsageError(f"{ROTARY_ENV}={mode!r} is not one of {', '.join(ROTARY_MODES)}")
    return mode
NORMS = ("RMSNormalization", "AddRMSNormalization")
RULES = {
    "RMSNormalization": "Linear(RMSNormalization(a, g)) => NormLinear(a, g)",
    "AddRMSNormalization": "Linear(AddRMSNormalization(a, b, g)) => NormLinear(a, b, g)",
    "FusedElementwise": "Linear(FusedElementwise(ins)) => ElementwiseLinear(ins)",
}
EPILOGUE_RULE = "FusedElementwise(z[.., :H], z[.., H:]) of z = NormLinear(..) => NormLinear(.., epilogue)"
ROTARY_RULE = "QKVRotary(NormLinear(..)) => NormLinearRotary(..)"


def rows_upper(x, upper: dict[str, int]) -> int | None:
    """The most rows (x's leading dims at their bounds) x can have; None when a dim has no bound."""
    m = 1
    for d in x.shape[:-1]:
        try:
            m *= max(int(S.evaluate(d, upper)), 0)
        except KeyError:  # a symbol without a bound
            return None
    return m


def rows_lower(x, lower: dict[str, int]) -> int:
    """The rows (x's leading dims) x's kernel runs only above: `lower` holds what a narrower twin serves
    (narrowed_lower), 0 for other symbols."""
    m = 1
    for d in x.shape[:-1]:
        m *= max(int(S.evaluate(d, {**{s: 0 for s in S.symbols_of(d)}, **lower})), 0)
    return m


def tma_norm_mode() -> str:
    """ATLAS_TMA_NORM (default 1): 0, 1 (gate/up projections) or all (and 128-dim-head QKV projections);
    UsageError (exit 2) for another value."""
    value = os.environ.get(TMA_NORM_ENV, "") or "1"
    if value not in TMA_NORM_MODES:
        raise UsageError(f"{TMA_NORM_ENV}={value!r} is not one of {', '.join(TMA_NORM_MODES)}")
    return value


def _why_not_copy_engine(graph: Graph, lin: Node, p: Node, rows: int | None, lower: dict[str, int],
                         archs: tuple[str, ...], can_fold=None) -> str | None:
    """Why the copy-engine projection would not run this Linear (of at most `rows` rows) with the norm p as its
    prologue (None: it would); the module docstring's conditions. can_fold(w, g): why the norm's scale g cannot
    fold into the weight w (fold_norm_scale.py), or None."""
    x, w = lin.inputs[0], lin.inputs[1]
    if rows is None or rows > COPY_ENGINE_MAX_M or rows_lower(x, lower) < PROLOGUE_MAX_M:
        return (f"its rows may exceed {PROLOGUE_MAX_M} (prefill, or a decode compiled with --max-batch above "
                f"{PROLOGUE_MAX_M}), and the copy-engine path takes only kernels of {PROLOGUE_MAX_M + 1}.."
                f"{COPY_ENGINE_MAX_M} rows")
    if not copy_engine(archs) or tma_norm_mode() == "0":
        return (f"its rows may exceed {PROLOGUE_MAX_M}: only the copy-engine path fuses them (an sm90-only compile, "
                f"{COPY_ENGINE_ENV} and {TMA_NORM_ENV} not 0)")
    if p.op not in NORMS or lin.op != "Linear" or x.dtype != "float16":
        return f"its rows may exceed {PROLOGUE_MAX_M}: the copy-engine path fuses float16 norms only"
    k = w.shape[-1] if len(w.shape) == 2 and all(isinstance(d, int) for d in w.shape) else None
    if k is None or k % 64 or not _same_dims(x.shape[-1:], (k,)):
        return f"its rows may exceed {PROLOGUE_MAX_M}: the copy-engine path needs a static weight with K % 64 == 0"
    why = _why_not_copy_engine_reader(graph, lin)
    if why:
        return f"its rows may exceed {PROLOGUE_MAX_M}: {why}"
    return can_fold(w, p.inputs[-1]) if can_fold is not None else "no fold of the norm's scale into the weight"


def _why_not_copy_engine_reader(graph: Graph, lin: Node) -> str | None:
    """Why the Linear's reader keeps the copy-engine norm out (None: a gated program, or with ATLAS_TMA_NORM=all a
    QKVRotary over 128-dim heads rotated whole or not at all)."""
    if gated_epilogue(graph, lin) is not None:
        return None
    rot = rotary_epilogue(graph, lin)
    if rot is None:
        return "the copy-engine norm serves gate/up and QKV projections only (the LM head keeps its norm kernel)"
    if tma_norm_mode() != "all":
        return (f"the copy-engine norm fuses into gate/up projections only (into QKV with {TMA_NORM_ENV}=all: "
                "measured slower, docs/perf.md v31)")
    cos = rot.inputs[1] if len(rot.inputs) > 1 else None
    head = COPY_ENGINE_HEAD_DIM
    if int(rot.attrs["head_dim"]) != head or (cos is not None and cos.shape[-1] != head):
        return f"the copy-engine path rotates {head}-dim heads whole or not at all"
    return None


def _same_dims(a, b) -> bool:
    return len(a) == len(b) and all(S.dim(p) == S.dim(q) for p, q in zip(a, b))


def _why_not_norm(p: Node, x) -> str | None:
    g = p.inputs[-1]
    rank = len(x.shape)
    if (p.attrs.get("axis", -1) % rank) != rank - 1:
        return "the norm is not over the last axis"
    if p.op == "RMSNormalization" and p.inputs[0].dtype != x.dtype:
        return "the norm changes the dtype"
    if len(g.shape) != 1 or not _same_dims(g.shape, x.shape[-1:]) or g.dtype != x.dtype:
        return "the scale is not a [K] vector of x's dtype"
    return None


def _why_not_elementwise(p: Node, x) -> str | None:
    slices = p.attrs.get("slices") or (None,) * len(p.inputs)
    for v, sl in zip(p.inputs, slices):
        shape = tuple(v.shape) if sl is None else tuple(v.shape[:-1]) + (sl[1],)
        if not _same_dims(shape, x.shape):
            return f"input {v.name} broadcasts"
    return None


def _why_not(graph: Graph, lin: Node, p: Node | None, upper: dict[str, int], limit: int,
             lower: dict[str, int] | None = None, archs: tuple[str, ...] = (), can_fold=None) -> str | None:
    x, w = lin.inputs[0], lin.inputs[1]
    if p is None or p.op not in RULES:
        return "the input is not a norm or an elementwise program"
    if x.dtype not in ("float16", "float32") or not w.is_constant:
        return "not a float input with a constant weight"
    if lin.op != "Linear" and p.op == "FusedElementwise":
        return "no elementwise prologue for quantized projections"
    if lin.op != "Linear" and os.environ.get(QUANT_ENV, "1") == "0":
        return f"quantized projections keep their norms ({QUANT_ENV}=0)"
    rows = rows_upper(x, upper)
    copy_engine_rows = rows is None or rows > PROLOGUE_MAX_M
    if copy_engine_rows:
        why = _why_not_copy_engine(graph, lin, p, rows, lower or {}, archs, can_fold)
        if why:
            return why
    k = x.shape[-1]
    if not copy_engine_rows and (not isinstance(k, int) or staging_bytes(rows, k, x.dtype) > limit):
        return f"staging {rows} rows of x needs more than {limit // 1024} KB of shared memory (the archs' limit)"
    if len(graph.users(x)) != 1 or any(x is o for o in graph.outputs):
        return "the Linear's input has other readers"
    if p.op in NORMS:
        if p.op == "RMSNormalization" and any(o is not None and graph.users(o) for o in p.outputs[1:]):
            return "the norm's statistics are read"
        return _why_not_norm(p, x)
    if rows > ELEMENTWISE_MAX_M:
        return f"an elementwise prologue is recomputed by every block: only for {ELEMENTWISE_MAX_M} row"
    return _why_not_elementwise(p, x)


def gated_epilogue(graph: Graph, lin: Node) -> tuple[Node, int] | None:
    """(node, gate input) when the Linear's only reader is an elementwise program over its two halves
    [.., :H] and [.., H:] (SwiGLU on a merged gate/up projection) of the Linear's dtype; else None."""
    y = lin.outputs[0]
    users = graph.users(y)
    if len(users) != 1 or any(y is o for o in graph.outputs) or not isinstance(y.shape[-1], int):
        return None
    e = users[0]
    h = y.shape[-1] // 2
    slices = tuple(tuple(sl) if sl is not None else None for sl in (e.attrs.get("slices") or ()))
    if e.op != "FusedElementwise" or len(e.inputs) != 2 or not all(i is y for i in e.inputs) or 2 * h != y.shape[-1]:
        return None
    if sorted(slices, key=str) != sorted(((0, h), (h, h)), key=str) or e.attrs["out_dtype"] != y.dtype:
        return None
    if not _same_dims(tuple(e.attrs["out_shape"]), tuple(y.shape[:-1]) + (h,)):
        return None
    return e, (0 if slices[0] == (0, h) else 1)


def rotary_epilogue(graph: Graph, lin: Node) -> Node | None:
    """The QKVRotary node when it is the only reader of the Linear's output (its merged q, k, v rows)."""
    y = lin.outputs[0]
    users = graph.users(y)
    mode = rotary_mode()
    if mode == "0" or (mode == "auto" and lin.op not in QUANTIZED):
        return None
    if len(users) != 1 or any(y is o for o in graph.outputs):
        return None
    r = users[0]
    if r.op != "QKVRotary" or r.inputs[0] is not y or int(r.attrs["head_dim"]) % 2:
        return None
    return r


def _fused(graph: Graph, lin: Node, p: Node) -> tuple[Node, Node | None, str | None]:
    """The fused node, the epilogue node it absorbed (or None) and that epilogue's rule."""
    rest = list(lin.inputs[1:])  # w[, bias]
    if p.op in NORMS:
        a, b, g = p.inputs[0], (p.inputs[1] if p.op == "AddRMSNormalization" else None), p.inputs[-1]
        attrs = {"epsilon": p.attrs["epsilon"]}
        s_out = [p.outputs[1]] if b is not None else []
        name = f"norm_linear:{lin.name}"
        quant = {"linear": lin.op, "group_size": int(lin.attrs.get("group_size", 0)),
                 "act": lin.attrs.get("act", "")} if lin.op in QUANTIZED else {}
        rot = rotary_epilogue(graph, lin)
        if rot is not None:  # the projection's rows go to q and the cache, rotated: y is never stored
            cos, sin = (rot.inputs[1], rot.inputs[2]) if len(rot.inputs) > 1 else (None, None)
            attrs |= {"linear": lin.op, "group_size": int(lin.attrs.get("group_size", 0)),
                      "act": lin.attrs.get("act", "")}
            attrs |= {k: rot.attrs[k] for k in ("q_heads", "kv_heads", "head_dim", "layer", "past")}
            node = Node("NormLinearRotary", [a, b, g, cos, sin, *rest], [*rot.outputs, *s_out], attrs, name=name)
            return node, rot, ROTARY_RULE
        y, epi = lin.outputs[0], gated_epilogue(graph, lin)
        if epi is not None:
            attrs |= {"epilogue": epi[0].attrs["program"], "gate_input": epi[1]}
            y = epi[0].outputs[0]
        op = "NormLinearQ" if quant else "NormLinear"  # quantized: wq, scale[, bias[, zero]] as the node has them
        node = Node(op, [a, b, g, *rest], [y, *s_out], attrs | quant, name=name)
        return node, (epi[0] if epi else None), (EPILOGUE_RULE if epi else None)
    attrs = {k: p.attrs[k] for k in ("program", "out_shape", "out_dtype", "slices") if k in p.attrs}
    attrs["n_in"] = len(p.inputs)
    node = Node("ElementwiseLinear", [*p.inputs, *rest], [lin.outputs[0]], attrs, name=f"elt_linear:{lin.name}")
    return node, None, None


def fuse_graph(graph: Graph, upper: dict[str, int], stats: RewriteStats, archs: tuple[str, ...] = (),
               lower: dict[str, int] | None = None, can_fold=None, copy_engine_weights: set | None = None) -> None:
    """Fuse graph's Linears with their producers where the module docstring allows (upper / lower: the entry's
    symbol bounds and the values it runs only above; can_fold: see _why_not_copy_engine). The weights of the
    copy-engine norms fused (above PROLOGUE_MAX_M rows) go into copy_engine_weights (ids)."""
    producers = graph.producers()
    limit = staging_limit(archs)
    for lin in [n for n in graph.nodes if n.op == "Linear" or n.op in QUANTIZED]:
        p = producers.get(id(lin.inputs[0]))
        why = _why_not(graph, lin, p, upper, limit, lower, archs, can_fold)
        rule = RULES.get(p.op if p is not None else "", "Linear(producer(...)) => prologue")
        if why:
            stats.declined[f"{rule} at {lin.name}"] = why
            continue
        rows = rows_upper(lin.inputs[0], upper)
        if copy_engine_weights is not None and (rows is None or rows > PROLOGUE_MAX_M):
            copy_engine_weights.add(id(lin.inputs[1]))
        fused, epi, epi_rule = _fused(graph, lin, p)
        # p's inputs are ready there (w and bias are constants); toposort below places it after cos / sin
        graph.nodes[graph.nodes.index(p)] = fused
        graph.nodes.remove(lin)
        if epi is not None:
            graph.nodes.remove(epi)
            stats.applied[epi_rule] = stats.applied.get(epi_rule, 0) + 1
        for o in fused.outputs:
            producers[id(o)] = fused
        stats.applied[rule] = stats.applied.get(rule, 0) + 1
    graph.cleanup()
    graph.toposort()


def fuse_linear_prologue(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse each decode Linear's producing norm or elementwise program into it (a no-op with fusion off)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    lower = narrowed_lower(program)
    candidates = foldable(program) if copy_engine(program.options.archs) and tma_norm_mode() != "0" else {}
    folds: dict[int, tuple] = {}  # id(W) -> (W, g, T(W g)), computed when a copy-engine norm asks

    def can_fold(w, g) -> str | None:
        if candidates.get(id(w)) is not g:
            return (f"its rows may exceed {PROLOGUE_MAX_M}: the weight is read elsewhere without this norm, so its "
                    "scale cannot fold into it (fold_norm_scale.py)")
        if id(w) not in folds:
            folds[id(w)] = (w, g, folded(program, w, g))
        if folds[id(w)][2] is None:
            return f"its rows may exceed {PROLOGUE_MAX_M}: the weight times the norm's scale overflows float16"
        return None

    used: set[int] = set()
    for entry, graph in program.entries.items():
        fuse_graph(graph, program.bounds.get(entry, {}), stats, program.options.archs, lower.get(entry, {}),
                   can_fold, used)
    count = fold(program, {k: folds[k] for k in used})
    if count:
        stats.applied[FOLD_RULE] = count
    return program, stats
