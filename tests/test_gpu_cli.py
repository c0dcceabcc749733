"""`atlasc run --device gpu`: the CLI over the GPU runtime, and its one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, PRECOMPILE_ENV, REPO

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def atlasc(*args, env=None):
    """`python -m atlasc ARGS`. Under ATLAS_GPU_PRECOMPILE (examples/gpu_cache.py, no GPU) a command that runs on the
    GPU is skipped here, as the in-process tests skip at their first GPU use: it compiles nothing (the artifact's
    cubins were built by its compile), and in a subprocess it could only fail on the missing pycuda."""
    words = [str(a) for a in args]
    if os.environ.get(PRECOMPILE_ENV) and (words[0] in ("bench", "profile") or "gpu" in words):
        pytest.skip(f"{PRECOMPILE_ENV}: no GPU to run `atlasc {words[0]}` on")
    return subprocess.run([sys.executable, "-m", "atlasc", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, check=False)


@pytest.fixture(scope="module")
def llama_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-cli") / "llama.atlas"
    r = atlasc("compile", FIXTURES / "llama.onnx", "-o", path, "--arch", "sm90", "--max-seq", "64",
               "--max-batch", "4", "--json")  # tests/test_compile.py's llama build: its cubins are cached
    assert r.returncode == 0, r.stderr
    return path


@needs_nvcc
@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed here")
def test_gpu_without_pycuda_is_a_one_line_error(llama_artifact):
    r = atlasc("run", llama_artifact, "--device", "gpu", "--prompt-ids", "1,2,3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "pycuda is not installed" in r.stderr and "pip install -e '.[gpu]'" in r.stderr


@needs_nvcc
@pytest.mark.gpu
def test_gpu_run_streams_greedy_tokens_equal_to_onnxruntime(llama_artifact):
    z = np.load(FIXTURES / "llama.greedy.npz")
    prompt = [int(t) for t in z["b1_l17.prompts"][0] if t >= 0]
    want = z["b1_l17.tokens"][0].tolist()
    r = atlasc("run", llama_artifact, "--device", "gpu", "--prompt-ids", ",".join(map(str, prompt)),
               "--max-new-tokens", "32", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [want]
    assert result["decode_ms_per_step"] > 0 and result["tokens_per_s"] > 0
    text = atlasc("run", llama_artifact, "--device", "gpu", "--prompt-ids", ",".join(map(str, prompt)),
                  "--max-new-tokens", "32", "--no-cuda-graphs")
    assert text.returncode == 0, text.stderr
    assert text.stdout.split("\n")[0].split() == [str(t) for t in want]
    assert "ms/step" in text.stdout and "tokens/s" in text.stdout


@needs_nvcc
@pytest.mark.gpu
def test_gpu_sampling_is_reproducible(llama_artifact):
    args = ["run", llama_artifact, "--device", "gpu", "--prompt-ids", "5,6,7", "--max-new-tokens", "12",
            "--temperature", "1.0", "--top-p", "0.9", "--json"]
    a = json.loads(atlasc(*args, "--seed", "1").stdout.splitlines()[-1])["tokens"]
    b = json.loads(atlasc(*args, "--seed", "1").stdout.splitlines()[-1])["tokens"]
    c = json.loads(atlasc(*args, "--seed", "2").stdout.splitlines()[-1])["tokens"]
    assert a == b and a != c


@needs_nvcc
@pytest.mark.gpu
def test_out_of_memory_at_load_is_a_one_line_error(tmp_path):
    path = tmp_path / "huge.atlas"
    r = atlasc("compile", FIXTURES / "gpt2.onnx", "-o", path, "--arch", "sm90", "--max-seq", "65536",
               "--max-batch", "4096", "--json")
    assert r.returncode == 0, r.stderr
    r = atlasc("run", path, "--device", "gpu", "--prompt-ids", "1,2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "GiB of device memory" in r.stderr and "free" in r.stderr


@needs_nvcc
@pytest.mark.gpu
def test_readme_gpu_commands():
    """The README's compile line, then its GPU lines, exactly as written."""
    import re

    text = (REPO / "README.md").read_text()
    lines = [ln.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL) for ln in b.splitlines()]
    compile_line = next(ln for ln in lines if ln.startswith("atlasc compile "))
    gpu_lines = [ln for ln in lines if ln.startswith("atlasc ") and ("--device gpu" in ln or " bench " in ln)]
    assert gpu_lines
    for line in [compile_line, *gpu_lines]:
        r = atlasc(*line.split()[1:])
        assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"


@needs_nvcc
@pytest.mark.gpu
def test_gpu_profile_and_bench_json(llama_artifact):
    """`atlasc profile --json`: one row per launched decode kernel (batch 1: the batch-1 variants),
    positive times and bytes; `atlasc bench --json`: one row per batch with positive speeds."""
    from atlasc.artifact import open_artifact

    decode = open_artifact(llama_artifact).manifest.entries["decode"]
    launched = [n for n in decode.nodes if n.kernel]
    r = atlasc("profile", llama_artifact, "--batch", "1", "--context", "16", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    rows = report["rows"]
    assert report["method"] == "graph"  # event nodes in a replayed graph, not host launches
    assert sorted(row["node"] for row in rows) == sorted(n.name for n in launched)
    assert all(row["us"] > 0 and row["bytes"] > 0 for row in rows)
    variants = {n.name: n.variants[0].kernel for n in launched if n.variants and n.variants[0].upto == 1}
    assert variants and all(row["kernel"] == variants[row["node"]] for row in rows if row["node"] in variants)
    r = atlasc("bench", llama_artifact, "--batch", "1,2", "--prompt", "8", "--gen", "8", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    bench = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert [row["batch"] for row in bench] == [1, 2]
    assert all(row["decode_ms_per_step"] > 0 and row["tokens_per_s"] > 0 for row in bench)


@needs_nvcc
@pytest.mark.gpu
def test_gpu_step_replay_and_pipelined_generation(llama_artifact):
    """examples/replay_ab.py's step_times on the GPU: positive, finite us per step for two artifacts loaded on
    one device; and the pipelined generation loop (GpuModel.submit) gives the plain loop's greedy tokens."""
    from atlasc.artifact import open_artifact
    from atlasc.runtime.bench import step_times
    from atlasc.runtime.device import Device
    from atlasc.runtime.generate import generate
    from atlasc.runtime.gpu import GpuModel

    dev = Device()
    a = GpuModel(open_artifact(llama_artifact), device=dev, cuda_graphs=False)
    b = GpuModel(open_artifact(llama_artifact), device=dev)
    for model in (a, b, a):
        times = step_times(model, batch=2, context=16, replays=3, steps=4)
        assert len(times) == 3 and all(0 < t < 1e5 for t in times)
    prompts = [[5, 17, 42, 7, 99], [3, 8]]
    plain = generate(b, prompts, 12, keep_logits=True)  # keep_logits: one step at a time
    piped = generate(b, prompts, 12)
    assert piped.tokens == plain.tokens and b._submitted == 11
    a.close()
    b.close()
    dev.close()  # pops the context: later tests in this process use their own device's
