"""fuse-rmsnorm: x * rsqrt(mean(x^2) + eps) * w  =>  RMSNormalization(x, w, eps).

Matches (after canonicalize: Pow(x, 2) is Mul(x, x), 1/x is Reciprocal, constants on the right):

    xf = [Cast(x, float32)]
    r  = Reciprocal(Sqrt(Add(ReduceMean(Mul(xf, xf), axes=[-1], keepdims=1), eps)))   (or Div(xf, Sqrt(..)))
    y  = Mul(xf, r)  [-> Cast(_, T)]  -> Mul(_, w)     (w a constant of the last dim's size)
    =>
    y  = RMSNormalization(x, w){epsilon=eps, axis=-1}   (float32 statistics, output in y's dtype)

Requires: canonicalize. Guarantees: same outputs up to float rounding (the fused op rounds once where
an fp16 export rounds twice: before and after the weight multiply); tests compare on every fixture.
"""

from __future__ import annotations

from atlasc.ir.graph import Graph, Node, Value
from atlasc.ir.program import Program
from atlasc.passes.rewrite import Match, RewriteStats, Rule, apply_rules


def _const_scalar(v: Value | None) -> float | None:
    if v is not None and v.is_constant and v.data.size == 1:
        return float(v.data.reshape(-1)[0])
    return None


def _match(graph: Graph, node: Node):
    """Anchor: the weight multiply Mul(y, w)."""
    producers = graph.producers()
    y, w = node.inputs
    if not w.is_constant or len(w.shape) != 1:
        return "the multiplier is not a 1-D constant weight"
    p = producers.get(id(y))
    if p is not None and p.op == "Cast":
        y = p.inputs[0]
        p = producers.get(id(y))
    if p is None or p.op not in ("Mul", "Div"):
        return "no normalization product before the weight"
    xf, r = p.inputs
    rn = producers.get(id(r))
    if p.op == "Div":
        sq = rn
    else:
        if rn is None or rn.op != "Reciprocal":
            xf, r = r, xf
            rn = producers.get(id(r))
        if rn is None or rn.op != "Reciprocal":
            return "no reciprocal square root"
        sq = producers.get(id(rn.inputs[0]))
    if sq is None or sq.op != "Sqrt":
        return "no square root"
    add = producers.get(id(sq.inputs[0]))
    if add is None or add.op != "Add" or _const_scalar(add.inputs[1]) is None:
        return "no + eps"
    eps = _const_scalar(add.inputs[1])
    mean = producers.get(id(add.inputs[0]))
    if mean is None or mean.op != "ReduceMean" or not mean.attrs.get("keepdims", 1):
        return "no mean over the last axis"
    rank = len(xf.shape)
    if tuple(a % rank for a in (mean.attrs.get("axes") or ())) != (rank - 1,):
        return "the mean is not over the last axis only"
    square = producers.get(id(mean.inputs[0]))
    if square is None or square.op != "Mul" or square.inputs[0] is not xf or square.inputs[1] is not xf:
        return "the mean is not of x * x"
    if xf.dtype != "float32" and xf.dtype != "float16":
        return f"dtype {xf.dtype}"
    x = xf
    cast = producers.get(id(xf))
    if cast is not None and cast.op == "Cast" and cast.inputs[0].dtype in ("float16", "float32"):
        x = cast.inputs[0]
    out = node.outputs[0]
    if w.shape[0] != x.shape[-1] or out.shape != x.shape:
        return "the weight does not match the normalized dim"
    weight = w
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from the input's {x.dtype}"
    if out.dtype != x.dtype:
        return "the output dtype differs from the input's"
    new = Value(out.name + "__rms", out.dtype, out.shape)
    return Match(out, new, [Node("RMSNormalization", [x, weight], [new], {"epsilon": eps, "axis": -1},
                                 name=f"rmsnorm:{out.name}")])


RULES = [Rule("x * rsqrt(mean(x^2) + eps) * w => RMSNormalization(x, w, eps)", ("Mul",), _match)]


def fuse_rmsnorm(program: Program) -> tuple[Program, RewriteStats]:
    """Fuse every decomposed RMSNorm of every entry (a no-op with fusion disabled)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    for name, graph in program.entries.items():
        program.entries[name] = apply_rules(graph, RULES, stats)
    return program, stats
