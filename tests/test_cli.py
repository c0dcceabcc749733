"""The command line on the bundled fixtures, including exactly the README's commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ort_reference import ort_greedy
from conftest import REPO
from conftest import TOL as CPU_TOL

# fp32 tolerance of issue 2 (reference interpreter vs onnxruntime); fp16 outputs get 3e-2
TOL = {np.dtype("float32"): CPU_TOL["fp32"], np.dtype("float16"): CPU_TOL["fp16"]}


def _readme_commands() -> list[str]:
    """The `atlasc ...` lines inside fenced blocks of README.md."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip().startswith("atlasc ")]


def test_version(cli):
    import atlasc

    r = cli("--version")
    assert r.code == 0
    assert r.stdout.strip() == f"atlasc {atlasc.__version__}"


def test_python_m_help():
    p = subprocess.run([sys.executable, "-m", "atlasc", "--help"],
                       capture_output=True, text=True, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    assert "inspect" in p.stdout and "run" in p.stdout


def test_usage_error_exit_2(cli):
    r = cli("run", "x.onnx", "--device", "tpu")
    assert r.code == 2
    assert "Traceback" not in r.stderr


def test_inspect_text(cli, fixtures_dir):
    r = cli("inspect", fixtures_dir / "llama.onnx")
    assert r.code == 0, r
    for word in ("input_ids", "past_key_values.0.key", "logits", "parameters", "decoder", "MatMul"):
        assert word in r.stdout


def test_inspect_json_decoder_hints(cli, fixtures_dir, manifest):
    for entry in manifest:
        if entry["kind"] != "decoder":
            continue
        r = cli("inspect", "--json", fixtures_dir / f"{entry['name']}.onnx")
        assert r.code == 0, r
        report = json.loads(r.stdout.strip().splitlines()[-1])
        h = report["hints"]
        assert h["kind"] == "decoder", entry["name"]
        assert h["layers"] == entry["num_layers"], entry["name"]
        assert h["kv_heads"] == entry["num_kv_heads"], entry["name"]
        assert h["head_dim"] == entry["head_dim"], entry["name"]
        if "vocab_size" in entry:
            assert h["vocab"] == entry["vocab_size"], entry["name"]
        assert [v["name"] for v in report["inputs"]] == entry["inputs"]
        assert [v["name"] for v in report["outputs"]] == entry["outputs"]
        assert report["parameters"]["count"] > 0
        assert report["unsupported_ops"] == []
        assert report["import"]["ok"], report["import"]["error"]


def test_inspect_json_encoder(cli, fixtures_dir, manifest):
    for entry in manifest:
        if entry["kind"] != "encoder":
            continue
        r = cli("inspect", "--json", fixtures_dir / f"{entry['name']}.onnx")
        assert r.code == 0, r
        h = json.loads(r.stdout.strip().splitlines()[-1])["hints"]
        assert h["kind"] == "encoder", entry["name"]
        assert h["norm"] is not None and "layernorm" in h["norm"], entry["name"]


def _check_outputs(out_path: Path, case_path: Path):
    expected = np.load(case_path)
    got = np.load(out_path)
    names = [k[4:] for k in expected.files if k.startswith("out.")]
    assert sorted(got.files) == sorted(names)
    for name in names:
        want = expected[f"out.{name}"]
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name].astype(np.float64), want.astype(np.float64),
                                   **TOL.get(want.dtype, {"atol": 0, "rtol": 0}), err_msg=name)


def test_run_json(cli, fixtures_dir, tmp_path):
    case = fixtures_dir / "llama.decode.npz"
    out = tmp_path / "out.npz"
    r = cli("run", fixtures_dir / "llama.onnx", "--device", "cpu", "--inputs", case, "--out", out, "--json")
    assert r.code == 0, r
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out)
    assert summary["outputs"][0]["name"] == "logits"
    _check_outputs(out, case)


def test_run_plain_input_names(cli, fixtures_dir, tmp_path):
    """An npz keyed by the input names themselves (no `in.` prefix), as the issue specifies."""
    case = fixtures_dir / "llama.prefill.npz"
    with np.load(case) as z:
        plain = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    inputs = tmp_path / "plain.npz"
    np.savez(inputs, **plain)
    out = tmp_path / "out.npz"
    r = cli("run", fixtures_dir / "llama.onnx", "--inputs", inputs, "--out", out, "--quiet")
    assert r.code == 0, r
    assert r.stdout == ""
    _check_outputs(out, case)


def test_run_gpu_needs_an_artifact_and_corrupt_artifacts_are_refused(cli, fixtures_dir, tmp_path):
    r = cli("run", fixtures_dir / "llama.onnx", "--device", "gpu", "--inputs", fixtures_dir / "llama.prefill.npz")
    assert r.code == 2 and r.stderr.startswith("error: ") and "compile first" in r.stderr
    art = tmp_path / "m.atlas"
    art.write_bytes(b"x")
    r = cli("run", art, "--prompt-ids", "1,2")
    assert r.code == 2 and "not an .atlas file" in r.stderr and "Traceback" not in r.stderr


def test_readme_commands(fixtures_dir, tmp_path):
    """Run the README's `atlasc` commands exactly as written (through the installed console script
    when there is one, else `python -m atlasc`), then check the run's output against the fixture."""
    commands = _readme_commands()
    assert any(c.startswith("atlasc compile ") for c in commands), commands
    assert any(c.startswith("atlasc run ") for c in commands), commands
    script = Path(sys.executable).parent / "atlasc"
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "atlasc"]
    ran = 0
    for command in commands:
        argv = command.split()[1:]
        if "--device" in argv and argv[argv.index("--device") + 1] == "gpu" or argv[0] in ("bench", "profile"):
            continue  # GPU lines: tests/test_gpu_cli.py runs them on a GPU machine
        p = subprocess.run([*prefix, *argv], capture_output=True, text=True, cwd=REPO, check=False)
        assert p.returncode == 0, f"{command}\n{p.stdout}\n{p.stderr}"
        ran += 1
        if argv[0] == "run" and "--prompt-ids" in argv:
            prompt = [int(t) for t in argv[argv.index("--prompt-ids") + 1].split(",")]
            steps = int(argv[argv.index("--max-new-tokens") + 1])
            want, _ = ort_greedy(REPO / "examples/fixtures/llama.onnx", [prompt], steps)
            assert p.stdout.split("\n")[0].split() == [str(t) for t in want[0]]
    assert ran >= 2


@pytest.mark.parametrize("name", ["llama", "llama-fp16", "gpt2", "bert"])
def test_run_every_case(cli, fixtures_dir, manifest, tmp_path, name):
    entry = next((e for e in manifest if e["name"] == name), None)
    assert entry is not None, f"fixture {name} missing from the manifest"
    for case in entry["cases"]:
        case_path = fixtures_dir / f"{name}.{case}.npz"
        out = tmp_path / f"{case}.npz"
        r = cli("run", fixtures_dir / f"{name}.onnx", "--inputs", case_path, "--out", out, "--quiet")
        assert r.code == 0, r
        _check_outputs(out, case_path)


def test_inspect_names_the_opt_in_kernel_choices():
    """`atlasc inspect` lists the ATLAS_* codegen switches an artifact was built with, and none at defaults."""
    from atlasc.cli.artifact_cmd import _opt_ins

    defaults = {"linear_path": "table", "linear_ft": "auto", "weight_prefetch": False, "pdl_wait": True,
                "attention_prefill": "fa2"}
    assert _opt_ins(defaults) == ""
    assert _opt_ins({**defaults, "linear_ft": "2", "weight_prefetch": True, "linear_prefill": "tc",
                     "attention_prefill": "off"}) == \
        "ATLAS_LINEAR_FT=2, ATLAS_PREFETCH=1, ATLAS_LINEAR_PREFILL=tc, ATLAS_ATTENTION_PREFILL=off"
    assert _opt_ins({**defaults, "quant_ksplit": "auto"}) == ""
    assert _opt_ins({**defaults, "quant_ksplit": "2", "linear_ksplit": "1"}) == \
        "ATLAS_LINEAR_KSPLIT=1, ATLAS_QUANT_KSPLIT=2"
    assert _opt_ins({**defaults, "attention_split_min_keys": 256, "attention_v_prefetch": True,
                     "attention_mma": True, "attention_warps": "auto"}) == ""
    assert _opt_ins({**defaults, "attention_split_min_keys": 64, "attention_v_prefetch": False,
                     "attention_mma": False, "attention_warps": 4}) == (
        "ATLAS_ATTENTION_SPLIT_MIN_KEYS=64, ATLAS_ATTENTION_VPREFETCH=0, ATLAS_ATTENTION_MMA=0, "
        "ATLAS_ATTENTION_WARPS=4")
    assert _opt_ins({**defaults, "share_kernels": True}) == ""
    assert _opt_ins({**defaults, "share_kernels": False}) == "ATLAS_SHARE_KERNELS=0"
    assert _opt_ins({**defaults, "quant_ofs": "auto"}) == ""
    assert _opt_ins({**defaults, "quant_ofs": "0"}) == "ATLAS_QUANT_OFS=0"
    assert _opt_ins({**defaults, "quant_min_blocks": 0, "attention_early_kv": False}) == ""
    # the copy-engine path's settings: named only with the path on, the configuration as W-S-B
    bulk = {"quant_bulk_config": [16, 6, 1], "quant_bulk_ks": "2", "quant_bulk_min_n": 16384, "quant_bulk_early": False}
    assert _opt_ins({**defaults, "quant_bulk": False, **bulk}) == ""  # an artifact from before v49: the path off
    assert _opt_ins({**defaults, "quant_bulk": "0", **bulk}) == "ATLAS_QUANT_BULK=0"
    assert _opt_ins({**defaults, "quant_bulk": "auto", **bulk}) == ""  # auto, and no kernel took the path
    assert _opt_ins({**defaults, "quant_bulk": "auto", **bulk, "kernels": {"k": {"path": "bulk"}}}).startswith(
        "ATLAS_QUANT_BULK_CONFIG=16-6-1, ")
    assert _opt_ins({**defaults, "quant_bulk": True, **bulk}) == _opt_ins({**defaults, "quant_bulk": "1", **bulk}) == (
        "ATLAS_QUANT_BULK=1, ATLAS_QUANT_BULK_CONFIG=16-6-1, ATLAS_QUANT_BULK_KS=2, ATLAS_QUANT_BULK_MIN_N=16384, "
        "ATLAS_QUANT_BULK_EARLY=0")
    assert _opt_ins({**defaults, "quant_bulk": True, **bulk, "quant_bulk_inflight": 0, "quant_bulk_hold": False}) \
        .endswith("ATLAS_QUANT_BULK_EARLY=0, ATLAS_QUANT_BULK_INFLIGHT=0, ATLAS_QUANT_BULK_HOLD=0")
    assert _opt_ins({**defaults, "quant_bulk": True, "quant_bulk_config": [16, 11, 1], "quant_bulk_ks": "auto",
                     "quant_bulk_min_n": 0, "quant_bulk_early": True, "quant_bulk_inflight": 2,
                     "quant_bulk_hold": True}) == "ATLAS_QUANT_BULK=1"
    assert _opt_ins({**defaults, "quant_bulk": "1", "quant_bulk_ks": "auto", "quant_bulk_min_run": 1}) == \
        "ATLAS_QUANT_BULK=1, ATLAS_QUANT_BULK_MIN_RUN=1"
    assert _opt_ins({**defaults, "quant_min_blocks": 4, "attention_early_kv": True}) == \
        "ATLAS_QUANT_MIN_BLOCKS=4, ATLAS_ATTENTION_EARLY_KV=1"
    assert _opt_ins({**defaults, "quant_staged_u": 0, "prologue_act8_grid": 0}) == ""
    assert _opt_ins({**defaults, "quant_staged_u": 4, "prologue_act8_grid": 264}) == \
        "ATLAS_QUANT_STAGED_U=4, ATLAS_PROLOGUE_ACT8_GRID=264"
    assert _opt_ins({**defaults, "attention_split_target": "auto"}) == ""
    assert _opt_ins({**defaults, "attention_split_target": "256"}) == "ATLAS_ATTENTION_SPLIT_TARGET=256"
    assert _opt_ins({**defaults, "dims_early": True}) == ""
    assert _opt_ins({**defaults, "dims_early": False}) == "ATLAS_DIMS_EARLY=0"
    assert _opt_ins({**defaults, "norm_vec": True}) == ""
    assert _opt_ins({**defaults, "norm_vec": False}) == "ATLAS_NORM_VEC=0"
    assert _opt_ins({**defaults, "attention_warp_merge": True}) == ""
    assert _opt_ins({**defaults, "attention_warp_merge": False}) == "ATLAS_ATTENTION_WARP_MERGE=0"
    assert _opt_ins({**defaults, "share_kernels": "all"}) == "ATLAS_SHARE_KERNELS=all"
    assert _opt_ins({**defaults, "early_weights": "2"}) == ""
    assert _opt_ins({**defaults, "early_weights": "0"}) == "ATLAS_EARLY_WEIGHTS=0"


def test_every_environment_variable_is_documented():
    """Every ATLAS_* variable the package reads is named in docs/cli.md, and every one docs/cli.md names exists:
    the docs follow the code."""
    import re

    from conftest import REPO

    sources = [p for d in ("atlasc", "codegen", "passes", "runtime") for p in (REPO / d).rglob("*.py")]
    in_code = {name for p in sources for name in re.findall(r'"(ATLAS_[A-Z0-9_]+)"', p.read_text())}
    in_docs = set(re.findall(r"ATLAS_[A-Z0-9_]*[A-Z0-9]", (REPO / "docs" / "cli.md").read_text()))
    assert in_code and not in_code - in_docs, sorted(in_code - in_docs)
    assert not in_docs - in_code, sorted(in_docs - in_code)
    from atlasc.env_vars import KNOWN, REPOSITORY_TOOLS

    known = KNOWN | REPOSITORY_TOOLS  # the lists the CLI warns against
    assert in_code == known, (sorted(in_code - known), sorted(known - in_code))


def test_unknown_environment_variables_are_warned_about(cli, monkeypatch, tmp_path):
    """A misspelt ATLAS_* name (ignored by every pass) gets a warning line naming the closest known one; the
    command still runs. Other variables are not looked at."""
    from atlasc.env_vars import REPOSITORY_TOOLS

    for name in os.environ:  # a run of the suite under ATLAS_UPDATE_SNAPSHOTS / ATLAS_GPU_PRECOMPILE stays quiet
        if name.startswith("ATLAS_") and name not in REPOSITORY_TOOLS:
            monkeypatch.delenv(name)
    monkeypatch.setenv("ATLAS_SPLT_DECODE", "0")
    monkeypatch.setenv("ATLAS_ZZZ", "1")
    monkeypatch.setenv("NOT_ATLAS_THING", "1")
    for name in REPOSITORY_TOOLS:  # read by the repository's own tests and scripts: no warning
        assert any(name in p.read_text() for p in (REPO / "tests").glob("*.py")) or \
            any(name in p.read_text() for p in (REPO / "examples").glob("*.py")), name
        monkeypatch.setenv(name, "")
    r = cli("inspect", REPO / "examples" / "fixtures" / "llama.onnx")
    assert r.code == 0, r
    assert r.stderr.splitlines() == [
        "warning: ATLAS_SPLT_DECODE is not a variable atlasc reads (ignored); did you mean ATLAS_SPLIT_DECODE?",
        "warning: ATLAS_ZZZ is not a variable atlasc reads (ignored)"], r.stderr


def test_every_option_is_documented():
    """Every option of every command (`atlasc CMD --help`) is named in docs/cli.md, as a whole word."""
    import re

    import typer

    from atlasc.cli import app
    from conftest import REPO

    docs = (REPO / "docs" / "cli.md").read_text()
    group = typer.main.get_command(app)
    missing = [f"{name} {opt}" for name, command in group.commands.items() for param in command.params
               for opt in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])
               if opt.startswith("-") and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", docs)]
    assert len(group.commands) >= 5 and not missing, missing
