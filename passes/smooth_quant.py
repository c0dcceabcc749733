"""smooth-quant: SmoothQuant's migration of activation outliers into the weights (`--smooth ALPHA`), before quantize.

W8A8 (int8 activations, choose-decode-path) quantizes each row of x with one scale, so a few channels of large
magnitude (the outliers of a norm's output) cost every other channel its precision. SmoothQuant (Xiao et al.
2023) divides channel j of x by s_j and multiplies column j of every weight reading x by s_j: the product is
unchanged in exact arithmetic, and the division folds into the constant that scales x's channels anyway. Matches
(after fuse-linear, on the float graph):

    x = Mul(h, c) | Mul(c, h)          c a constant [K]: a decomposed RMSNorm's (or any) per-channel scale
    x = RMSNormalization(h, c)         c [K]
    x = LayerNormalization(h, c, d)    c, d [K]
    every user of x: Linear(x, W_i, [b_i]), W_i a constant float [N_i, K] that quantize will quantize
  =>
    c / s (and d / s), W_i[:, j] s_j

with s_j = max|x_j|^alpha / max_i,n |W_i[n, j]|^(1 - alpha) (1 where either maximum is 0), max|x_j| over the
calibration tokens: options.calib's prompts run on the reference interpreter (passes/gptq.py load_feeds: the
prompts as whole prefills, padding left out). The new constants are rounded to the old ones' dtype, nothing else
changes (s is clipped to [1e-4, 1e4], and for float16 weights so that a scaled column stays below 32768).
Declines (reason at -vv): x with a user that is not such a Linear (e.g. a residual add after a post-norm), x
that is a graph output, a producer that is not one of the forms above, a scale constant another node reads too.

Requires: fuse-linear (Linear nodes with [N, K] weights); runs before quantize, which then quantizes the scaled
weights (and records them as the layers' float weights for the accuracy report). Guarantees: the graph verifies;
its outputs change by float rounding only; nothing happens unless options.smooth > 0.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import UsageError
from atlasc.ir.graph import Graph, Node, constant
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


def _scale_inputs(node: Node) -> list[int] | None:
    """Indices of node's inputs to divide by s when node produces x (see the module docstring), or None."""
    k = None
    if node.op == "Mul" and len(node.inputs) == 2:
        for i in (0, 1):
            c, h = node.inputs[i], node.inputs[1 - i]
            if c.is_constant and not h.is_constant and len(c.shape) >= 1 and int(np.prod(c.shape)) == c.shape[-1]:
                k = i
        return None if k is None else [k]
    if node.op == "RMSNormalization" and len(node.inputs) >= 2 and node.inputs[1].is_constant:
        return [1]
    if node.op == "LayerNormalization" and len(node.inputs) >= 2 and node.inputs[1].is_constant and (
            len(node.inputs) < 3 or node.inputs[2] is None or node.inputs[2].is_constant):
        return [1] + ([2] if len(node.inputs) > 2 and node.inputs[2] is not None else [])
    return None


def _candidates(graph: Graph, program: Program, stats: RewriteStats) -> list[tuple[Node, list[int], list[Node]]]:
    """(producer, its scale inputs, the Linear users) of every x that smooth-quant can rewrite."""
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
        idx = None if prod is None else _scale_inputs(prod)
        if idx is None:
            stats.declined[where] = "its producer is not a per-channel scale by a constant (norm or Mul)"
            continue
        k = int(x.shape[-1])
        consts = [prod.inputs[i] for i in idx]
        if any(c.shape[-1] != k or len(graph.users(c)) != 1 for c in consts):
            stats.declined[where] = "its scale constant is shared or not one value per channel"
            continue
        out.append((prod, idx, users))
    return out


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
        act = _act_max(graph, [prod.outputs[0] for prod, _, _ in found], load_feeds(opts.calib, graph),
                       opts.max_batch)
        for prod, idx, users in found:
            x = prod.outputs[0]
            w_max = np.max([np.abs(u.inputs[1].data).max(axis=0) for u in users], axis=0).astype(np.float64)
            s = smoothing_scales(act[id(x)], w_max, alpha)
            if any(u.inputs[1].dtype == "float16" for u in users):  # the scaled columns stay finite in float16
                s = np.minimum(s, np.where(w_max > 0, FP16_ROOM / np.maximum(w_max, 1e-30), SCALE_LIMIT))
            for i in idx:
                c = prod.inputs[i]
                prod.inputs[i] = constant(f"{c.name}__smooth", (c.data.astype(np.float64) / s).astype(c.data.dtype))
            for u in users:
                w = u.inputs[1]
                new = program.new_array(w.shape, w.data.dtype)
                for r0 in range(0, w.shape[0], 4096):  # row chunks: memory bounded by the new array
                    new[r0:r0 + 4096] = (w.data[r0:r0 + 4096].astype(np.float64) * s).astype(w.data.dtype)
                u.inputs[1] = constant(f"{w.name}__smooth", new)
            layers.append({"input": x.name, "linears": [u.name for u in users],
                           "scale_min": float(s.min()), "scale_max": float(s.max())})
            stats.applied[RULE] = stats.applied.get(RULE, 0) + 1
    program.smoothing = {"alpha": alpha, "calib": opts.calib, "inputs": layers,
                         "declined": {k.split(" at ", 1)[1]: v for k, v in stats.declined.items()}}
    return program, stats
