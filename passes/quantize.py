"""quantize: weight-only quantization of constant-weight Linear layers (`--quant int8 | int4`).

Matches (after fuse-linear and merge-linear):

    y = Linear(x, W, [b])        W a constant [N, K] float16 / float32
    =>
    y = LinearQ8(x, Wq, s, [b])                   options.quant == "int8": Wq int8 [N, K], s fp16 [N]
    y = LinearQ4(x, Wp, s, [b], group_size=G)     options.quant == "int4": Wp uint8 [N, K/2], s [N, K/G]
    y = LinearF8(x, Wf, s, [b])                   options.quant == "fp8": Wf uint8 E4M3 codes [N, K], s [N]

int4 with options.zero_points (`--zero-points`): LinearQ4(x, Wp, s, [b] or None, z) with z uint8
[N, K/G], asymmetric groups (quantize_int4_asym: the range [min(w, 0), max(w, 0)] in 15 steps).

Symmetric round-to-nearest (the default): per output channel for int8 (s = max|w| / 127), per group of G weights
along K for int4 (s = max|w| / 7, values clamped to [-8, 7]), per output channel for fp8 (s = max|w|
/ 448, E4M3 round-to-nearest-even; only for --arch sm89 and newer, a UsageError otherwise). Scales
are stored in float16 (at least 2^-14, the smallest normal, so they never flush to zero; an all-zero
row or group gets 1) and the codes are computed against the stored scale, so |dequant - w| <= s / 2
elementwise for int8 / int4, and within half an E4M3 step (2^-4 relative, 2^-10 s absolute) for fp8.

Declines (reason at -vv): layers matched by a `quant_skip` fnmatch pattern (tried against the weight's
name, the node's name and the output's name; merge-linear runs after this pass, so these are the
export's own projections), and for int4
layers whose K the group size does not divide. A group size that divides no layer's K is a UsageError.

Also records `program.quantization`: per layer, the relative error ||x W^T - x Wq^T|| / ||x W^T|| on
64 seeded standard-normal activation rows, and the weight bytes before / after. Quantization runs in
row chunks (4 MiB of float32 each) on QUANT_THREADS threads, every step of a layer per chunk, so memory
stays bounded by one layer's output and the codes, scales and error do not depend on the thread count.

Pre-quantized exports (every mode, --quant none too): a MatMul whose weight is a DequantizeLinear of
stored integers becomes a quantized layer with those integers, without requantizing:

    MatMul(x, DequantizeLinear(q [K, N], s, [zp], axis=0, block_size=G))   int4 / uint4 values
        => LinearQ4(x, pack(q^T), s^T, group_size=G), plus zp^T (as unsigned codes) when it is not the
        symmetric one (int4 zp 0, uint4 zp 8)
    MatMul(x, DequantizeLinear(q [K, N], s [N], [zp], axis=1))              int8 (zp 0, or uint8 with
        zp 128)                                      => LinearQ8(x, q^T, s)
Scales become float16 (exact for float16 exports). Any other DequantizeLinear (per-channel int8 zero
points, blocked int8, a weight not fed to a MatMul) is a one-line ShapeError.

Requires: fuse-linear (its weights are transposed views: quantizing reads them in row chunks, and
merge-linear, which runs next, concatenates the small quantized arrays, not float copies). Guarantees:
the graph verifies; outputs differ from the float program by the quantization error only; does
nothing when options.quant == "none".
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from atlasc.errors import ShapeError, UsageError
from atlasc.ir.graph import Graph, Node, constant
from atlasc.ir.ops.quant import E4M3_MAX, dequant_f8
from atlasc.ir.program import Program
from atlasc.passes.gptq import calibration_hessians, gptq_int4, load_feeds
from atlasc.passes.rewrite import RewriteStats

MODES = ("none", "int8", "int4", "fp8")
FP8_MIN_ARCH = 89  # E4M3 conversion in hardware: Ada (sm89) and Hopper (sm90) on
CHUNK_ELEMENTS = 1 << 20  # weight elements per row chunk (4 MiB of float32): a few chunks per thread
GPTQ_CHUNK_ELEMENTS = 1 << 22  # with --gptq: each chunk factorizes the K x K hessian again (passes/gptq.py)
# rows of a chunk at least: a chunk of a transposed view reads that many contiguous float16 per K index
# (a 4096 x 28672 weight to float32 on the CPU machine: 4.6 ns per element in 36-row chunks, 2.6 in 128)
CHUNK_MIN_ROWS = 128
ERROR_ROWS = 64
MIN_SCALE = np.float32(2.0**-14)  # smallest normal float16


def _chunks(n: int, k: int, elements: int):
    rows = max(CHUNK_MIN_ROWS, elements // max(1, k))
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows)


# threads quantizing row chunks of one weight at once: every step of a layer (the float32 read of its
# transposed view, the clipping search, packing, dequantization and the error terms) runs per chunk, and
# numpy releases the GIL in its loops; each thread holds ~5 chunk-sized float32 arrays (20 MiB; 70 at K 28672).
# ATLAS_QUANT_THREADS=N overrides the default (the cores, at most 16)
THREADS_ENV = "ATLAS_QUANT_THREADS"
QUANT_THREADS = int(os.environ.get(THREADS_ENV, "").strip() or 0) or max(1, min(16, os.cpu_count() or 1))
_BLAS: list = []  # threadpoolctl's controller, made on first use


def _one_blas_thread():
    """A context in which BLAS (the error estimate's matmuls, GPTQ's factorizations) runs on the calling
    thread only, so that the chunk threads are the only parallelism: OpenBLAS's own threads, woken for
    each chunk's small matmuls, made _quantize_layer of a 14336 x 4096 int4 weight 3.6x slower (13x with
    this chunk size) on the 2-core CPU machine while other jobs ran there (docs/perf.md, session 9).
    threadpoolctl is a dependency; where it is missing (a --no-deps install) BLAS keeps its threads."""
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _BLAS.append(None)
        else:
            _BLAS.append(ThreadpoolController())
    return contextlib.nullcontext() if _BLAS[0] is None else _BLAS[0].limit(limits=1, user_api="blas")


def _each_chunk(n: int, k: int, fn, elements: int | None = None, on_rows=None) -> list:
    """[fn(r0, r1) for every row chunk (of `elements`, default CHUNK_ELEMENTS) of an [n, k] weight], in
    chunk order, on up to QUANT_THREADS threads, BLAS on one thread each. Each chunk's work is
    independent, so the results do not depend on the thread count. on_rows(rows done), if given, is called in
    the caller's thread as the chunks complete in order (the compile's progress within one weight)."""
    chunks = list(_chunks(n, k, elements or CHUNK_ELEMENTS))
    threads = min(QUANT_THREADS, len(chunks))
    results = []
    with _one_blas_thread(), ThreadPoolExecutor(max(threads, 1)) as pool:
        done = map(lambda rr: fn(*rr), chunks) if threads <= 1 else pool.map(lambda rr: fn(*rr), chunks)
        for (_, r1), result in zip(chunks, done):
            results.append(result)
            if on_rows is not None:
                on_rows(r1)
    return results


def _rows(w: np.ndarray, r0: int, r1: int) -> np.ndarray:
    """Rows r0:r1 of w as float32, in w's memory order: a chunk of a transposed view (fuse-linear's W^T)
    stays column-major, so the conversion reads memory in order and writes it in order. The clipping
    search's per-group sums then run along rows; their float32 rounding, and so which ratio wins a tie to
    the last bit, depends on that layout but not on the chunk size or the thread count."""
    return np.asarray(w[r0:r1], np.float32)


def _scale16(maxabs: np.ndarray, qmax: int) -> np.ndarray:
    s = maxabs.astype(np.float32) / np.float32(qmax)
    s = np.where(maxabs == 0, np.float32(1.0), np.maximum(s, MIN_SCALE))
    return np.minimum(s, np.float32(65504.0)).astype(np.float16)


def _int8_rows(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [r, K] -> (int8 codes [r, K], float16 scales [r])."""
    s = _scale16(np.abs(c).max(axis=1) if c.shape[1] else np.zeros(len(c), np.float32), 127)
    return np.clip(np.rint(c / s.astype(np.float32)[:, None]), -127, 127).astype(np.int8), s


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (wq int8 [N, K], scale float16 [N]) with w ~= wq * scale[:, None]."""
    n, k = w.shape
    wq = np.empty((n, k), np.int8)
    scale = np.empty(n, np.float16)

    def chunk(r0: int, r1: int) -> None:
        wq[r0:r1], scale[r0:r1] = _int8_rows(_rows(w, r0, r1))

    _each_chunk(n, k, chunk)
    return wq, scale


def to_e4m3(v: np.ndarray) -> np.ndarray:
    """float -> E4M3 codes (uint8): round to nearest, ties to the even code (IEEE), saturating at +-448,
    as float8_e4m3fn conversion does (tests/test_quantize.py checks it on every boundary). v is rounded
    to float32 first (the quantizer's w / s is float32). Normal range (|v| >= 2^-6): the float32 bits
    rounded to 3 mantissa bits (round half to even on the 20 dropped bits; a carry moves into the
    exponent, as it should), exponent re-biased 127 -> 7. Below: multiples of 2^-9, np.rint (half even)."""
    a = np.minimum(np.abs(np.asarray(v, np.float32)), np.float32(E4M3_MAX))
    bits = a.view(np.uint32)
    normal = ((bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)).astype(np.int32)
    normal -= 120 << 3  # float32 exponent bias 127, E4M3 bias 7, 3 mantissa bits
    sub = np.rint(a * np.float32(512)).astype(np.int32)  # 2^-9 steps; 8 (= 2^-6) is the first normal code
    code = np.where(a < np.float32(2.0 ** -6), sub, normal).astype(np.uint8)
    return code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))


def _fp8_rows(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [r, K] -> (E4M3 codes uint8 [r, K], float16 scales [r])."""
    s = _scale16(np.abs(c).max(axis=1) if c.shape[1] else np.zeros(len(c), np.float32), E4M3_MAX)
    return to_e4m3(c / s.astype(np.float32)[:, None]), s


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (E4M3 codes uint8 [N, K], scale float16 [N]): s = max|w| / 448 per row, codes
    the round-to-nearest-even E4M3 of w / s (to_e4m3), clamped to +-448."""
    n, k = w.shape
    wq = np.empty((n, k), np.uint8)
    scale = np.empty(n, np.float16)

    def chunk(r0: int, r1: int) -> None:
        wq[r0:r1], scale[r0:r1] = _fp8_rows(_rows(w, r0, r1))

    _each_chunk(n, k, chunk)
    return wq, scale


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int values [N, K] in [-8, 7] (K even) -> uint8 [N, K/2]: low nibble = even k, high = odd k, + 8."""
    u = (np.asarray(q).astype(np.int16) + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def _pack_codes(t: np.ndarray) -> np.ndarray:
    """float32 [r, K] of integers in [0, 15] (consumed) -> uint8 [r, K/2], the bytes of pack_int4(t - 8)."""
    u = t.astype(np.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


# int4 clipping search: each group's range is scaled by every ratio and the one with the smallest squared
# weight error kept (1.0 first: never worse than plain rounding to the group's max). all-MiniLM-L6-v2 g128
# min sentence cosine vs fp32 (CPU, docs/perf.md v8): symmetric 0.938 -> 0.953, zero points 0.950 -> 0.958;
# 26 ratios from 0.5 did no better than these 6
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _check_group(k: int, group: int) -> None:
    if group < 2 or group % 2 or k % group:
        raise ValueError(f"group size {group} must be even and divide K = {k}")


def _int4_rows(c: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [r, K] -> (packed uint8 [r, K/2], float16 scales [r, K/group]): quantize_int4 of them."""
    r, k = c.shape
    c = c.reshape(r, k // group, group)
    t = np.empty_like(c)
    d = np.empty_like(c)
    amax = np.abs(c, out=t).max(axis=2)
    # the error of ratio r per group, without keeping its codes: t = w / s, sum (clip(rint(t)) - t)^2 * s^2
    best_err, best_s = None, None
    for ratio in CLIP_RATIOS:
        s = _scale16(amax * np.float32(ratio), 7)
        s32 = s.astype(np.float32)
        np.divide(c, s32[..., None], out=t)
        np.rint(t, out=d)
        np.clip(d, -8, 7, out=d)
        d -= t
        err = np.einsum("rgk,rgk->rg", d, d) * (s32 * s32)
        if best_err is None:
            best_err, best_s = err, s
        else:
            better = err < best_err
            best_err, best_s = np.where(better, err, best_err), np.where(better, s, best_s)
    np.divide(c, best_s.astype(np.float32)[..., None], out=t)
    np.clip(np.rint(t, out=t), -8, 7, out=t)
    t += 8
    return _pack_codes(t.reshape(r, k)), best_s


def quantize_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (packed uint8 [N, K/2], scale float16 [N, K/group]); K % group == 0, group even.
    Per group s = float16(r * max|w| / 7) for the r in CLIP_RATIOS that minimizes the squared error of
    clip(rint(w / s), -8, 7) * s (so never more than with r = 1, where |dequant - w| <= s / 2)."""
    n, k = w.shape
    _check_group(k, group)
    packed = np.empty((n, k // 2), np.uint8)
    scale = np.empty((n, k // group), np.float16)

    def chunk(r0: int, r1: int) -> None:
        packed[r0:r1], scale[r0:r1] = _int4_rows(_rows(w, r0, r1), group)

    _each_chunk(n, k, chunk)
    return packed, scale


def _int4_asym_rows(c: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows [r, K] -> (packed uint8 [r, K/2], float16 scales, uint8 zeros [r, K/group]):
    quantize_int4_asym of them."""
    r, k = c.shape
    c = c.reshape(r, k // group, group)
    lo0, hi0 = np.minimum(c.min(axis=2), 0), np.maximum(c.max(axis=2), 0)

    def scale_zero(ratio: float):
        lo = lo0 * np.float32(ratio)
        s = _scale16(hi0 * np.float32(ratio) - lo, 15)
        return s, np.clip(np.rint(-lo / s.astype(np.float32)), 0, 15)

    # the error of ratio r per group, without keeping its codes: t = w / s,
    # sum (clip(rint(t) + z, 0, 15) - z - t)^2 * s^2
    best_err, best_s, best_z = None, None, None
    t = np.empty_like(c)
    d = np.empty_like(c)
    for ratio in CLIP_RATIOS:
        s, z = scale_zero(ratio)
        s32 = s.astype(np.float32)
        np.divide(c, s32[..., None], out=t)
        np.rint(t, out=d)
        d += z[..., None]
        np.clip(d, 0, 15, out=d)
        d -= z[..., None]
        d -= t
        err = np.einsum("rgk,rgk->rg", d, d) * (s32 * s32)
        if best_err is None:
            best_err, best_s, best_z = err, s, z
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s, best_z = np.where(better, s, best_s), np.where(better, z, best_z)
    np.divide(c, best_s.astype(np.float32)[..., None], out=t)
    np.rint(t, out=t)
    t += best_z[..., None]
    np.clip(t, 0, 15, out=t)
    return _pack_codes(t.reshape(r, k)), best_s, best_z.astype(np.uint8)


def quantize_int4_asym(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] float -> (packed uint8 [N, K/2] of unsigned codes, scale float16 [N, K/group], zero uint8
    [N, K/group]) with w ~= (code - zero) * scale. Per group the range r * [min(w, 0), max(w, 0)] is cut
    into 15 steps (s = r (hi - lo) / 15 in float16), zero = rint(-r lo / s) in [0, 15], code = rint(w / s)
    + zero clamped to [0, 15], for the r in CLIP_RATIOS with the smallest squared error (r = 1: |dequant -
    w| <= s elementwise, s / 2 inside the range; the clamp at its ends costs at most another s / 2 from
    zero's rounding)."""
    n, k = w.shape
    _check_group(k, group)
    packed = np.empty((n, k // 2), np.uint8)
    scale = np.empty((n, k // group), np.float16)
    zero = np.empty((n, k // group), np.uint8)

    def chunk(r0: int, r1: int) -> None:
        packed[r0:r1], scale[r0:r1], zero[r0:r1] = _int4_asym_rows(_rows(w, r0, r1), group)

    _each_chunk(n, k, chunk)
    return packed, scale, zero


def dequantize_int8(wq: np.ndarray, scale: np.ndarray) -> np.ndarray:
    from atlasc.ir.ops.quant import dequant_q8

    return dequant_q8(wq, scale)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group: int, zero: np.ndarray | None = None) -> np.ndarray:
    from atlasc.ir.ops.quant import dequant_q4

    return dequant_q4(packed, scale, group, zero)


def _quantize_layer(w: np.ndarray, mode: str, group: int, seed: int, new_array=np.empty,
                    zero_points: bool = False, hessian: np.ndarray | None = None, on_rows=None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """Quantize w chunk by chunk into arrays from new_array(shape, dtype) (Program.new_array: on disk for
    a compile): (codes, scales, int4 zero points or None, the relative error of x W^T on ERROR_ROWS
    random rows x). int4 with a calibration hessian (--gptq): GPTQ rounding (passes/gptq.py). Each chunk
    (on QUANT_THREADS threads) is read, quantized, stored, dequantized from what was stored and adds its
    terms of the error; the terms are summed in chunk order, so the result does not depend on the
    thread count. on_rows(rows done) reports progress (_each_chunk)."""
    n, k = w.shape
    x = np.random.default_rng(seed).standard_normal((ERROR_ROWS, k)).astype(np.float32)
    zero = None
    if mode == "int8":
        wq, scale = new_array((n, k), np.int8), new_array((n,), np.float16)
    elif mode == "fp8":
        wq, scale = new_array((n, k), np.uint8), new_array((n,), np.float16)
    else:
        _check_group(k, group)
        wq, scale = new_array((n, k // 2), np.uint8), new_array((n, k // group), np.float16)
        if zero_points:
            zero = new_array((n, k // group), np.uint8)

    def chunk(r0: int, r1: int) -> tuple[float, float]:
        c = _rows(w, r0, r1)
        z = None
        if mode == "int8":
            q, s = _int8_rows(c)
            deq = dequantize_int8(q, s)
        elif mode == "fp8":
            q, s = _fp8_rows(c)
            deq = dequant_f8(q, s)
        else:
            if hessian is not None:
                codes, s, z = gptq_int4(c, hessian, group, zero is not None, CLIP_RATIOS, _scale16)
                q = pack_int4(codes if z is None else codes.astype(np.int16) - 8)
            elif zero is not None:
                q, s, z = _int4_asym_rows(c, group)
            else:
                q, s = _int4_rows(c, group)
            if z is not None:
                zero[r0:r1] = z
            deq = dequantize_int4(q, s, group, z)
        wq[r0:r1], scale[r0:r1] = q, s
        y = x @ c.T
        return (float(np.sum(np.square((y - x @ deq.T).astype(np.float64)))),
                float(np.sum(np.square(y.astype(np.float64)))))

    terms = _each_chunk(n, k, chunk, GPTQ_CHUNK_ELEMENTS if hessian is not None else None, on_rows)
    num = sum(t[0] for t in terms)
    den = sum(t[1] for t in terms)
    return wq, scale, zero, float(np.sqrt(num / den)) if den > 0 else 0.0


def _import_prequantized(graph: Graph, stats: RewriteStats) -> None:
    """MatMul(x, DequantizeLinear(q, s[, zp])) => LinearQ4 / LinearQ8 on the stored integers."""
    producers = graph.producers()
    for node in list(graph.nodes):
        if node.op != "MatMul" or len(node.inputs[1].shape) != 2:
            continue
        dq = producers.get(id(node.inputs[1]))
        if dq is None or dq.op != "DequantizeLinear":
            continue
        q_v, s_v = dq.inputs[0], dq.inputs[1]
        zp_v = dq.inputs[2] if len(dq.inputs) > 2 else None
        x = node.inputs[0]
        if x.dtype != s_v.dtype:
            raise ShapeError(f"node '{node.name}': MatMul of {x.dtype} by a DequantizeLinear to {s_v.dtype}")
        q = q_v.data.astype(np.int32)
        k, n = q.shape
        axis, block = dq.attrs["axis"] % 2, int(dq.attrs["block_size"])
        scale = s_v.data.astype(np.float16)
        new = None
        if block > 0 and axis == 0 and k % block == 0 and block % 2 == 0 and scale.shape == (k // block, n):
            # int4 (stored as int8, codes q + 8) or uint4 (stored as uint8, codes q): w = (code - zero) * s
            lo = 0 if q_v.dtype == "uint8" else -8
            codes = q - lo
            if zp_v is not None and zp_v.data.size != 1 and tuple(zp_v.data.shape) != scale.shape:
                raise ShapeError(f"node '{dq.name}': DequantizeLinear zero point {list(zp_v.data.shape)} does not "
                                 f"match its scale {list(scale.shape)}")
            zp = np.zeros(scale.shape, np.int32) if zp_v is None else np.broadcast_to(
                zp_v.data.astype(np.int32), scale.shape)
            zero = zp - lo
            if codes.min() >= 0 and codes.max() <= 15 and zero.min() >= 0 and zero.max() <= 15:
                wq = constant(f"{q_v.name}__q4", pack_int4(codes.T - 8))
                sc = constant(f"{s_v.name}__scale", np.ascontiguousarray(scale.T))
                ins = [x, wq, sc]
                if np.any(zero != 8):  # asymmetric: LinearQ4(x, wq, scale, None, zero)
                    ins += [None, constant(f"{q_v.name}__zero", np.ascontiguousarray(zero.T.astype(np.uint8)))]
                new = Node("LinearQ4", ins, list(node.outputs), {"group_size": block}, name=node.name)
        if new is None:
            if zp_v is not None and np.unique(zp_v.data).size != 1:
                raise ShapeError(f"node '{dq.name}': DequantizeLinear with per-channel zero points (asymmetric) "
                                 "is supported for int4 blocked along K only", hint="export int8 symmetric")
            q8 = q - (0 if zp_v is None else int(np.unique(zp_v.data)[0]))
            if block == 0 and axis == 1 and scale.shape == (n,) and q8.min() >= -128 and q8.max() <= 127:
                wq = constant(f"{q_v.name}__q8", np.ascontiguousarray(q8.T.astype(np.int8)))
                new = Node("LinearQ8", [x, wq, constant(f"{s_v.name}__scale", scale)], list(node.outputs), {},
                           name=node.name)
            else:
                raise ShapeError(f"node '{dq.name}': DequantizeLinear weight (axis {axis}, block_size {block}, "
                                 f"values {q.min()}..{q.max()}) is not int4 blocked along K nor int8 per output "
                                 "channel", hint="those are the pre-quantized layouts atlasc maps to its kernels")
        graph.nodes[graph.nodes.index(node)] = new
        rule = "MatMul(x, DequantizeLinear(q, s)) => LinearQ4/Q8 (stored integers)"
        stats.applied[rule] = stats.applied.get(rule, 0) + 1
    graph.cleanup()
    left = [n.name for n in graph.nodes if n.op == "DequantizeLinear"]
    if left:
        raise ShapeError(f"DequantizeLinear '{left[0]}' is not the weight of a MatMul: only quantized MatMul "
                         "weights are supported")


def skipped_by(node: Node, patterns: tuple[str, ...]) -> str | None:
    """The first --quant-skip pattern matching the Linear node's weight, node or output name (None: quantized)."""
    names = (node.inputs[1].name, node.name, node.outputs[0].name)
    for p in patterns:
        if any(fnmatch.fnmatchcase(s, p) for s in names):
            return p
    return None


def _check_skip_patterns(program: Program, patterns: tuple[str, ...]) -> None:
    """UsageError naming the --quant-skip patterns that match no Linear's weight, node or output name (a typo
    would otherwise quantize the layer it meant to keep, silently)."""
    linears = [n for g in program.entries.values() for n in g.nodes if n.op == "Linear"]
    unused = [p for p in patterns if not any(skipped_by(n, (p,)) for n in linears)]
    if unused:
        raise UsageError(f"--quant-skip {', '.join(unused)} matches no linear layer's weight, node or output name",
                         hint=f"{len(linears)} linear layers, e.g. {', '.join(n.name for n in linears[:3])} (the "
                              "layer table of `atlasc inspect X.atlas` of a quantized build lists them)")


def _gptq_hessians(program: Program, candidates: list[Node]) -> dict[int, np.ndarray]:
    """id(weight) -> calibration H of the int4 candidates (passes/gptq.py); UsageError without --calib."""
    opts = program.options
    if opts.quant != "int4" or not opts.calib:
        raise UsageError("--gptq needs --quant int4 and --calib (the calibration prompts it minimizes the "
                         "layers' output error on)", hint="e.g. --quant int4 --gptq --calib text.npz")
    say = program.progress or (lambda stage, detail, done=None: None)
    hessians: dict[int, np.ndarray] = {}
    for graph in program.entries.values():
        nodes = [n for n in candidates if any(n is m for m in graph.nodes)]
        if nodes:
            say("quantize", f"gptq: float activations of {len(nodes)} layers on {opts.calib}")
            feeds = load_feeds(opts.calib, graph, opts.max_seq)
            hessians.update(calibration_hessians(graph, nodes, feeds, opts.max_batch))
    return hessians


def quantize(program: Program) -> tuple[Program, RewriteStats]:
    """Replace every eligible Linear by LinearQ8 / LinearQ4 (see the module docstring)."""
    stats = RewriteStats()
    opts = program.options
    mode = opts.quant
    if mode not in MODES:
        raise UsageError(f"--quant must be one of {', '.join(MODES)}, not {mode}")
    for graph in program.entries.values():
        _import_prequantized(graph, stats)
    group = int(opts.group_size)
    if mode == "int4" and (group < 2 or group % 2):
        raise UsageError(f"--group-size must be an even number >= 2, not {group}")
    op = {"int8": "LinearQ8", "int4": "LinearQ4", "fp8": "LinearF8"}.get(mode, "")
    rule = f"Linear(x, W) => {op}(x, Wq, scale)"
    if mode == "none":
        return program, stats
    if mode == "fp8":
        old = [a for a in opts.archs if int(a[2:]) < FP8_MIN_ARCH]
        if old:
            raise UsageError(f"--quant fp8 needs sm89 or newer (FP8 E4M3); --arch has {', '.join(old)}",
                             hint="compile those archs with --quant int8 (same size), or drop them from --arch")
    candidates = []
    skipped, not_divided = 0, []  # layers --quant-skip keeps, K of those the group size does not divide
    for graph in program.entries.values():
        for node in graph.nodes:
            if node.op != "Linear":
                continue
            w = node.inputs[1]
            where = f"{rule} at {node.name}"
            if not w.is_constant or w.dtype not in ("float16", "float32") or len(w.shape) != 2:
                stats.declined[where] = "the weight is not a 2-D float constant"
                continue
            pattern = skipped_by(node, opts.quant_skip)
            if pattern is not None:
                stats.declined[where] = f"skipped by --quant-skip {pattern}"
                skipped += 1
                continue
            candidates.append(node)
    _check_skip_patterns(program, opts.quant_skip)
    if mode == "int4" and candidates and all(n.inputs[1].shape[1] % group for n in candidates):
        ks = sorted({int(n.inputs[1].shape[1]) for n in candidates})
        raise UsageError(f"--group-size {group} divides no linear layer's K (K: {', '.join(map(str, ks))})",
                         hint="pick a group size that divides K, e.g. 32, 64 or 128")
    zero_points = mode == "int4" and opts.zero_points
    hessians = _gptq_hessians(program, candidates) if opts.gptq else {}
    made: dict[int, tuple] = {}  # id(W) -> (wq, scale, zero or None, layer record): shared weights once
    layers = []
    say = program.progress or (lambda stage, detail, done=None: None)
    total_bytes = sum({id(n.inputs[1]): n.inputs[1].data.nbytes for n in candidates}.values())
    done_bytes = 0
    for node in candidates:
        w = node.inputs[1]
        k = int(w.shape[1])
        if mode == "int4" and k % group:
            stats.declined[f"{rule} at {node.name}"] = f"group size {group} does not divide K = {k}"
            not_divided.append(k)
            continue
        if id(w) not in made:
            say("quantize", f"{mode} {w.name}", (done_bytes, total_bytes, "bytes"))
            row_bytes, before = w.data.nbytes // max(1, int(w.shape[0])), done_bytes

            def on_rows(rows: int) -> None:  # a large weight (an 8B model's LM head: 1 GB) shows its progress
                say("quantize", f"{mode} {w.name}", (before + rows * row_bytes, total_bytes, "bytes"))

            wq, scale, zero, err = _quantize_layer(w.data, mode, group, seed=len(made), new_array=program.new_array,
                                                   zero_points=zero_points, hessian=hessians.get(id(w)),
                                                   on_rows=on_rows)
            done_bytes += w.data.nbytes
            extra = 0 if zero is None else zero.nbytes
            rec = {"layer": node.name, "weight": w.name, "shape": [int(w.shape[0]), k], "rel_error": err,
                   "bytes_before": int(w.data.nbytes), "bytes_after": int(wq.nbytes + scale.nbytes + extra)}
            tag = "f8" if mode == "fp8" else f"q{mode[3:]}"
            zero_v = None if zero is None else constant(f"{w.name}__zero", zero)
            made[id(w)] = (constant(f"{w.name}__{tag}", wq), constant(f"{w.name}__scale", scale), zero_v, rec)
            layers.append(rec)
        wq_v, scale_v, zero_v, _ = made[id(w)]
        program.float_weights[node.name] = w  # for the end-to-end accuracy report (atlasc/accuracy.py)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        ins = [node.inputs[0], wq_v, scale_v] + ([bias] if bias is not None or zero_v is not None else [])
        if zero_v is not None:
            ins.append(zero_v)  # LinearQ4(x, wq, scale, bias or None, zero)
        if mode in ("int8", "fp8"):
            node.op, node.inputs, node.attrs = op, ins, {}
        else:
            node.op, node.inputs, node.attrs = "LinearQ4", ins, {"group_size": group}
        stats.applied[rule] = stats.applied.get(rule, 0) + 1
    before = sum(r["bytes_before"] for r in layers)
    after = sum(r["bytes_after"] for r in layers)
    program.quantization = {
        "mode": mode, "group_size": group if mode == "int4" else None, "skip": list(opts.quant_skip),
        **({"zero_points": True} if zero_points else {}),
        **({"gptq": {"calib": opts.calib, "layers": len(hessians)}} if opts.gptq else {}),
        **({"smooth": program.smoothing} if program.smoothing else {}),
        "layers": layers, "bytes_before": before, "bytes_after": after,
        "max_rel_error": max((r["rel_error"] for r in layers), default=0.0),
        "declined": {k.split(" at ", 1)[1]: v for k, v in stats.declined.items()},
        # the layers left in float: K of each the group size does not divide, how many --quant-skip kept
        "kept_float": {"group_size_k": sorted(not_divided), "quant_skip": skipped},
    }
    return program, stats
