"""Linear: y[..., N] = x[..., K] @ w[N, K]^T (+ bias[N]), the fused projection.

The weight is stored transposed against ONNX MatMul's [K, N] (one row per output feature), so a
decode GEMV reads contiguous rows. Numerics match `MatMul` / `Gemm` exactly: float16 accumulates in
float32, the bias is added in float32, and the result is rounded once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.ops.common import same_dtype
from atlasc.ir.ops.registry import DimMismatch, TensorType, register


def _linear_infer(ins, attrs):
    dt = same_dtype(ins, "Linear")
    if dt not in ("float32", "float16"):
        raise ShapeError(f"Linear: dtype {dt} (supported: float32, float16)")
    x, w = ins[0].shape, ins[1].shape
    if len(x) < 1:
        raise ShapeError("Linear: x must have rank >= 1")
    if len(w) != 2:
        raise ShapeError(f"Linear: w must be [N, K], got rank {len(w)}")
    if x[-1] != w[1]:
        raise DimMismatch(x[-1], w[1], "Linear: inner ")
    if len(ins) > 2 and ins[2] is not None:
        b = ins[2].shape
        if len(b) != 1:
            raise ShapeError(f"Linear: bias must be [N], got rank {len(b)}")
        if b[0] != w[0]:
            raise DimMismatch(b[0], w[0], "Linear: bias ")
    return [TensorType(dt, tuple(x[:-1]) + (w[0],))]


REF_CHUNK_ELEMENTS = 1 << 24  # weight elements made float32 at a time by the references (an LM head is ~1 GB)
# blocks of a big weight made float32 (and multiplied) at once: numpy releases the GIL in the conversion,
# which at decode-sized x costs more than the product (an 8B compile's accuracy report: minutes)
REF_THREADS = max(1, min(4, os.cpu_count() or 1))  # each holds a 64 MB float32 block and its temporaries


def matmul_rows(x: np.ndarray, rows, n: int, k: int, bias) -> np.ndarray:
    """x @ W^T (+ bias) accumulated in float32, rounded once to x's dtype; W [N, K] is given as
    `rows(r0, r1)`, its float32 rows r0..r1, and made a block of rows at a time (no whole float32 copy;
    up to REF_THREADS blocks at once, each output column computed by exactly one block)."""
    xf = x.astype(np.float32)
    y = np.empty(x.shape[:-1] + (n,), np.float32)
    step = max(1, REF_CHUNK_ELEMENTS // max(1, k))
    blocks = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]

    def block(r: tuple[int, int]) -> None:
        y[..., r[0]:r[1]] = np.matmul(xf, rows(*r).T)

    if len(blocks) == 1 or REF_THREADS == 1:
        for r in blocks:
            block(r)
    else:
        with ThreadPoolExecutor(min(REF_THREADS, len(blocks))) as pool:
            list(pool.map(block, blocks))
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(x.dtype)


def _linear_ref(ins, attrs):
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    if x.dtype == np.float16:  # accumulate in float32, add the bias in float32, round once
        n, k = w.shape
        return [matmul_rows(x, lambda r0, r1: w[r0:r1].astype(np.float32), n, k, bias)]
    y = np.matmul(x, w.T)
    if bias is not None:
        y = y + bias
    return [y]


register("Linear", inputs=(2, 3), kind="opaque", infer=_linear_infer, reference=_linear_ref,
         doc="x[..., K] @ w[N, K]^T (+ bias[N]); fp16 accumulates in float32 and rounds once")
