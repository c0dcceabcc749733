"""examples/chain_lab.py without a GPU: the chunk layout puts every row's group where chain_lab.cu reads it, the
phase input is the SwiGLU (or the int8 codes) the kernel stages, the kernels compile for sm_90a without spills, and
bad options fail before any device work. (The lab's numpy check uses the compiler's dequant_q4.)"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import chain_lab  # noqa: E402


def test_chunks_hold_each_rows_group_bytes_then_its_scale():
    """Chunk (tile, group) at (tile * groups + group) * CHUNK: row r's 64 packed bytes at r * 64, its scale at
    16 W * 64 + 2 r (chain_lab.cu's reads), for fresh random codes and scales."""
    rng = np.random.default_rng()
    w = 2
    rows, n, k = 16 * w, 3 * 16 * w, 3 * 128
    wq = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.standard_normal((n, k // 128)).astype(np.float16)
    flat = chain_lab.chunked(wq, scale, rows)
    size = chain_lab.chunk_bytes(w)
    assert flat.size == (n // rows) * (k // 128) * size
    for tile in range(n // rows):
        for grp in range(k // 128):
            chunk = flat[(tile * (k // 128) + grp) * size:][:size]
            for r in (0, 7, rows - 1):
                np.testing.assert_array_equal(chunk[r * 64:(r + 1) * 64], wq[tile * rows + r, grp * 64:(grp + 1) * 64])
                got = chunk[rows * 64 + 2 * r:][:2].view(np.float16)[0]
                assert got == scale[tile * rows + r, grp]


def test_phase_input_is_the_swiglu_of_the_two_halves():
    rng = np.random.default_rng()
    prev = rng.standard_normal(16).astype(np.float32)
    np.testing.assert_array_equal(chain_lab.phase_input(prev, 8, False), prev[:8].astype(np.float16))
    a, b = prev[:8].astype(np.float64), prev[8:].astype(np.float64)
    np.testing.assert_allclose(chain_lab.phase_input(prev, 8, True).astype(np.float64), a / (1 + np.exp(-a)) * b,
                               rtol=1e-3, atol=1e-3)


def test_int8_phase_input_is_per_group_codes_times_scale():
    """x_q * s with s = max |x| / 127 per group of 128: within half a step of x, the group's max exact."""
    rng = np.random.default_rng()
    prev = rng.standard_normal(512).astype(np.float32)
    got = chain_lab.phase_input(prev, 256, False, int8=True)
    for g in range(2):
        x = prev[128 * g:128 * (g + 1)]
        s = np.abs(x).max() / 127
        assert np.abs(got[128 * g:128 * (g + 1)] - x).max() <= 0.5 * s * (1 + 1e-6)
        assert np.isclose(np.abs(got[128 * g:128 * (g + 1)]).max(), np.abs(x).max(), rtol=1e-6)


def test_kernels_compile_without_spills(capsys):
    from atlasc.codegen.nvcc import NvccNotFoundError, nvcc_path

    try:
        nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert chain_lab.main(["--ptxas"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"Compiling entry function 'chain_\d+_\d+_[01]_[01]_[01]'", out)) == len(chain_lab.CONFIGS)
    assert "spill" in out and not re.search(r"[1-9]\d* bytes spill", out)


@pytest.mark.parametrize("argv", [["--modes", "fused"], ["--layers", "0"], ["--configs", "32-4"],
                                  ["--configs", "16-16"], ["--configs", "8-1"], ["--configs", "8-4-x"],
                                  ["--configs", "8-4-ii"], ["--configs", "8-4-"],
                                  ["--configs", "8-4-oa"], ["--configs", "16-8", "--inflight", "8"],
                                  ["--configs", "16-8", "--inflight", "-1"], ["--inflight", "two"],
                                  ["--attn", "1"], ["--attn", "1025"], ["--attn-hold"], ["--attn-prefetch"]])
def test_bad_options_exit_before_the_device(argv):
    with pytest.raises(SystemExit) as e:
        chain_lab.main(argv)
    assert e.value.code not in (0, None)


def test_phase_table_matches_the_kernel_struct():
    """chain_lab.cu's Phase: 8 eight-byte offsets and 6 ints, 80 bytes, in this order."""
    assert chain_lab.PHASE_DTYPE.itemsize == 80
    assert chain_lab.PHASE_DTYPE.names == ("w", "inp", "out", "K", "N", "gated", "norm", "out2", "ready", "hin", "hout",
                                           "attn", "ctx")
    assert chain_lab.PHASE_DTYPE.fields["out2"][1] == 40


def test_normed_is_the_residual_sum_and_its_rms_norm():
    rng = np.random.default_rng()
    h_prev, acc = rng.standard_normal(256).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    h, x = chain_lab.normed(h_prev, acc)
    np.testing.assert_array_equal(h, h_prev + acc)
    np.testing.assert_allclose(np.sqrt(np.mean(x.astype(np.float64) ** 2)), 1.0, rtol=1e-5)
    np.testing.assert_allclose(x * np.sqrt(np.mean(h.astype(np.float64) ** 2) + chain_lab.EPS), h, rtol=1e-5)


def test_attention_reference_is_gqa_softmax_with_the_new_row():
    """chain_lab.attention against a per-head loop: query head i reads KV head i // 4, the caches' last row replaced by
    the new key / value rounded to float16, fresh random inputs."""
    rng = np.random.default_rng()
    ctx = 5
    qkv = rng.standard_normal(6144).astype(np.float32)
    kc, vc = (rng.standard_normal((8, ctx, 128)).astype(np.float16) for _ in range(2))
    got = chain_lab.attention(qkv, kc, vc).reshape(32, 128)
    for i in range(32):
        h = i // 4
        k = kc[h].astype(np.float64)
        v = vc[h].astype(np.float64)
        k[-1] = qkv[4096 + 128 * h:4096 + 128 * (h + 1)].astype(np.float16)
        v[-1] = qkv[5120 + 128 * h:5120 + 128 * (h + 1)].astype(np.float16)
        s = k @ qkv[128 * i:128 * (i + 1)].astype(np.float64) / np.sqrt(128)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(got[i], (w / w.sum()) @ v, rtol=1e-4, atol=1e-5)
    kc0 = kc.copy()
    chain_lab.attention(qkv, kc, vc)
    np.testing.assert_array_equal(kc, kc0)  # the caches are not written


def test_layer_phases_with_attention():
    assert chain_lab.layer_names(True) == ["QKV", "attention", "o", "gate/up", "down"]
    assert [k for k, _, _ in chain_lab.layer_shapes(True)] == [4096, 0, 4096, 4096, 14336]
    assert len(chain_lab.layer_shapes(False)) == len(chain_lab.layer_names(False)) == 4


@pytest.mark.parametrize("ctx,runs", [(256, 16), (5, 16), (37, 3), (2, 1)])
def test_attention_runs_merge_to_the_whole(ctx, runs):
    """chain_lab.cu's split (a partial per KV head and run of keys, some runs empty when ctx < runs) merged at o's
    staging gives the attention over all keys, fresh random inputs."""
    rng = np.random.default_rng()
    qkv = (3 * rng.standard_normal(6144)).astype(np.float32)
    kc, vc = (rng.standard_normal((8, ctx, 128)).astype(np.float16) for _ in range(2))
    parts = chain_lab.attention_partials(qkv, kc, vc, runs)
    assert parts.shape == (8, runs, chain_lab.PART)
    assert np.isneginf(parts[:, :, 512:516]).any() == (-(-ctx // runs) * (runs - 1) >= ctx)
    np.testing.assert_allclose(chain_lab.merge_partials(parts), chain_lab.attention(qkv, kc, vc), rtol=1e-4,
                               atol=1e-5)


def test_attention_runs_fill_the_grid():
    assert chain_lab.attention_runs(132) == 16 and chain_lab.attention_runs(8) == 1
    assert chain_lab.attention_runs(1000) == 32  # chain_lab.cu RUNS_MAX: a lane per run in the merge
