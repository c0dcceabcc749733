"""Sample: the next token of every sequence from its last position's logits, on the device.

    tokens[b] = sample(logits[b, -1, :]; temperature, top_k, top_p, seed, step)

Definition (the CUDA kernel implements the same steps; ties and float rounding at a threshold are
the only places the two may disagree):
1. temperature <= 0 or top_k == 1: the argmax (first index of the maximum).
2. z = logits / temperature (float32); p_i = exp(z_i - max z) (unnormalized probabilities).
3. top_k in (0, V): keep p_i >= the k-th largest p (ties at the threshold are kept).
4. top_p in (0, 1): among the kept, keep p_i >= t where t is the smallest p of the shortest
   highest-first prefix whose mass reaches top_p of the kept mass.
5. u = uniform(seed, step, b) in [0, 1) from a counter-based generator (splitmix64 of
   seed + golden * (step * 1024 + b + 1)), and the token is the first kept index i (in index
   order) whose running kept mass exceeds u * (total kept mass).
Inputs: logits [B, S, V] float, params float32[3] = (temperature, top_p, unused),
iparams int64[3] = (seed, step, top_k). Output: int64 [B].
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.ops.registry import TensorType, register

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def uniform(seed: int, step: int, row: int) -> float:
    """The generator of step 5: splitmix64, 53 random bits scaled to [0, 1)."""
    x = (seed + GOLDEN * (step * 1024 + row + 1)) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return (x >> 11) * (1.0 / (1 << 53))


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int,
               row: int) -> int:
    """One row of the definition above (numpy, float32 like the kernel)."""
    v = logits.shape[-1]
    lf = logits.astype(np.float32)
    if temperature <= 0 or top_k == 1:
        return int(np.argmax(lf))
    z = lf / np.float32(temperature)
    p = np.exp(z - z.max()).astype(np.float32)
    keep = np.ones(v, bool)
    if 0 < top_k < v:
        kth = np.partition(p, v - top_k)[v - top_k]
        keep &= p >= kth
    if 0 < top_p < 1:
        kept = np.sort(p[keep])[::-1]
        cum = np.cumsum(kept, dtype=np.float64)
        n = int(np.searchsorted(cum, top_p * cum[-1], side="left"))
        keep &= p >= kept[min(n, kept.size - 1)]
    mass = np.where(keep, p, 0).astype(np.float64)
    total = mass.sum()
    target = uniform(seed, step, row) * total
    idx = int(np.searchsorted(np.cumsum(mass), target, side="right"))
    if idx >= v:  # rounding put the target past the end: the last kept index
        idx = int(np.flatnonzero(keep)[-1])
    return idx


def _sample_infer(ins, attrs):
    logits, fparams, iparams = ins
    if len(logits.shape) != 3 or logits.dtype not in ("float32", "float16"):
        raise ShapeError("Sample: logits must be float [batch, seq, vocab]")
    if fparams.dtype != "float32" or tuple(fparams.shape) != (3,):
        raise ShapeError("Sample: params must be float32[3] (temperature, top_p, unused)")
    if iparams.dtype != "int64" or tuple(iparams.shape) != (3,):
        raise ShapeError("Sample: iparams must be int64[3] (seed, step, top_k)")
    return [TensorType("int64", (logits.shape[0],))]


def _sample_ref(ins, attrs):
    logits, fparams, iparams = ins
    temperature, top_p = float(fparams[0]), float(fparams[1])
    seed, step, top_k = (int(x) for x in iparams)
    out = np.array([sample_row(logits[b, -1], temperature, top_k, top_p, seed, step, b)
                    for b in range(logits.shape[0])], np.int64)
    return [out]


register("Sample", inputs=3, kind="opaque", infer=_sample_infer, reference=_sample_ref,
         doc="Next token per sequence: greedy, temperature, top-k, top-p with a seeded counter-based RNG")
