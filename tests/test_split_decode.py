"""split-decode: a `--max-batch` above 8 still gets the fused decode for small batches (decode_small),
the artifact marks the twin, and both runtimes route decode calls of at most 8 sequences to it."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import PIPELINES, run_pipeline
from atlasc.passes.split_decode import SMALL, SMALL_BATCH

from conftest import FIXTURES
from fake_gpu import FakeDevice

FUSED = ("NormLinear", "NormLinearQ", "NormLinearRotary")


def _program(max_batch: int, fusion: bool = True, name: str = "llama-fp16"):
    names = PIPELINES["default"]
    options = CompileOptions(archs=("sm90",), max_batch=max_batch, max_seq=64, fusion=fusion)
    program, report = run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, options),
                                   names[: names.index("schedule")], verify_each=True)
    return program, report


def test_large_max_batch_gets_a_fused_small_decode():
    program, report = _program(16)
    assert list(program.entries) == ["prefill", "decode", SMALL]
    batch = program.roles["batch"]
    assert program.bounds[SMALL][batch] == SMALL_BATCH and program.bounds["decode"][batch] == 16
    assert program.entries[SMALL].symbols[batch].upper == SMALL_BATCH
    assert program.narrows == {SMALL: ("decode", {batch: SMALL_BATCH})}
    wide = Counter(n.op for n in program.entries["decode"].nodes)
    small = Counter(n.op for n in program.entries[SMALL].nodes)
    # the wide entry's only prologues: the copy-engine norms of an sm90-only compile's gate/up projections
    # (tests/test_fuse_linear_prologue.py); the small one fuses every projection's
    copy_engine = [n for n in program.entries["decode"].nodes if n.op == "NormLinear" and n.attrs.get("epilogue")]
    assert sum(wide[op] for op in FUSED) == len(copy_engine), (wide, small)
    assert small["NormLinear"] > wide["NormLinear"] and small["NormLinearRotary"] > 0, (wide, small)
    record = next(r for r in report.records if r.name == "split-decode")
    assert sum(record.applied.values()) == 1


def test_decode_kernels_are_generated_for_batches_above_the_small_one(tmp_path, monkeypatch):
    """With decode_small serving batches up to 8, the compile tells code generation that `decode` runs only
    above 8 (generate_module's `lower`: e.g. attention's warp count and the Linear grids for those batches);
    without split-decode nothing is lower."""
    import atlasc.compiler as compiler

    program, _ = _program(16)
    batch = program.roles["batch"]
    assert compiler.narrowed_lower(program) == {"decode": {batch: SMALL_BATCH}}
    assert compiler.narrowed_lower(_program(8)[0]) == {}
    # several twins: the largest single-symbol bound; a twin bounding two symbols says nothing of either
    from types import SimpleNamespace

    twins = {"a": ("decode", {"batch": 4}), "b": ("decode", {"batch": 8}), "c": ("decode", {"batch": 16, "s": 2})}
    assert compiler.narrowed_lower(SimpleNamespace(narrows=twins)) == {"decode": {"batch": 8}}
    class Seen(Exception):  # stops the compile at code generation: no nvcc needed
        pass

    def record(*args, **kwargs):
        raise Seen(args[5])

    monkeypatch.setattr(compiler, "generate_module", record)
    with pytest.raises(Seen) as seen:
        compiler.compile_model(FIXTURES / "llama-fp16.onnx", tmp_path / "b16.atlas",
                               CompileOptions(archs=("sm90",), max_batch=16, max_seq=64))
    assert seen.value.args[0] == {"decode": {batch: SMALL_BATCH}} and not (tmp_path / "b16.atlas").exists()


@pytest.mark.parametrize("max_batch,fusion", [(8, True), (4, True), (16, False)])
def test_no_small_decode_when_it_would_not_differ(max_batch, fusion):
    program, _ = _program(max_batch, fusion)
    assert SMALL not in program.entries and not program.narrows


def test_split_decode_switch(monkeypatch):
    from atlasc.errors import UsageError

    monkeypatch.setenv("ATLAS_SPLIT_DECODE", "0")
    program, report = _program(16)
    assert SMALL not in program.entries
    record = next(r for r in report.records if r.name == "split-decode")
    assert "ATLAS_SPLIT_DECODE=0" in record.declined.values()
    monkeypatch.setenv("ATLAS_SPLIT_DECODE", "yes")
    with pytest.raises(UsageError, match="ATLAS_SPLIT_DECODE='yes'"):
        _program(16)


def test_small_decode_computes_what_decode_computes():
    """On the reference interpreter the two entries agree on a batch both serve (the fused ops are
    bit-identical to the ops they replace)."""
    from test_fuse_linear_prologue import _decode

    program, _ = _program(16)
    got, cache_got = _decode(program.entries[SMALL], program, "llama-fp16")
    want, cache_want = _decode(program.entries["decode"], program, "llama-fp16")
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(cache_got, cache_want)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_artifact_routes_small_batches_to_the_twin(tmp_path, cli, no_nvcc, monkeypatch):
    """compile_model with --max-batch 16: the manifest's decode_small narrows decode to batch <= 8,
    bind_call picks it for 2 sequences and decode for 12, and greedy generation on the CPU runtime
    gives the tokens of a --max-batch 4 build (no twin) at batch 2 and of decode itself at batch 12
    (ATLAS_TMA_NORM=0: the copy-engine norms' fold would round the --max-batch 16 build's weights differently)."""
    monkeypatch.setenv("ATLAS_TMA_NORM", "0")
    from atlasc.artifact import open_artifact
    from atlasc.compiler import compile_model
    from atlasc.runtime.bind import bind_call
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.generate import generate

    wide_path, narrow_path = tmp_path / "b16.atlas", tmp_path / "b4.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", wide_path, CompileOptions(archs=("sm90",), max_batch=16, max_seq=64))
    compile_model(FIXTURES / "llama-fp16.onnx", narrow_path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    with open_artifact(wide_path) as wide, open_artifact(narrow_path) as narrow:
        m = wide.manifest
        twin = m.entries[SMALL]
        assert twin.narrows == "decode" and list(twin.narrow_upper.values()) == [SMALL_BATCH]
        assert m.entries["decode"].narrows == "" and SMALL not in narrow.manifest.entries
        # the batch-1 kernels now belong to decode_small; decode serves 9 .. 16 with its defaults
        from atlasc.runtime.launches import entry_buckets

        assert entry_buckets(twin)[1] == (1,) and entry_buckets(m.entries["decode"])[1] == ()
        model = CpuModel(wide)
        for b, want in ((2, SMALL), (8, SMALL), (12, "decode")):
            feeds = {"input_ids": np.ones((b, 1), np.int64), "position_ids": np.zeros((b, 1), np.int64),
                     "attention_mask": np.ones((b, 4), np.int64), "sample_params": np.array([0, 1, 0], np.float32),
                     "sample_state": np.zeros(3, np.int64)}
            feeds = {k: v for k, v in feeds.items() if k in {i.name for i in m.entries["decode"].inputs}}
            name, env = bind_call(m, "decode", feeds, {"past_seq": 3}, model.bounds)
            assert name == want and env["batch"] == b
        prompts = [[5, 17, 42, 7, 99], [3, 8]]
        assert generate(model, prompts, 12).tokens == generate(CpuModel(narrow), prompts, 12).tokens
        many = [[(7 * i + j) % 50 + 1 for j in range(3 + i % 4)] for i in range(12)]
        got = generate(model, many, 6).tokens
        assert len(got) == 12
    # `atlasc inspect` says which entry runs which calls
    r = cli("inspect", wide_path, "--json")
    assert r.code == 0, r
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["entries"][SMALL]["narrows"] == "decode" and report["entries"]["decode"]["narrows"] is None
    r = cli("inspect", wide_path)
    assert r.code == 0 and "runs decode for" in r.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_gpu_runtime_routes_small_batches_to_the_twin(tmp_path, no_nvcc):
    """GpuModel (on a fake device: launches recorded, no GPU) runs decode_small's kernels for a decode call
    of 3 sequences and decode's for 12, whatever entry name the caller uses."""
    from atlasc.artifact import open_artifact
    from atlasc.compiler import compile_model
    from atlasc.runtime.gpu import GpuModel

    path = tmp_path / "b16.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(archs=("sm90",), max_batch=16, max_seq=64))
    dev = FakeDevice()
    model = GpuModel(open_artifact(path), device=dev, cuda_graphs=False)
    m = model.manifest
    for b, want in ((3, SMALL), (12, "decode")):
        feeds = {"input_ids": np.ones((b, 1), np.int64), "position_ids": np.zeros((b, 1), np.int64),
                 "attention_mask": np.ones((b, 4), np.int64), "sample_params": np.array([0, 1, 0], np.float32),
                 "sample_state": np.zeros(3, np.int64)}
        dev.launched.clear()
        out = model.run("decode", feeds, {"past_seq": 3})
        assert model.routed["decode"] == want
        kernels = {n.kernel for n in m.entries[want].nodes if n.kernel} | \
            {v.kernel for n in m.entries[want].nodes for v in n.variants}
        assert dev.launched and set(dev.launched) <= kernels
        assert set(out) == {o.name for o in m.entries[want].outputs}
