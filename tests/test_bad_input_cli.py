"""Bad command-line input found by an adversarial audit (docs/perf.md v40): each case is one `error:` line with
exit code 2 and no traceback (test_errors.assert_one_error), and a failed compile leaves no file. Before the fixes
these raised tracebacks (config values of the wrong type, --dump-ir onto a file, ATLAS_NVCC / ATLAS_CACHE_DIR
unusable, out-of-vocabulary prompt ids, --stop / --seed out of range, --out unwritable) or were accepted
silently (`zero_points: "no"` read as true, --arch '', --max-seq of 2e9, --quant-skip matching nothing, a
compile over its own input, NaN temperature, a manifest edited in place)."""

from __future__ import annotations

import shutil
import zipfile

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, empty_cubins
from test_errors import add_model, assert_one_error

LLAMA = FIXTURES / "llama.onnx"
FLAGS = ("--arch", "sm90", "--max-batch", "2", "--max-seq", "32")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def llama_atlas(tmp_path_factory):
    """The llama fixture compiled (empty cubins: the CPU runtime executes the schedule with numpy)."""
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    out = tmp_path_factory.mktemp("art") / "llama.atlas"
    with empty_cubins():
        compile_model(LLAMA, out, CompileOptions(archs=("sm90",), max_batch=2, max_seq=32))
    return out


@pytest.mark.parametrize("text, needle", [
    ('max_batch: "four"\n', "max_batch must be an integer, not 'four'"),
    ("max_batch: 2.5\n", "max_batch must be an integer, not 2.5"),
    ("max_seq: [1, 2]\n", "max_seq must be an integer"),
    ('zero_points: "no"\nquant: int4\n', "zero_points must be true or false (or 1 / 0), not 'no'"),
    ("fusion: maybe\n", "fusion must be true or false"),
    ("gptq: 2\n", "gptq must be true or false (or 1 / 0), not 2"),
    ("arch: 90\n", "arch must be a string (or a list of strings), not 90"),
    ("arch: [sm90, 90]\n", "arch must be a string"),
    ("quant_skip: 5\nquant: int8\n", "quant_skip must be a string (or a list of strings), not 5"),
    ("smooth: high\n", "smooth must be a number"),
    ("arch: sm90\na: b: c\n", "not valid YAML: line 2, column 5: mapping values are not allowed here"),
    ("1: sm90\n", "option names must be strings, not 1"),
    ("\udcff\udcfebin\n", "is not UTF-8 text"),
])
def test_config_values_of_the_wrong_type(cli, tmp_path, text, needle):
    cfg = tmp_path / "build.yaml"
    cfg.write_bytes(text.encode("utf-8", "surrogateescape"))
    out = tmp_path / "x.atlas"
    assert_one_error(cli("compile", LLAMA, "-o", out, "--config", cfg), needle)
    assert not out.exists()


def test_config_values_of_the_right_type_still_compile(cli, tmp_path, no_nvcc):
    cfg = tmp_path / "build.yaml"
    cfg.write_text("arch: [sm90]\nmax_batch: 2\nmax_seq: 32\nfusion: 1\ngptq: false\nzero_points: 0\nquant: int8\n"
                   "smooth: 1\nquant_skip: [logits*]\ndtype:\nprefill_logits: ~\n")  # empty / ~: the default
    r = cli("compile", LLAMA, "-o", tmp_path / "x.atlas", "--config", cfg, "--calib", _calib(tmp_path))
    assert r.code == 0, r


def _calib(tmp_path):
    import numpy as np

    path = tmp_path / "calib.npz"
    np.savez(path, input_ids=np.arange(16, dtype=np.int64).reshape(2, 8))
    return path


@pytest.mark.parametrize("flags, needle", [
    (("--arch", ""), "no target arch given"),
    (("--max-seq", "2000000000"), "--max-seq must be at most 1048576"),
    (("--quant-skip", "logits*"), "--quant-skip only matters with --quant"),
    (("--quant", "int8", "--no-fusion"), "--quant int8 needs fusion"),
    (("--max-batch", "2147483648"), "--max-batch at most 16384"),
    (("--quant", "int8", "--group-size", "32"), "--group-size applies to --quant int4, not int8"),
    (("--quant", "int8", "--quant-skip", "logits*, "), "--quant-skip has an empty pattern"),
])
def test_bad_compile_options(cli, tmp_path, flags, needle):
    out = tmp_path / "x.atlas"
    sizes = (() if "--max-batch" in flags else ("--max-batch", "2")) + (() if "--max-seq" in flags else
                                                                         ("--max-seq", "32"))
    assert_one_error(cli("compile", LLAMA, "-o", out, *sizes, *flags), needle)
    assert not out.exists()


def test_quant_skip_pattern_that_matches_nothing(cli, tmp_path, no_nvcc):
    out = tmp_path / "x.atlas"
    r = cli("compile", LLAMA, "-o", out, *FLAGS, "--quant", "int8", "--quant-skip", "logits*,lm_haed*")
    assert_one_error(r, "--quant-skip lm_haed* matches no linear layer")
    assert not out.exists()


def test_compile_onto_its_own_input(cli, tmp_path):
    model = tmp_path / "model.atlas"
    shutil.copy(LLAMA, model)
    before = model.read_bytes()
    assert_one_error(cli("compile", model, "-o", model, *FLAGS), "is the model being compiled")
    assert model.read_bytes() == before


def test_dump_ir_onto_a_file(cli, tmp_path):
    dump = tmp_path / "dump"
    dump.write_text("not a folder")
    out = tmp_path / "x.atlas"
    assert_one_error(cli("compile", LLAMA, "-o", out, *FLAGS, "--dump-ir", dump), "cannot be created: File exists")
    assert not out.exists()


def test_fusion_switch_must_be_0_or_1(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_FUSION_ENABLED", "maybe")
    assert_one_error(cli("compile", LLAMA, "-o", tmp_path / "x.atlas", *FLAGS), "ATLAS_FUSION_ENABLED='maybe'")


@pytest.fixture
def add_onnx(tmp_path):
    path = tmp_path / "add.onnx"
    onnx.save(add_model(), path)
    return path


def test_nvcc_path_is_a_folder(cli, tmp_path, monkeypatch, add_onnx):
    monkeypatch.setenv("ATLAS_NVCC", str(tmp_path))
    out = tmp_path / "x.atlas"
    assert_one_error(cli("compile", add_onnx, "-o", out, "--arch", "sm90"), "is not an executable file")
    assert not out.exists()


def test_nvcc_that_fails_silently_is_not_called_a_codegen_bug(cli, tmp_path, monkeypatch, add_onnx):
    monkeypatch.setenv("ATLAS_NVCC", shutil.which("false") or "/bin/false")
    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    r = cli("compile", add_onnx, "-o", tmp_path / "x.atlas", "--arch", "sm90")
    assert_one_error(r, "nvcc failed for sm90")
    assert "exited without a message" in r.stderr and "bug" not in r.stderr, r


@needs_nvcc
def test_cache_dir_that_is_a_file(cli, tmp_path, monkeypatch, add_onnx):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "file"))
    assert_one_error(cli("compile", add_onnx, "-o", tmp_path / "x.atlas", "--arch", "sm90"),
                     "as the cubin cache: Not a directory")


@needs_nvcc
def test_nvcc_chunk_must_be_a_count(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_NVCC_CHUNK", "x")
    assert_one_error(cli("compile", LLAMA, "-o", tmp_path / "x.atlas", *FLAGS), "ATLAS_NVCC_CHUNK='x'")


@pytest.mark.parametrize("flags, needle", [
    (("--prompt-ids", "999"), "prompt token ids 999 are outside the vocabulary [0, 256)"),
    (("--prompt-ids", "5,-1"), "prompt token ids -1 are outside the vocabulary"),
    (("--prompt-ids", "99999999999999999999999"), "outside the vocabulary"),
    (("--prompt-ids", "1,2", "--stop", "abc"), "--stop (token ids) must be comma-separated integers"),
    (("--prompt-ids", "1,2", "--stop", "3,"), "--stop (token ids) must be comma-separated integers, no empty items"),
    (("--prompt-ids", "5,,7"), "--prompt-ids (';' between prompts) must be comma-separated integers"),
    (("--prompt-ids", "5,x"), "must be comma-separated integers, no empty items: '5,x'"),
    (("--prompt-ids", "1,2", "--temperature", "1", "--seed", "99999999999999999999"), "--seed must be in"),
    (("--prompt-ids", "1,2", "--temperature", "nan"), "--temperature must be a number in [0, 3.403e+38]"),
    (("--prompt-ids", "1,2", "--temperature", "inf"), "--temperature must be a number in"),
    (("--prompt-ids", "1,2", "--temperature", "-1"), "--temperature must be a number in"),
    (("--prompt-ids", "1,2", "--temperature", "1", "--top-p", "0"), "--top-p must be a number in (0, 1]"),
    (("--prompt-ids", "1,2", "--temperature", "1", "--top-p", "nan"), "--top-p must be a number in (0, 1]"),
    (("--prompt-ids", "1,2", "--temperature", "1", "--top-k", "99999999999999999999"), "--top-k must be in [0, 2**63)"),
    (("--prompt-ids", "1,2", "--out", "x.npz"), "give one or the other"),
    (("--prompt-ids", "1,2", "--entry", "decode"), "give one or the other"),
    (("--prompt-ids", "1,2", "--temperature", "1e308"), "--temperature must be a number in"),
    (("--prompt-ids", "1,2", "--temperature", "1e39"), "(the sampler's float32)"),
    (("--prompt-ids", "1,2;"), "--prompt-ids has an empty prompt"),
])
def test_bad_generation_options(cli, llama_atlas, flags, needle):
    assert_one_error(cli("run", llama_atlas, "--max-new-tokens", "2", *flags), needle)


def test_generation_with_valid_ids_still_runs(cli, llama_atlas):
    r = cli("run", llama_atlas, "--max-new-tokens", "2", "--prompt-ids", "0,255", "--stop", "3", "--json")
    assert r.code == 0, r


def test_onnx_run_without_inputs_names_them(cli):
    assert_one_error(cli("run", LLAMA, "--device", "cpu"), "needs --inputs x.npz")
    assert_one_error(cli("run", LLAMA, "--device", "cpu", "--prompt-ids", "1,2"), "--prompt-ids runs compiled")


def test_run_out_that_cannot_be_written(cli, tmp_path):
    case = FIXTURES / "llama.prefill.npz"
    assert_one_error(cli("run", LLAMA, "--inputs", case, "--out", tmp_path), "is a folder")
    assert_one_error(cli("run", LLAMA, "--inputs", case, "--out", "/proc/atlasc-test.npz"),
                     "cannot write /proc/atlasc-test.npz")


def test_manifest_edited_in_place_is_refused(cli, llama_atlas, tmp_path):
    """A digit of manifest.json changed without rewriting the zip (its size and JSON stay valid): the zip's
    CRC-32 of the manifest catches it, as every other member's sha256 catches theirs."""
    data = bytearray(llama_atlas.read_bytes())
    with zipfile.ZipFile(llama_atlas) as zf:
        info = zf.getinfo("manifest.json")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    text = bytes(data[start:start + info.file_size])
    at = text.index(b'"max_seq": 32')
    data[start + at + len(b'"max_seq": ')] = ord("9")
    edited = tmp_path / "edited.atlas"
    edited.write_bytes(bytes(data))
    assert_one_error(cli("inspect", edited), "checksum mismatch in member manifest.json")
    assert cli("inspect", llama_atlas).code == 0


# kernel switches that codegen_choices does not record: each is checked where a kernel reads it (a compile that
# generates no such kernel ignores it), or is not a kernel choice at all
UNRECORDED = {"ATLAS_CACHE_DIR", "ATLAS_NVCC", "ATLAS_NVCC_CHUNK", "ATLAS_LINEAR_U", "ATLAS_PROLOGUE_MAX_GRID",
              "ATLAS_QUANT_SPLIT", "ATLAS_QUANT_U", "ATLAS_W4A8_PATH", "ATLAS_W8A8_EARLY"}


def _codegen_switches() -> list[str]:
    import re

    from conftest import REPO

    text = "".join(p.read_text() for p in sorted((REPO / "codegen").glob("*.py")))
    return sorted(set(re.findall(r'"(ATLAS_[A-Z0-9_]+)"', text)) - UNRECORDED)


@pytest.mark.parametrize("name", _codegen_switches())
def test_every_recorded_kernel_switch_rejects_a_bogus_value(monkeypatch, name):
    """The artifact records these switches (codegen_choices, shown by `atlasc inspect`), so each is validated there,
    whether or not a kernel of the compile reads it: ATLAS_LINEAR_KSPLIT=3 used to be recorded unchecked."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    monkeypatch.setenv(name, "bogus")
    with pytest.raises(CodegenError, match=name):
        codegen_choices()


def test_renamed_artifact_is_read_as_one(cli, llama_atlas, tmp_path):
    """An artifact is known by its content (a zip) as well as its suffix: renamed, it is not misread as ONNX."""
    renamed = tmp_path / "model.bin"
    shutil.copy(llama_atlas, renamed)
    r = cli("inspect", renamed)
    assert r.code == 0 and "atlas format" in r.stdout, r
    assert cli("run", renamed, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json").code == 0


def test_other_zip_files_are_not_artifacts(cli, llama_atlas, tmp_path):
    """An .npz is a zip too, but its first member is not manifest.json: inspect and run do not read it as an artifact
    (inspect said "member ... is compressed; .atlas members are stored uncompressed"), and compile says a zip is not
    ONNX (was "not a valid ONNX model (malformed or truncated)"), for an artifact given to it too."""
    npz = FIXTURES / "llama.greedy.npz"
    for args in (("inspect", npz), ("run", npz, "--inputs", npz), ("compile", npz, "-o", tmp_path / "x.atlas"),
                 ("compile", llama_atlas, "-o", tmp_path / "x.atlas")):
        line = assert_one_error(cli(*args), "is a zip archive (an .npz or an .atlas artifact?), not an ONNX model")
        assert "compressed" not in line, line
    assert not (tmp_path / "x.atlas").exists()


def test_names_that_would_break_a_cuda_comment(tmp_path, no_nvcc):
    """Tensor and node names come from the ONNX file; in the generated CUDA's comments a newline would end the
    comment and a trailing backslash splice the next line in (a model with such names failed in nvcc)."""
    from atlasc.artifact import open_artifact
    from atlasc.codegen.cexpr import comment_text
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    assert comment_text("a\nb\\ é */") == "a?b? ? */"
    model = onnx.load(LLAMA)
    weird = {o: o + ' */\u00e9\n\\' for n in model.graph.node for o in n.output
             if o not in {v.name for v in model.graph.output}}
    for n in model.graph.node:
        n.input[:] = [weird.get(i, i) for i in n.input]
        n.output[:] = [weird.get(o, o) for o in n.output]
    path = tmp_path / "weird.onnx"
    onnx.save(model, path)
    compile_model(path, tmp_path / "w.atlas", CompileOptions(archs=("sm90",), max_batch=2, max_seq=32))
    with open_artifact(tmp_path / "w.atlas") as art:
        source = art.read_member("kernels.cu").decode()
    assert " */?" in source  # the names are in the comments, sanitized
    assert source.isascii() and not any(line.endswith("\\") for line in source.splitlines())


def test_dim_mismatch_message_names_the_rule_once(cli, llama_atlas, tmp_path):
    """--entry decode on a prompt's arrays: a constant dim reads "expected 1" (was "expected 1 = 1"); a dim given by
    a rule keeps it ("expected 1 + past_seq = 1")."""
    with np.load(FIXTURES / "llama.prefill.npz") as z:
        feeds = {k[3:]: z[k] for k in z.files if k.startswith("in.") and "past" not in k}
    npz = tmp_path / "prompt.npz"
    np.savez(npz, **feeds)
    line = assert_one_error(cli("run", llama_atlas, "--inputs", npz, "--entry", "decode"))
    assert line == "error: input 'input_ids' dim 1 is 7, expected 1", line
    feeds["input_ids"] = feeds["input_ids"][:, :1]
    np.savez(npz, **feeds)
    line = assert_one_error(cli("run", llama_atlas, "--inputs", npz, "--entry", "decode"))
    assert line.startswith("error: input 'attention_mask' dim 1 is 7, expected ") and line.endswith(" = 1"), line
