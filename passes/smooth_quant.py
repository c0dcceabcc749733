"""smooth-quant: SmoothQuant's migration of activation outliers into the weights (`--smooth ALPHA`), before quantize.

W8A8 (int8 activations, choose-decode-path) quantizes each row of x with one scale, so a few channels of large
magnitude (the outliers of a norm's output) cost every other channel its precision. SmoothQuant (Xiao et al.
2023) divides channel j of x by s_j and multiplies column j of every weight reading x by s_j: the product is
unchanged in exact arithmetic, and the division folds into the constant that scales x's channels anyway. Matches
(after fuse-linear, on the float graph):

    x = Mul(h, c) | Mul(c, h)          c a constant [K]: a decomposed RMSNorm's (or any) per-channel scale
    x = RMSNormalization(h, c)         c [K]
    x = LayerNormalization(h, c, d)    c, d [K]
    x = Mul(g, u) | Mul(u, g)          u = Linear(h, U, [e]) read only here, U a constant [K, K']: SwiGLU's
                                       silu(gate) * up, the down projection's input
    every user of x: Linear(x, W_i, [b_i]), W_i a constant float [N_i, K] that quantize will quantize
  =>
    c / s (and d / s), or U's rows and e divided by s; W_i[:, j] s_j

with s_j = max|x_j|^alpha / max_i,n |W_i[n, j]|^(1 - alpha) (1 where either maximum is 0), max|x_j| over the
calibration tokens: options.calib's prompts run on the reference interpreter (passes/gptq.py load_feeds: the
prompts as whole prefills, padding left out). The new constants are rounded to the old ones' dtype, nothing else
changes (s is clipped to [1e-4, 1e4], and for float16 constants so that a scaled column or a divided row or
channel stays below 32768).
Declines (reason at -vv): x with a user that is not such a Linear (e.g. a residual add after a post-norm), x
that is a graph output, a producer that is not one of the forms above (e.g. the attention's output, o's input).

Requires: fuse-linear (Linear nodes with [N, K] weights); runs before quantize, which then quantizes the scaled
weights (and records them as the layers' float weights for the accuracy report). Guarantees: the graph verifies;
its outputs change by float rounding only; nothing happens unless options.smooth > 0.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import UsageError
from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.program import Program
from atlasc.passes.gptq import calibration_rows, load_feeds
from atlasc.passes.quantize import skipped_by
from atlasc.passes.rewrite import RewriteStats

RULE = "x = norm(h) * c; Linear(x, W) => c / s, W s (SmoothQuant)"
SCALE_LIMIT = 1e4  # s is clipped to [1 / SCALE_LIMIT, SCALE_LIMIT]: a dead channel must not blow up its weights
FP16_ROOM = 32768.0  # and, for float16 weights, to FP16_ROOM / max|w_.j|: a scaled column stays below half of 65504


def smoothing_scales(act_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = act_max_j^alpha / w_max_j^(1 - alpha), 1 where either is 0, clipped to [1e-4, 1e4] (float64)."""
    act_max, w_max = np.asarray(act_max, np.float64), np.asarray(w_max, np.float64)
    live = (act_max > 0) & (w_max > 0)
    s = np.ones_like(act_max)
    s[live] = act_max[live] ** alpha / w_max[live] ** (1.0 - alpha)
    return np.clip(s, 1.0 / SCALE_LIMIT, SCALE_LIMIT)


def _divisors(prod: Node, graph: Graph, producers: dict) -> list[tuple[Node, int, bool]] | None:
    """Where x = prod's output takes its division by s (see the module docstring): (node, input index, rows) with
    rows False for a per-channel constant (x's last axis), True for the rows of an up projection's [K, K'] weight;
    None when prod is none of the forms."""
    if prod.op == "Mul" and len(prod.inputs) == 2:
        for i in (0, 1):
            c, h = prod.inputs[i], prod.inputs[1 - i]
            if c.is_constant and not h.is_constant and len(c.shape) >= 1 and int(np.prod(c.shape)) == c.shape[-1]:
                return [(prod, i, False)]
        if prod.inputs[0] is prod.inputs[1]:
            return None  # a square: dividing the operand would divide x by s^2
        for v in prod.inputs:  # a gated product (SwiGLU's silu(g) * u): u's projection rows and bias
            up = producers.get(id(v))
            if (up is not None and up.op == "Linear" and up.inputs[1].is_constant and len(up.inputs[1].shape) == 2
                    and up.inputs[1].dtype in ("float16", "float32") and graph.users(v) == [prod]
                    and all(v is not o for o in graph.outputs)):
                bias = len(up.inputs) > 2 and up.inputs[2] is not None
                if bias and not up.inputs[2].is_constant:
                    continue
                return [(up, 1, True)] + ([(up, 2, False)] if bias else [])
        return None
    if prod.op == "RMSNormalization" and len(prod.inputs) >= 2 and prod.inputs[1].is_constant:
        return [(prod, 1, False)]
    if prod.op == "LayerNormalization" and len(prod.inputs) >= 2 and prod.inputs[1].is_constant and (
            len(prod.inputs) < 3 or prod.inputs[2] is None or prod.inputs[2].is_constant):
        return [(prod, 1, False)] + ([(prod, 2, False)] if len(prod.inputs) > 2 and prod.inputs[2] is not None else [])
    return None


def _candidates(graph: Graph, program: Program, stats: RewriteStats) -> list[tuple[Value, list, list[Node]]]:
    """(x, its divisors (_divisors), the Linear users) of every x that smooth-quant can rewrite."""
    producers = graph.producers()
    seen, out = set(), []
    for node in graph.nodes:
        if node.op != "Linear" or id(node.inputs[0]) in seen:
            continue
        x = node.inputs[0]
        seen.add(id(x))
        where = f"{RULE} at {x.name}"
        if any(x is o for o in graph.outputs):
            stats.declined[where] = "it is a graph output (its values would change)"
            continue
        users = graph.users(x)
        bad = [u for u in users if not (u.op == "Linear" and u.inputs[0] is x and u.inputs[1].is_constant
                                        and len(u.inputs[1].shape) == 2 and u.inputs[1].dtype in ("float16", "float32")
                                        and skipped_by(u, program.options.quant_skip) is None)]
        if bad:
            stats.declined[where] = f"{bad[0].name} ({bad[0].op}) reads it too: only quantized Linear users"
            continue
        prod = producers.get(id(x))
        targets = None if prod is None else _divisors(prod, graph, producers)
        if targets is None:
            stats.declined[where] = ("its producer is not a per-channel scale by a constant (norm or Mul) nor a "
                                     "gated product")
            continue
        k = int(x.shape[-1])
        if any((n.inputs[i].shape[0] if rows else n.inputs[i].shape[-1]) != k for n, i, rows in targets):
            stats.declined[where] = "its scale constant is not one value per channel"
            continue
        out.append((x, targets, users))
    return out


def _scaled(program: Program, v: Value, f: np.ndarray, rows: bool) -> Value:
    """A new constant: v's data times f along its rows (rows) or its last axis, in float64, rounded to its dtype;
    a 2-D array a chunk of rows at a time (memory bounded by the new array)."""
    if v.data.ndim < 2:
        return constant(f"{v.name}__smooth", (v.data.astype(np.float64) * f).astype(v.data.dtype))
    new = program.new_array(v.shape, v.data.dtype)
    for r0 in range(0, v.shape[0], 4096):
        part = v.data[r0:r0 + 4096].astype(np.float64)
        new[r0:r0 + 4096] = (part * (f[r0:r0 + 4096, None] if rows else f)).astype(v.data.dtype)
    return constant(f"{v.name}__smooth", new)


def _act_max(graph: Graph, xs: list, feeds: dict[str, np.ndarray], batch: int) -> dict[int, np.ndarray]:
    """id(x) -> max |x_j| over the calibration tokens (attention_mask's padding left out), float64 [K]."""
    out: dict[int, np.ndarray] = {}
    for got in calibration_rows(graph, xs, feeds, batch):
        for v in xs:
            a = np.abs(got[v.name])
            m = a.max(axis=0) if a.size else np.zeros(a.shape[1])
            out[id(v)] = np.maximum(out[id(v)], m) if id(v) in out else m
    return out


def smooth_quant(program: Program) -> tuple[Program, RewriteStats]:
    """Fold SmoothQuant's per-channel scales into the norms' constants and the Linear weights (see the module
    docstring); records program.smoothing."""
    stats = RewriteStats()
    opts = program.options
    alpha = float(opts.smooth)
    if alpha <= 0:
        return program, stats
    if opts.quant != "int8" or not opts.calib:
        raise UsageError("--smooth needs --quant int8 and --calib prompts.npz",
                         hint="the calibration prompts give each channel's activation range")
    say = program.progress or (lambda stage, detail, done=None: None)
    layers = []
    for graph in program.entries.values():
        found = _candidates(graph, program, stats)
        if not found:
            continue
        say("smooth-quant", f"activation ranges of {len(found)} inputs on {opts.calib}")
        act = _act_max(graph, [x for x, _, _ in found], load_feeds(opts.calib, graph, opts.max_seq), opts.max_batch)
        for x, targets, users in found:
            w_max = np.max([np.abs(u.inputs[1].data).max(axis=0) for u in users], axis=0).astype(np.float64)
            s = smoothing_scales(act[id(x)], w_max, alpha)
            if any(u.inputs[1].dtype == "float16" for u in users):  # the scaled columns stay finite in float16
                s = np.minimum(s, np.where(w_max > 0, FP16_ROOM / np.maximum(w_max, 1e-30), SCALE_LIMIT))
            for n, i, rows in targets:  # and so do the divided constants
                v = n.inputs[i]
                if v.dtype == "float16":
                    m = np.abs(v.data).max(axis=1) if rows else np.abs(v.data).reshape(-1, v.shape[-1]).max(axis=0)
                    s = np.maximum(s, m.astype(np.float64) / FP16_ROOM)
            for n, i, rows in targets:
                n.inputs[i] = _scaled(program, n.inputs[i], 1.0 / s, rows)
            for u in users:  # W_i[:, j] s_j
                u.inputs[1] = _scaled(program, u.inputs[1], s, False)
            layers.append({"input": x.name, "linears": [u.name for u in users],
                           "divided": sorted({n.name for n, _, _ in targets}),
                           "scale_min": float(s.min()), "scale_max": float(s.max())})
            stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
    program.smoothing = {"alpha": alpha, "calib": opts.calib, "inputs": layers,
                         "declined": {k.split(" at ", 1)[1]: v for k, v in stats.declined.items()}}
    return program, stats
