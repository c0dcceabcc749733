"""weight_prefetch (codegen/generate.py, opt-in ATLAS_PREFETCH=1): which bytes of a projection's weights a
kernel asks L2 to fetch before its pdl_enter, within the budget; only constants, only inside the
weights region, nothing else before the wait but the kernel's dims loads (generate.py DIMS_EARLY)."""

from __future__ import annotations

import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FIXTURES, without_dims_loads

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.codegen.generate import PREFETCH_BUDGET, PREFETCH_MIN_ROW, CodegenError, weight_prefetch
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Value
from atlasc.ir.program import CompileOptions

CALL = re.compile(r"  atlas::prefetch_rows_l2\(arena \+ (\d+)LL, (\d+)LL, (\d+)u, (\d+)\);")


def fake_ctx(offsets: dict[str, int]):
    """The two things weight_prefetch asks of a KernelContext: placements and addresses."""
    plan = SimpleNamespace(placement=lambda v: SimpleNamespace(offset=offsets[v.name]))
    return SimpleNamespace(plan=plan, address=lambda v: f"arena + {offsets[v.name]}LL")


def weight(name: str, shape: tuple, dtype: str = "float16") -> Value:
    return Value(name, dtype, shape, data=np.zeros((1,), np.uint8))  # only shape and dtype are read


def calls(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(map(int, CALL.fullmatch(line).groups())) for line in text.splitlines()]


def on(monkeypatch):
    monkeypatch.setenv("ATLAS_PREFETCH", "1")


def test_a_weight_that_fits_the_budget_is_prefetched_whole(monkeypatch):
    on(monkeypatch)
    w = weight("w", (3072, 2048))  # Llama-3.2-1B merged QKV: 12 MB
    assert calls(weight_prefetch(fake_ctx({"w": 4096}), w)) == [(4096, 4096, 4096, 3072)]


def test_a_big_weight_prefetches_the_first_bytes_of_its_first_rows(monkeypatch):
    on(monkeypatch)
    w = weight("lm_head", (128256, 2048))  # 525 MB: 1 KB of each of the first 16384 rows
    ((off, row_bytes, nbytes, rows),) = calls(weight_prefetch(fake_ctx({"lm_head": 256}), w))
    assert (off, row_bytes, nbytes) == (256, 4096, PREFETCH_MIN_ROW)
    assert rows * nbytes == PREFETCH_BUDGET
    wide = weight("gate_up", (2048, 65536))  # few long rows: the budget spread over all of them
    ((_, row_bytes, nbytes, rows),) = calls(weight_prefetch(fake_ctx({"gate_up": 0}), wide))
    assert rows == 2048 and nbytes == PREFETCH_BUDGET // 2048 and nbytes % 16 == 0


def test_int4_codes_and_their_scales_each_get_a_call(monkeypatch):
    on(monkeypatch)
    wq, scale = weight("wq", (6144, 2048), "uint8"), weight("scale", (6144, 32))
    assert calls(weight_prefetch(fake_ctx({"wq": 0, "scale": 1 << 20}), wq, scale, None)) == [
        (0, 2048, 2048, 6144), (1 << 20, 64, 64, 6144)]


def test_what_is_not_prefetched(monkeypatch):
    """Non-constants (activations may still be being written), rows that are not 16-byte multiples or a
    misaligned array (the bulk prefetch needs 16-byte alignment), symbolic shapes."""
    on(monkeypatch)
    x = Value("x", "float16", (4096, 4096))
    odd = weight("odd", (64, 9))  # 18-byte rows
    moved = weight("moved", (64, 64))
    sym = Value("sym", "float16", (S.sym("n"), 64), data=np.zeros((1,), np.uint8))
    ctx = fake_ctx({"x": 0, "odd": 0, "moved": 8, "sym": 0})
    assert weight_prefetch(ctx, x, odd, moved, sym) == ""


def test_off_by_default(monkeypatch):
    w = weight("w", (64, 64))
    monkeypatch.delenv("ATLAS_PREFETCH", raising=False)
    assert weight_prefetch(fake_ctx({"w": 0}), w) == ""
    monkeypatch.setenv("ATLAS_PREFETCH", "0")
    assert weight_prefetch(fake_ctx({"w": 0}), w) == ""
    for bad in ("yes", "0mb", "49mb", "4 mb", "2"):
        monkeypatch.setenv("ATLAS_PREFETCH", bad)
        with pytest.raises(CodegenError, match="ATLAS_PREFETCH"):
            weight_prefetch(fake_ctx({"w": 0}), w)


def test_a_budget_in_megabytes(monkeypatch):
    """ATLAS_PREFETCH=<n>mb: n MB of each weight instead of PREFETCH_BUDGET (1 KB of each of the first rows)."""
    monkeypatch.setenv("ATLAS_PREFETCH", "4MB")
    w = weight("gate_up", (28672, 4096))  # Llama-3-8B merged gate/up: 235 MB
    ((_, row_bytes, nbytes, rows),) = calls(weight_prefetch(fake_ctx({"gate_up": 0}), w))
    assert (row_bytes, nbytes, rows) == (8192, PREFETCH_MIN_ROW, 4096) and rows * nbytes == 4 << 20
    small = weight("o", (2048, 2048))  # 8 MB: a 4 MB budget takes 2 KB of each row... all rows
    assert calls(weight_prefetch(fake_ctx({"o": 0}), small)) == [(0, 4096, 2048, 2048)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_prefetches_come_before_the_wait_and_stay_in_the_weights(monkeypatch, tmp_path, no_nvcc):
    """In a compiled int4 Llama fixture: the decode projections (float and quantized, fused or not) start
    with prefetches of addresses inside the weights region, then atlas::pdl_enter(); no other kernel
    has anything before the wait but its dims loads (each node its own kernel, whose literal offsets this reads)."""
    on(monkeypatch)
    monkeypatch.setenv("ATLAS_SHARE_KERNELS", "0")
    path = tmp_path / "q.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64,
                                                                quant="int4", group_size=32))
    art = open_artifact(path)
    lines = without_dims_loads(art.source() if callable(art.source) else art.source).splitlines()
    weights = art.manifest.memory.regions["weights"]
    defs = [i for i, line in enumerate(lines) if line.startswith('extern "C" __global__') and line.endswith("{")]
    prefetching = 0
    for i in defs:
        j = i + 1
        while CALL.fullmatch(lines[j]):
            off, row_bytes, nbytes, rows = calls(lines[j])[0]
            assert weights.offset <= off and off + (rows - 1) * row_bytes + nbytes <= weights.offset + weights.nbytes
            j += 1
        prefetching += j > i + 1
        assert lines[j] == "  atlas::pdl_enter();"
    assert prefetching >= 8  # 4 decode projections per layer in the fixture, 2 layers
    assert art.manifest.report["codegen"]["weight_prefetch"] is True
