"""Linear: y[..., N] = x[..., K] @ w[N, K]^T (+ bias[N]), the fused projection.

The weight is stored transposed against ONNX MatMul's [K, N] (one row per output feature), so a
decode GEMV reads contiguous rows. Numerics match `MatMul` / `Gemm` exactly: float16 accumulates in
float32, the bias is added in float32, and the result is rounded once.
"""

from __future__ import annotations

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


LINEAR_REF_CHUNK = 1 << 24  # weight elements converted to float32 at a time (an LM head is ~1 GB)


def _linear_ref(ins, attrs):
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    if x.dtype == np.float16:  # accumulate in float32, add the bias in float32, round once
        xf = x.astype(np.float32)
        n, k = w.shape
        y = np.empty(x.shape[:-1] + (n,), np.float32)
        step = max(1, LINEAR_REF_CHUNK // max(1, k))  # float32 copies of W a block of rows at a time
        for r0 in range(0, n, step):
            y[..., r0:r0 + step] = np.matmul(xf, w[r0:r0 + step].astype(np.float32).T)
        if bias is not None:
            y = y + bias.astype(np.float32)
        return [y.astype(np.float16)]
    y = np.matmul(x, w.T)
    if bias is not None:
        y = y + bias
    return [y]


register("Linear", inputs=(2, 3), kind="opaque", infer=_linear_infer, reference=_linear_ref,
         doc="x[..., K] @ w[N, K]^T (+ bias[N]); fp16 accumulates in float32 and rounds once")
