"""The quantize pass's row chunks run on QUANT_THREADS threads (passes/quantize.py): the codes, scales, zero
points and the recorded relative error are the same, bit for bit, whatever the thread count, and the codes
do not depend on the chunk size either (the clipping search's ties are broken the same way)."""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes import quantize as q

MODES = [("int4", False), ("int4", True), ("int8", False), ("fp8", False)]


def _weight(n: int, k: int, transposed: bool) -> np.ndarray:
    """float16 [n, k], as fuse-linear hands it over (a transposed view of [k, n]) or C-contiguous, with an
    all-zero row and a large one among random normal ones."""
    wt = (np.random.default_rng(7).standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float16)
    wt[:, 3] = 0
    wt[:, 5] *= 100
    return wt.T if transposed else np.ascontiguousarray(wt.T)


def _layer(monkeypatch, w, mode, zero_points, threads, chunk=32 * 256, hessian=None):
    monkeypatch.setattr(q, "QUANT_THREADS", threads)
    monkeypatch.setattr(q, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(q, "GPTQ_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(q, "CHUNK_MIN_ROWS", 1)
    return q._quantize_layer(w, mode, 32, seed=1, zero_points=zero_points, hessian=hessian)


def _same(a, b) -> None:
    for x, y in zip(a[:3], b[:3]):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("mode,zero_points", MODES)
def test_layer_is_the_same_on_one_and_several_threads(monkeypatch, mode, zero_points, transposed):
    w = _weight(200, 256, transposed)  # 32-row chunks: 7 of them, the last short
    one = _layer(monkeypatch, w, mode, zero_points, threads=1)
    for threads in (2, 3, 16):
        many = _layer(monkeypatch, w, mode, zero_points, threads)
        _same(one, many)
        assert many[3] == one[3]  # the error terms are summed in chunk order
    assert 0 < one[3] < 0.2


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("mode,zero_points", MODES)
def test_codes_do_not_depend_on_the_chunk_size(monkeypatch, mode, zero_points, transposed):
    w = _weight(200, 256, transposed)
    small = _layer(monkeypatch, w, mode, zero_points, threads=2)
    whole = _layer(monkeypatch, w, mode, zero_points, threads=1, chunk=1 << 22)  # one chunk
    _same(small, whole)
    # float32 matmuls of other shapes (BLAS blocks them differently) and float64 sums in another grouping
    assert small[3] == pytest.approx(whole[3], rel=1e-6)


def test_gptq_layer_is_the_same_on_one_and_several_threads(monkeypatch):
    w = _weight(100, 64, True)
    x = np.random.default_rng(2).standard_normal((256, 64)).astype(np.float32)
    h = x.T @ x  # a calibration hessian (passes/gptq.py)
    one = _layer(monkeypatch, w, "int4", False, threads=1, chunk=32 * 64, hessian=h)
    many = _layer(monkeypatch, w, "int4", False, threads=3, chunk=32 * 64, hessian=h)
    _same(one, many)
    assert many[3] == one[3]


@pytest.mark.parametrize("fn", ["quantize_int4", "quantize_int4_asym", "quantize_int8", "quantize_fp8"])
def test_quantizers_are_the_same_on_one_and_several_threads(monkeypatch, fn):
    w = _weight(200, 256, True)
    monkeypatch.setattr(q, "CHUNK_ELEMENTS", 32 * 256)
    monkeypatch.setattr(q, "CHUNK_MIN_ROWS", 1)
    args = (32,) if fn.startswith("quantize_int4") else ()
    monkeypatch.setattr(q, "QUANT_THREADS", 1)
    one = getattr(q, fn)(w, *args)
    monkeypatch.setattr(q, "QUANT_THREADS", 4)
    many = getattr(q, fn)(w, *args)
    assert all(np.array_equal(a, b) for a, b in zip(one, many))
