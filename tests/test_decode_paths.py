"""choose-decode-path's measured table (passes/decode_paths.yaml): well-formed, choices that follow their
numbers, the pass picking from it per arch and rows bucket, the environment overriding it, and the
decision recorded in the artifact (`atlasc inspect`)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys

import pytest

from atlasc.passes import choose_decode_path as cdp

from conftest import FIXTURES, REPO


def test_the_table_is_well_formed_and_its_choices_follow_its_numbers():
    table = cdp.load_table()
    assert cdp.table_problems(table) == []
    sm90 = table["sm90"]
    assert sm90["measured"]["date"] == "2026-11-30" and "examples/quant_lab.py" in sm90["measured"]["command"]
    for quant, (float_path, int8_path) in (("int4", ("w4a16", "w4a8")), ("int8", ("w8a16", "w8a8"))):
        for bucket, m in zip(cdp.BUCKETS, (1, 8)):
            cell = sm90[quant][bucket]
            assert cell["m"] == m and len(cell["us"]) == 7
            assert all(set(row) == {"KxN", float_path, int8_path} for row in cell["us"].values())
            assert cell["choice"] == float_path  # measured on the H200: float activations win every bucket
    bad = copy.deepcopy(table)  # a number edited without its choice
    for row in bad["sm90"]["int8"]["rows 1"]["us"].values():
        row["w8a8"] = 1.0
    problems = cdp.table_problems(bad)
    assert len(problems) == 1 and problems[0].startswith("sm90 int8 rows 1: choice w8a16 but us sums"), problems


def _table(rows1: str, rows8: str) -> dict:
    """A one-arch (sm90) table whose int4 buckets choose rows1 / rows8, with numbers that agree."""
    def cell(m, choice):
        fast, slow = (choice, "w4a8" if choice == "w4a16" else "w4a16")
        return {"m": m, "choice": choice, "us": {"x": {"KxN": "64x64", fast: 1.0, slow: 2.0}}}

    table = {"sm90": {"measured": {"gpu": "test", "date": "2000-01-01", "command": "none"},
                      "int4": {"rows 1": cell(1, rows1), "rows 2..8": cell(8, rows8)},
                      "int8": {b: {"m": 1, "choice": "w8a16", "us": {"x": {"KxN": "64x64", "w8a16": 1.0,
                                                                          "w8a8": 2.0}}} for b in cdp.BUCKETS}}}
    assert cdp.table_problems(table) == []
    return table


def _chosen(monkeypatch, table=None, archs=("sm90",), max_batch=4, env=None, quant="int4", group=32,
            onnx=FIXTURES / "llama-fp16.onnx"):
    """The Llama fixture (int4 g32, or int8; or `onnx`, in groups of `group`) through the pipeline up to
    choose-decode-path, then the pass with
    `table` (None: the repo's) and ATLAS_INT4_PATH / ATLAS_INT8_PATH = env; returns the program and the pass's
    stats."""
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import PIPELINES, run_pipeline

    monkeypatch.delenv("ATLAS_INT4_PATH", raising=False)
    monkeypatch.delenv("ATLAS_INT8_PATH", raising=False)
    names = PIPELINES["default"]
    options = CompileOptions(archs=archs, max_batch=max_batch, max_seq=64, quant=quant, group_size=group)
    program = Program({"main": import_onnx(onnx)}, options)
    program, _ = run_pipeline(program, names[: names.index("choose-decode-path")], verify_each=True)
    if env:
        monkeypatch.setenv("ATLAS_INT4_PATH" if quant == "int4" else "ATLAS_INT8_PATH", env)
    return cdp.choose_decode_path(program, table)


def _acts(program, entry: str = "decode") -> set[str]:
    return {n.attrs.get("act", "") for n in program.entries[entry].nodes if cdp._projection(n)}


def test_the_pass_takes_int8_activations_where_the_table_says_so(monkeypatch):
    program, stats = _chosen(monkeypatch, _table("w4a8", "w4a8"))
    assert _acts(program) == {"int8"} and _acts(program, "prefill") == {""}
    assert sum(stats.applied.values()) == len([n for n in program.entries["decode"].nodes if cdp._projection(n)])
    assert program.decode_paths == {"int4": {"paths": {"rows 1": "w4a8", "rows 2..8": "w4a8"},
                                             "source": "table decode_paths.yaml: sm90 measured 2000-01-01"}}


def test_a_node_needs_every_bucket_it_runs_in(monkeypatch):
    """rows 1 chooses W4A8, rows 2..8 W4A16: a batch <= 4 decode (it also runs batch 1) keeps float
    activations and says why; a batch-1 build takes int8."""
    table = _table("w4a8", "w4a16")
    program, stats = _chosen(monkeypatch, table, max_batch=4)
    assert _acts(program) == {""}
    assert any(why == "rows 2..8 keeps float activations" for why in stats.declined.values())
    program, _ = _chosen(monkeypatch, table, max_batch=1)
    assert _acts(program) == {"int8"}


def test_archs_that_differ_or_are_not_measured_get_float_activations(monkeypatch):
    program, stats = _chosen(monkeypatch, _table("w4a8", "w4a8"), archs=("sm80", "sm90"))
    assert _acts(program) == {""} and not stats.applied
    d = program.decode_paths["int4"]
    assert set(d["paths"].values()) == {"w4a16"}
    assert d["source"] == ("table decode_paths.yaml: sm80 not measured, sm90 measured 2000-01-01, "
                           "the archs differ: float activations where they do")


FUSED_SOURCE = "table decode_paths.yaml (fused rows 1): sm90 measured 2026-12-03"


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_the_measured_table_gives_sm90_int8_activations_in_the_fused_batch1_kernels(monkeypatch, quant):
    """The repo's table: on sm90 the fused rows-1 path won the decode step (docs/perf.md v34), so the batch-1
    kernels of the NormLinearQ nodes take int8 x ("int8@1") and every other projection float activations, as the
    opt-in ATLAS_INT4_PATH=w4a8-fused1 / ATLAS_INT8_PATH=w8a8-fused1 did; with sm80 in the compile (not measured)
    every projection keeps float activations."""
    op = "LinearQ4" if quant == "int4" else "LinearQ8"
    program, stats = _chosen(monkeypatch, quant=quant)
    acts = {(n.op, n.attrs.get("act", "")) for n in program.entries["decode"].nodes if cdp._projection(n)}
    assert acts == {("NormLinearQ", "int8@1"), ("NormLinearRotary", ""), (op, "")}
    assert set(stats.applied) == {cdp.FUSED_ROWS1_RULE[op]}
    float_path, int8_path = cdp.PATHS[op][1]
    assert program.decode_paths[quant] == {"paths": {"rows 1": f"{int8_path} (fused norms)",
                                                     "rows 2..8": float_path}, "source": FUSED_SOURCE}
    program, stats = _chosen(monkeypatch, quant=quant, archs=("sm80", "sm90"))
    assert _acts(program) == {""} and not stats.applied
    assert program.decode_paths[quant]["paths"] == dict.fromkeys(cdp.BUCKETS, float_path)


def test_a_fused_entry_must_choose_its_fastest_step():
    """table_problems checks the "fused rows 1" entry: its choice is the path with the smallest step time, and it
    has numbers for the float path and the fused one."""
    table = cdp.load_table()
    for quant, fused in (("int4", "w4a8-fused1"), ("int8", "w8a8-fused1")):
        entry = table["sm90"][quant][cdp.FUSED_BUCKET]
        assert entry["choice"] == fused and "examples/step_ab.sh" in entry["command"]
    bad = copy.deepcopy(table)
    bad["sm90"]["int8"][cdp.FUSED_BUCKET]["step us"]["w8a16"] = 1.0
    problems = cdp.table_problems(bad)
    assert len(problems) == 1 and problems[0].startswith("sm90 int8 fused rows 1: choice w8a8-fused1"), problems
    del bad["sm90"]["int8"][cdp.FUSED_BUCKET]["step us"]["w8a16"]
    assert len(cdp.table_problems(bad)) == 1
    bad = copy.deepcopy(table)
    bad["sm90"]["int4"][cdp.FUSED_BUCKET]["step us"]["w8a8"] = 1.0  # another quantization's path
    assert len(cdp.table_problems(bad)) == 1


def test_the_environment_overrides_the_table(monkeypatch):
    program, _ = _chosen(monkeypatch, env="w4a8")
    assert _acts(program) == {"int8"}
    assert program.decode_paths["int4"]["source"] == "ATLAS_INT4_PATH=w4a8"
    program, _ = _chosen(monkeypatch, _table("w4a8", "w4a8"), env="w4a16")
    assert _acts(program) == {""}
    assert program.decode_paths["int4"] == {"paths": dict.fromkeys(cdp.BUCKETS, "w4a16"),
                                            "source": "ATLAS_INT4_PATH=w4a16"}


def test_fused_rows1_opt_in_marks_only_the_fused_norm_projections(monkeypatch):
    """ATLAS_INT4_PATH=w4a8-fused1: act = "int8@1" on the decode's int4 NormLinearQ nodes (gate/up + SwiGLU,
    the LM head), float activations on the rotary QKV and the plain projections; recorded per bucket."""
    program, stats = _chosen(monkeypatch, env=cdp.FUSED_ROWS1["LinearQ4"])
    acts = {(n.op, n.attrs.get("act", "")) for n in program.entries["decode"].nodes if cdp._projection(n)}
    assert acts == {("NormLinearQ", "int8@1"), ("NormLinearRotary", ""), ("LinearQ4", "")}
    fused = [n for n in program.entries["decode"].nodes if n.op == "NormLinearQ"]
    assert stats.applied == {cdp.FUSED_ROWS1_RULE["LinearQ4"]: len(fused)}
    assert any(n.attrs.get("epilogue") for n in fused)
    assert _acts(program, "prefill") == {""}
    assert program.decode_paths["int4"] == {"paths": {"rows 1": "w4a8 (fused norms)", "rows 2..8": "w4a16"},
                                            "source": "ATLAS_INT4_PATH=w4a8-fused1"}


def test_int8_fused_rows1_opt_in_marks_only_the_fused_norm_projections(monkeypatch):
    """ATLAS_INT8_PATH=w8a8-fused1: the same for int8 (W8A8 in the batch-1 kernels of gate/up + SwiGLU and the
    LM head); int4's value is not an int8 path."""
    program, stats = _chosen(monkeypatch, env=cdp.FUSED_ROWS1["LinearQ8"], quant="int8")
    acts = {(n.op, n.attrs.get("act", "")) for n in program.entries["decode"].nodes if cdp._projection(n)}
    assert acts == {("NormLinearQ", "int8@1"), ("NormLinearRotary", ""), ("LinearQ8", "")}
    fused = [n for n in program.entries["decode"].nodes if n.op == "NormLinearQ"]
    assert all(n.attrs["linear"] == "LinearQ8" for n in fused)
    assert stats.applied == {cdp.FUSED_ROWS1_RULE["LinearQ8"]: len(fused)}
    assert _acts(program, "prefill") == {""}
    assert program.decode_paths["int8"] == {"paths": {"rows 1": "w8a8 (fused norms)", "rows 2..8": "w8a16"},
                                            "source": "ATLAS_INT8_PATH=w8a8-fused1"}
    from atlasc.errors import UsageError

    with pytest.raises(UsageError, match="ATLAS_INT8_PATH='w4a8-fused1' is not a decode path"):
        _chosen(monkeypatch, env="w4a8-fused1", quant="int8")


def test_fused_rows1_leaves_a_short_prefill_alone(monkeypatch):
    """--max-batch 1 --max-seq 8: the prefill's projections are fused too (up to 8 rows) but have one kernel
    for every row count, so they keep float activations (a one-token prompt must not differ between the
    reference and the GPU); the decode step (one row) takes int8."""
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import PIPELINES, run_pipeline

    monkeypatch.delenv("ATLAS_INT4_PATH", raising=False)
    names = PIPELINES["default"]
    options = CompileOptions(archs=("sm90",), max_batch=1, max_seq=8, quant="int4", group_size=32)
    program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")}, options)
    program, _ = run_pipeline(program, names[: names.index("choose-decode-path")], verify_each=True)
    assert [n for n in program.entries["prefill"].nodes if n.op == "NormLinearQ"]
    monkeypatch.setenv("ATLAS_INT4_PATH", cdp.FUSED_ROWS1["LinearQ4"])
    program, _ = cdp.choose_decode_path(program)
    assert {n.attrs.get("act", "") for n in program.entries["prefill"].nodes if n.op == "NormLinearQ"} == {""}
    assert {n.attrs.get("act", "") for n in program.entries["decode"].nodes if n.op == "NormLinearQ"} == {"int8@1"}


def test_one_row_int8_activations_follow_the_rows_of_the_call():
    """act = "int8@1": the reference quantizes x to int8 for a call of one row (the W4A8 result), and keeps
    float activations for more rows; other values are a ShapeError naming them."""
    import numpy as np

    from atlasc.errors import ShapeError
    from atlasc.ir.ops import OPS
    from atlasc.ir.ops.quant import w4a8_matmul
    from atlasc.passes.quantize import quantize_int4

    rng = np.random.default_rng(21)
    wq, scale = quantize_int4(rng.standard_normal((16, 64)).astype(np.float32), 32)
    op = OPS["LinearQ4"]
    for rows in (1, 3):
        x = rng.standard_normal((rows, 64)).astype(np.float16)
        got = op.reference([x, wq, scale], op.fill_attrs({"group_size": 32, "act": "int8@1"}))[0]
        floats = op.reference([x, wq, scale], op.fill_attrs({"group_size": 32}))[0]
        int8 = w4a8_matmul(x, wq, scale, 32, None, None)
        np.testing.assert_array_equal(got, int8 if rows == 1 else floats)
        assert not np.array_equal(int8, floats)
    with pytest.raises(ShapeError, match="'int8@2'"):
        op.infer([_type((1, 64), "float16"), _type(wq.shape, "uint8"), _type(scale.shape, "float16")],
                 op.fill_attrs({"group_size": 32, "act": "int8@2"}))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_fused_rows1_kernels_take_int8_only_for_batch_1(quant, tmp_path, monkeypatch, no_nvcc):
    """The compiled opt-in (w4a8-fused1 / w8a8-fused1): each fused NormLinearQ's batch-1 kernel quantizes x to
    int8 (act8), its kernel for batches up to 4 keeps float activations; the accuracy report measures the
    int8 step at batch 1."""
    from atlasc.artifact import open_artifact
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    op = {"int4": "LinearQ4", "int8": "LinearQ8"}[quant]
    monkeypatch.setenv(cdp.PATHS[op][0], cdp.FUSED_ROWS1[op])
    monkeypatch.setenv("ATLAS_SPLIT_DECODE", "0")
    path = tmp_path / "f1.atlas"
    result = compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(
        archs=("sm90",), max_batch=4, max_seq=64, quant=quant, group_size=32))
    with open_artifact(path) as art:
        parts = art.source().split('extern "C" __global__')[1:]
        kernels = {re.search(r"(\w+)\(unsigned char\*", k).group(1): k for k in parts}
        fused = [n for n in art.manifest.entries["decode"].nodes if n.op == "NormLinearQ"]
        assert fused and all(n.variants for n in fused) and all(n.attrs["linear"] == op for n in fused)
        for node in fused:
            assert "act8_" not in kernels[node.kernel]
            assert all("act8_" in kernels[v.kernel] for v in node.variants if v.upto == 1)
    act = result.manifest.report["quantization"]["accuracy"]["decode_act_int8"]
    # both random prompts, one at a time: at one row the int8 activations apply (two at once would compare
    # float activations with themselves, KL 0)
    assert act["steps"] == 2 and act["entry"] == "decode" and act["kl_divergence"] > 0


def _type(shape, dtype):
    from atlasc.ir.ops import TensorType

    return TensorType(dtype, tuple(shape))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_artifact_records_the_decision(tmp_path, monkeypatch, no_nvcc):
    """The manifest's report and `atlasc inspect` say which path each rows bucket took and why (the cubins do
    not matter here: empty ones, tests/conftest.py no_nvcc)."""
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    monkeypatch.delenv("ATLAS_INT4_PATH", raising=False)
    out = tmp_path / "q.atlas"

    def atlasc(*args):
        r = subprocess.run([sys.executable, "-m", "atlasc", *map(str, args)], capture_output=True, text=True,
                           cwd=REPO, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout

    compile_model(FIXTURES / "llama.onnx", out, CompileOptions(archs=("sm90",), max_seq=32, max_batch=2,
                                                              quant="int4", group_size=32))
    report = json.loads(atlasc("inspect", out, "--json").splitlines()[-1])
    want = {"paths": {"rows 1": "w4a8 (fused norms)", "rows 2..8": "w4a16"}, "source": FUSED_SOURCE}
    assert report["decode_paths"] == {"int4": want}
    assert f"decode path int4: rows 1 w4a8 (fused norms), rows 2..8 w4a16 ({FUSED_SOURCE})" in atlasc("inspect", out)


def _bulk_table(choice: str = "w4a16-bulk") -> dict:
    """_table's float-activation sm90 table with a "bulk rows 1" entry for int4 choosing `choice` (numbers agreeing)."""
    table = _table("w4a16", "w4a16")
    step = {"w4a8-fused1": 2.0, "w4a16-bulk": 1.0} if choice == "w4a16-bulk" else {"w4a8-fused1": 1.0,
                                                                                   "w4a16-bulk": 2.0}
    table["sm90"]["int4"][cdp.BULK_BUCKET] = {"choice": choice, "gpu": "test", "date": "2000-01-02",
                                               "command": "none", "step us": step}
    assert cdp.table_problems(table) == []
    return table


def _h128(tmp_path):
    """examples/build_llama.py's hidden-128 Llama (K 128 and 256: groups of 128 fit) in tmp_path; its path."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import build_llama

    path = tmp_path / "llama-h128.onnx"
    build_llama.write(build_llama.LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
                      path, seed=3)
    return path


def test_a_bulk_rows1_entry_puts_batch1_int4_on_the_copy_engine(monkeypatch, tmp_path):
    """The table's "bulk rows 1" choosing w4a16-bulk: an sm90-only compile records the batch-1 path as float x on the
    copy-engine kernels (float activations everywhere, no act marks) and atlasc/compiler.py bulk_ops hands LinearQ4
    to codegen; int8 (no entry) keeps its path; with sm80 in the compile, ATLAS_LINEAR_TMA=0 or ATLAS_QUANT_BULK=0
    the table's other choices hold; an entry choosing another path changes nothing."""
    from atlasc.compiler import bulk_ops

    monkeypatch.delenv("ATLAS_QUANT_BULK", raising=False)
    h128 = {"onnx": _h128(tmp_path), "group": 128}
    program, stats = _chosen(monkeypatch, _bulk_table(), **h128)
    assert _acts(program) == {""} and not stats.applied
    assert program.decode_paths["int4"] == {"paths": {"rows 1": "w4a16 (copy engine)", "rows 2..8": "w4a16"},
                                            "source": "table decode_paths.yaml (bulk rows 1): sm90 measured 2000-01-02"}
    assert bulk_ops(program) == {"LinearQ4"}
    for archs, env in ((("sm80", "sm90"), {}), (("sm90",), {"ATLAS_LINEAR_TMA": "0"}),
                       (("sm90",), {"ATLAS_QUANT_BULK": "0"})):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        program, _ = _chosen(monkeypatch, _bulk_table(), archs=archs, **h128)
        assert "copy engine" not in str(program.decode_paths) and bulk_ops(program) == frozenset()
        for name in env:
            monkeypatch.delenv(name)
    program, _ = _chosen(monkeypatch, _bulk_table("w4a8-fused1"), **h128)
    assert bulk_ops(program) == frozenset()
    # projections the copy-engine kernels do not take (groups of 64; float32 x) pass the entry over
    program, _ = _chosen(monkeypatch, _bulk_table(), onnx=h128["onnx"], group=64)
    assert bulk_ops(program) == frozenset() and "bulk rows 1" not in program.decode_paths["int4"]["source"]
    # float32 x (a float32 export's decode): bulk_fits says no for the whole op
    from atlasc.ir.graph import Value

    program, _ = _chosen(monkeypatch, _bulk_table(), **h128)
    assert cdp.bulk_fits(program, "LinearQ4")
    node = next(n for n in program.entries["decode"].nodes if n.op == "LinearQ4")
    node.inputs[0] = Value("x32", "float32", node.inputs[0].shape)
    assert not cdp.bulk_fits(program, "LinearQ4")
    program, _ = _chosen(monkeypatch, _bulk_table(), quant="int8", **h128)
    assert bulk_ops(program) == frozenset()


def test_the_shipped_bulk_entry_holds_only_from_its_min_k(monkeypatch):
    """The table's sm90 int4 "bulk rows 1" entry (measured on an H100: Llama-3-8B's shapes gain, Llama-3.2-1B's at
    K = 2048 lose) puts an sm90-only compile's batch-1 int4 projections on the copy-engine kernels when their
    smallest K reaches its min k (4096), and passes over it, saying so in the source, for a smaller K; weights the
    kernels do not take (None) or a compile with another arch keep the other entries' choices without that note."""
    for name in ("ATLAS_QUANT_BULK", "ATLAS_INT4_PATH", "ATLAS_INT8_PATH", "ATLAS_LINEAR_TMA"):
        monkeypatch.delenv(name, raising=False)
    table = cdp.load_table()
    bulk = table["sm90"]["int4"][cdp.BULK_BUCKET]
    assert bulk["choice"] == "w4a16-bulk" and bulk["min k"] == 4096 and bulk["gpu"] and bulk["date"]
    engine = {"rows 1": "w4a16 (copy engine)", "rows 2..8": "w4a16"}
    fused = {"rows 1": "w4a8 (fused norms)", "rows 2..8": "w4a16"}
    for k in (4096, 14336):
        assert cdp.decide("LinearQ4", ("sm90",), table, k)["paths"] == engine
    below = cdp.decide("LinearQ4", ("sm90",), table, 2048)
    assert below["paths"] == fused and below["source"].endswith("; bulk rows 1 passed over: K 2048 < its min k 4096")
    for archs, k in ((("sm90",), None), (("sm80", "sm90"), 4096)):
        assert "bulk rows 1" not in cdp.decide("LinearQ4", archs, table, k)["source"]
    assert cdp.decide("LinearQ8", ("sm90",), table, 4096)["paths"]["rows 1"] == "w8a8 (fused norms)"  # no entry


def test_the_shipped_table_gives_a_k4096_decoder_the_copy_engine(monkeypatch, tmp_path):
    """Through the pipeline with the repo's table: a one-layer decoder of hidden 4096 and MLP width 4096 (every int4
    projection K 4096, groups of 128) compiled for sm90 alone gets the copy-engine batch-1 path and codegen is handed
    LinearQ4 (bulk_ops), with no int8 activation marks; with sm80 beside it (not measured) quant.cu's float-x
    kernels."""
    from conftest import REPO

    from atlasc.compiler import bulk_ops

    for name in ("ATLAS_QUANT_BULK", "ATLAS_LINEAR_TMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import build_llama

    onnx = tmp_path / "k4096.onnx"
    build_llama.write(build_llama.LlamaShape(layers=1, hidden=4096, heads=32, kv_heads=1, intermediate=4096,
                                             vocab=256), onnx, seed=5)
    program, stats = _chosen(monkeypatch, onnx=onnx, group=128, max_batch=1)
    assert cdp.smallest_bulk_k(program, "LinearQ4") == 4096 and bulk_ops(program) == {"LinearQ4"}
    assert cdp.BULK_RULES["LinearQ4"] not in stats.declined
    assert program.decode_paths["int4"]["paths"]["rows 1"] == "w4a16 (copy engine)" and _acts(program) == {""}
    program, _ = _chosen(monkeypatch, onnx=onnx, group=128, max_batch=1, archs=("sm80", "sm90"))
    assert bulk_ops(program) == frozenset() and "bulk rows 1" not in program.decode_paths["int4"]["source"]
    assert program.decode_paths["int4"]["paths"]["rows 1"] == "w4a16"


def test_a_bulk_entrys_min_k_reads_the_models_smallest_k(monkeypatch, tmp_path):
    """The pass hands decide the smallest K of the model's int4 projections (the hidden-128 Llama: 128, its down
    projection 256): a min k of 128 keeps the copy-engine path, 256 passes it over for the fused default and says
    why in the record; table_problems refuses a min k that is not a non-negative integer."""
    from atlasc.compiler import bulk_ops

    monkeypatch.delenv("ATLAS_QUANT_BULK", raising=False)
    onnx = _h128(tmp_path)
    table = _bulk_table()
    table["sm90"]["int4"][cdp.FUSED_BUCKET] = {"choice": "w4a8-fused1", "date": "2000-01-03", "command": "none",
                                               "step us": {"w4a16": 2.0, "w4a8-fused1": 1.0}}
    table["sm90"]["int4"][cdp.BULK_BUCKET]["min k"] = 128
    program, _ = _chosen(monkeypatch, table, onnx=onnx, group=128)
    assert cdp.smallest_bulk_k(program, "LinearQ4") == 128 and bulk_ops(program) == {"LinearQ4"}
    table["sm90"]["int4"][cdp.BULK_BUCKET]["min k"] = 256
    program, stats = _chosen(monkeypatch, table, onnx=onnx, group=128)
    assert bulk_ops(program) == frozenset() and program.decode_paths["int4"] == {
        "paths": {"rows 1": "w4a8 (fused norms)", "rows 2..8": "w4a16"},
        "source": "table decode_paths.yaml (fused rows 1): sm90 measured 2000-01-03; "
                  "bulk rows 1 passed over: K 128 < its min k 256"}
    assert _acts(program) == {"", "int8@1"} and stats.applied
    assert stats.declined[cdp.BULK_RULES["LinearQ4"]] == "K 128 < its min k 256"  # what -vv prints
    for bad in (-1, "4096", 1.5, True):
        table["sm90"]["int4"][cdp.BULK_BUCKET]["min k"] = bad
        assert cdp.table_problems(table) == [f"sm90 int4 bulk rows 1: min k {bad!r} is not a non-negative integer"]


def test_forced_bulk_paths_and_their_errors(monkeypatch):
    """ATLAS_INT4_PATH=w4a16-bulk / ATLAS_INT8_PATH=w8a16-bulk force the copy-engine batch-1 path whatever the table
    says; outside an sm90-only compile (or with ATLAS_QUANT_BULK=0) that is a one-line UsageError naming the
    variable; table_problems refuses a bulk entry whose choice is not its fastest step or that has one number."""
    from atlasc.compiler import bulk_ops
    from atlasc.errors import UsageError

    monkeypatch.delenv("ATLAS_QUANT_BULK", raising=False)
    for quant, env, op in (("int4", "w4a16-bulk", "LinearQ4"), ("int8", "w8a16-bulk", "LinearQ8")):
        program, _ = _chosen(monkeypatch, env=env, quant=quant)
        assert program.decode_paths[quant]["source"].endswith(f"={env}") and bulk_ops(program) == {op}
        with pytest.raises(UsageError, match=f"_PATH={env} needs a compile for sm90 alone"):
            _chosen(monkeypatch, env=env, quant=quant, archs=("sm80", "sm90"))
    monkeypatch.setenv("ATLAS_QUANT_BULK", "0")
    with pytest.raises(UsageError, match="ATLAS_INT4_PATH=w4a16-bulk"):
        _chosen(monkeypatch, env="w4a16-bulk")
    bad = _bulk_table()
    bad["sm90"]["int4"][cdp.BULK_BUCKET]["choice"] = "w4a8-fused1"
    assert cdp.table_problems(bad)[0].startswith("sm90 int4 bulk rows 1: choice w4a8-fused1")
    del bad["sm90"]["int4"][cdp.BULK_BUCKET]["step us"]["w4a8-fused1"]
    bad["sm90"]["int4"][cdp.BULK_BUCKET]["choice"] = "w4a16-bulk"
    assert len(cdp.table_problems(bad)) == 1
