"""gptq: calibrated int4 rounding for the quantize pass (`--quant int4 --gptq --calib text.npz`).

Not a pass of its own: quantize calls it, per int4 layer, instead of its round-to-nearest search
(passes/quantize.py quantize_int4 / quantize_int4_asym) when options.gptq is set. Same output format
(packed codes, float16 group scales, uint8 zero points with --zero-points), so LinearQ4's reference and
kernels are unchanged: only which codes are stored changes.

Calibration (`calibration_hessians`): the float graph (before quantize) runs on the reference
interpreter over the calibration prompts (options.calib: an .npz with `input_ids` [prompts, length] and,
optionally, `attention_mask`, `token_type_ids`, `position_ids`; missing ones are all-ones / zeros /
0..length-1; a decoder's float KV-cache inputs are empty: every symbol of their shapes other than
input_ids' two is 0), `max_batch` prompts at a time. For every candidate Linear it accumulates H = sum x x^T
(float64 [K, K]) over the rows x it sees, padded positions (attention_mask 0) left out.

Rounding (`gptq_int4`, GPTQ, Frantar et al. 2022): columns are quantized one at a time; the rounding
error of column i, divided by the i-th diagonal of the upper Cholesky factor U of (H + damp I)^-1, is
subtracted from the columns not yet quantized, weighted by U[i, i+1:], which minimizes the layer's output
error ||X W^T - X Wq^T|| on the calibration rows better than rounding each weight alone. The updates
are applied lazily per BLOCK columns (the same arithmetic, one matrix product per block).
Act order with static groups (ACT_ORDER, the default; "static_groups" in AutoGPTQ): every group's scale
(and zero point) is fixed first, from the original weights of its contiguous K-range, with the
CLIP_RATIOS search of plain rounding; then the columns are quantized in order of decreasing diag(H), so
the large-activation columns are rounded while the most columns are left to absorb their error. The
stored layout (groups of `group` consecutive k) is unchanged. Without act order a group's scale is
fixed when the rounding reaches its first column, from the error-updated weights.
damp = DAMP x mean(diag H): on all-MiniLM-L6-v2 a few hundred calibration tokens overfit with 1%
(docs/perf.md); 10% generalizes better.

Guarantees: codes in range, scales >= 2^-14 in float16 (quantize's _scale16), so |dequant| stays
bounded as with plain rounding; a layer whose H is zero (never reached) is rounded plainly.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import UsageError
from atlasc.ir import symbolic as S
from atlasc.ir.calibration import check_token_ids, embedding_rows, read_npz, token_ids
from atlasc.ir.graph import Graph, Node
from atlasc.ir.interpreter import interpret

DAMP = 0.1
ACT_ORDER = True
BLOCK = 128  # columns per lazy update (rounded to a multiple of the group without act order)
FEED_NAMES = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def load_feeds(path: str, graph: Graph, max_seq: int | None = None) -> dict[str, np.ndarray]:
    """The graph's inputs for every calibration prompt, from the .npz at path (see the module docstring): a
    decoder's past key / value inputs empty (the prompts run as whole prefills). The token ids are checked as
    the accuracy report's are (atlasc/ir/calibration.py), against the rows of the embedding table they index, and
    a decoder's prompts against max_seq (what its accuracy report will refuse; an encoder's graph runs any
    length on the reference interpreter)."""
    arrays = read_npz(path)
    ids = arrays["input_ids"] = check_token_ids(token_ids(path, arrays), embedding_rows(graph))
    feeds = {}
    ids_input = next((v for v in graph.inputs if v.name == "input_ids"), None)
    env = {}  # input_ids' symbols at the prompts' shape; any other symbol (a past length) 0
    if ids_input is not None:
        for d, n in zip(ids_input.shape, ids.shape):
            if S.as_symbol(d) is not None:
                env[S.as_symbol(d)] = int(n)
    for v in graph.inputs:
        if v.name not in arrays and v.dtype in ("float16", "float32") and env:
            shape = tuple(S.evaluate(d, {name: env.get(name, 0) for name in S.symbols_of(d)}) for d in v.shape)
            if 0 in shape:  # an empty KV cache (a past length of 0): a decoder
                feeds[v.name] = np.zeros(shape, v.dtype)
                if max_seq is not None:
                    check_token_ids(ids, None, max_seq)
                continue
        if v.name in arrays:
            feeds[v.name] = arrays[v.name].astype(np.int64)
        elif v.name == "attention_mask":
            feeds[v.name] = np.ones_like(ids, np.int64)
        elif v.name == "token_type_ids":
            feeds[v.name] = np.zeros_like(ids, np.int64)
        elif v.name == "position_ids":
            feeds[v.name] = np.tile(np.arange(ids.shape[1], dtype=np.int64), (ids.shape[0], 1))
        else:
            raise UsageError(f"calibration feeds {', '.join(FEED_NAMES)} and empty KV caches; the graph also "
                             f"takes '{v.name}'")
        if feeds[v.name].shape != ids.shape:
            raise UsageError(f"calibration {v.name} has shape {list(feeds[v.name].shape)}, input_ids "
                             f"{list(ids.shape)}")
    return feeds


def calibration_rows(graph: Graph, values: list, feeds: dict[str, np.ndarray], batch: int):
    """For each chunk of `batch` calibration prompts: {value name: its rows [tokens, last dim] in float64}, the
    graph run on the reference interpreter with `values` as extra outputs (removed again after), the padded
    positions (attention_mask 0) left out."""
    extra = [v for v in {id(v): v for v in values}.values() if all(v is not o for o in graph.outputs)]
    mask = feeds.get("attention_mask")
    rows = len(next(iter(feeds.values())))
    graph.outputs.extend(extra)
    try:
        for r0 in range(0, rows, max(1, batch)):
            out = interpret(graph, {k: v[r0:r0 + batch] for k, v in feeds.items()})
            keep = None if mask is None else mask[r0:r0 + batch].reshape(-1) != 0
            got = {}
            for v in values:
                x = out[v.name].reshape(-1, out[v.name].shape[-1]).astype(np.float64)
                got[v.name] = x[keep] if keep is not None and x.shape[0] == keep.size else x
            yield got
    finally:
        del graph.outputs[len(graph.outputs) - len(extra):]


def calibration_hessians(graph: Graph, nodes: list[Node], feeds: dict[str, np.ndarray],
                         batch: int) -> dict[int, np.ndarray]:
    """id(weight) -> H = sum x x^T over the float inputs x of the Linear nodes reading it."""
    hess: dict[int, np.ndarray] = {}
    for got in calibration_rows(graph, [n.inputs[0] for n in nodes], feeds, batch):
        for n in nodes:
            x = got[n.inputs[0].name]
            h = hess.setdefault(id(n.inputs[1]), np.zeros((x.shape[1], x.shape[1])))
            h += x.T @ x
    return hess


def _group_scale(wg: np.ndarray, asym: bool, ratios, scale16):
    """Per row of wg [N, G]: (scale float32, zero or None) of the clip ratio with the least squared error."""
    best = None
    for r in ratios:
        if asym:
            lo, hi = np.minimum(wg.min(1), 0) * r, np.maximum(wg.max(1), 0) * r
            s = scale16(hi - lo, 15).astype(np.float64)
            z = np.clip(np.rint(-lo / s), 0, 15)
        else:
            s, z = scale16(np.abs(wg).max(1) * r, 7).astype(np.float64), None
        d = _round(wg, s[:, None], None if z is None else z[:, None]) - wg
        cand = [np.einsum("ng,ng->n", d, d), s, z]
        if best is None:
            best = cand
            continue
        better = cand[0] < best[0]
        best = [np.where(better, c, b) if c is not None else None for c, b in zip(cand, best)]
    return best[1], best[2]


def _round(w: np.ndarray, s: np.ndarray, z: np.ndarray | None) -> np.ndarray:
    if z is None:
        return np.clip(np.rint(w / s), -8, 7) * s
    return (np.clip(np.rint(w / s) + z, 0, 15) - z) * s


def gptq_int4(w: np.ndarray, h: np.ndarray, group: int, asym: bool, ratios, scale16, damp: float = DAMP,
              act_order: bool = ACT_ORDER):
    """w [N, K], h [K, K] -> (codes int8 [N, K] (asym: unsigned 0..15), scale float16 [N, K/group], zero
    uint8 [N, K/group] or None), rounded by GPTQ (see the module docstring)."""
    n, k = w.shape
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * float(np.mean(np.diag(h))) * np.eye(k)
    scale = np.empty((n, k // group), np.float16)
    zero = np.empty((n, k // group), np.uint8) if asym else None
    if act_order:  # static groups: scales from the original weights, before any error feedback
        for g0 in range(0, k, group):
            s, z = _group_scale(w[:, g0:g0 + group], asym, ratios, scale16)
            scale[:, g0 // group] = s
            if asym:
                zero[:, g0 // group] = z
        perm = np.argsort(-np.diag(h), kind="stable")
        block = BLOCK
    else:
        perm = np.arange(k)
        block = group * max(1, BLOCK // group)  # a group's columns lie in one block
    u = np.linalg.cholesky(np.linalg.inv(h[perm][:, perm])).T  # upper: (H + damp I)^-1 = U^T U
    w = w[:, perm]
    codes = np.empty((n, k), np.int8)
    lo, hi = (0, 15) if asym else (-8, 7)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1]  # a view: the in-block updates land in w
        err = np.empty((n, b1 - b0))
        for j in range(b1 - b0):
            c = int(perm[b0 + j])
            if not act_order and c % group == 0:
                s, z = _group_scale(wb[:, j:j + group], asym, ratios, scale16)
                scale[:, c // group] = s
                if asym:
                    zero[:, c // group] = z
            s = scale[:, c // group].astype(np.float64)
            z = 0.0 if zero is None else zero[:, c // group].astype(np.float64)
            q = np.clip(np.rint(wb[:, j] / s) + z, lo, hi)
            codes[:, c] = q
            err[:, j] = (wb[:, j] - (q - z) * s) / u[b0 + j, b0 + j]
            wb[:, j + 1:] -= np.outer(err[:, j], u[b0 + j, b0 + j + 1:b1])
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes, scale, zero
