"""Shared test fixtures: the bundled example models, and the `gpu` marker's skip rule.

ATLAS_GPU_PRECOMPILE=<arch> (examples/gpu_cache.py): the `gpu` tests run without a GPU up to their first
use of one, so that they generate and compile their kernels for that arch into the nvcc cache, and are
then skipped; runtime/device.Device is replaced by PrecompileDevice for the session.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "examples" / "fixtures"
# a line of `atlasc compile`'s progress on a stderr that is not a terminal (atlasc/cli/compile_cmd.py)
PROGRESS_LINE = re.compile(r"^\[ *\d+\.\d s\] ")

# reference tolerances of CPU runs (numpy references) against the fixtures' stored onnxruntime outputs. The fp16
# fixtures' logits are small (|max| ~0.5, std ~0.16) and their measured error is at most 4.9e-4 (fused or not), so
# fp16 gets ~4x that: 3e-2, the GPU tests' limit, let a 7% logits error pass (a test audit's finding)
TOL = {"fp32": {"atol": 1e-4, "rtol": 1e-3}, "fp16": {"atol": 2e-3, "rtol": 1e-2}}



EMPTY_KERNEL = 'extern "C" __global__ void atlasc_test_empty() {}\n'


@contextlib.contextmanager
def empty_cubins():
    """Within it, compile_model's nvcc stage gives each arch one cubin of an empty kernel (built by the real
    nvcc, cached as usual) instead of the module's: for tests of what the compiler decides and writes
    (manifest, launches, buckets, weights, graph capture with tests/fake_gpu.py), not of the cubins. The
    kernel source is still generated and stored in the artifact; the tests of the cubins compile theirs
    (test_compile.py, test_nvcc_chunked.py, the *_compile(s) and *_spills tests). CI time: .ci/run."""
    import atlasc.compiler
    from atlasc.codegen.nvcc import NvccNotFoundError, compile_cubins

    def compile_module(module, archs, *, on_built=None):
        try:
            cubins = compile_cubins(EMPTY_KERNEL, archs, on_built=on_built)
        except NvccNotFoundError:
            pytest.skip("nvcc not found (it builds the empty cubins)")
        return {arch: [cubins[arch]] for arch in archs}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(atlasc.compiler, "compile_module", compile_module)
        yield


@pytest.fixture
def no_nvcc():
    """empty_cubins() around the test."""
    with empty_cubins():
        yield


# a line of the dims loads a kernel runs before its wait (codegen/generate.py _dims_early, on by default)
DIMS_LOAD_LINE = re.compile(r"^  (const long long\* __restrict__ dims_buf = .*|long long d\[\d+\] = \{\};.*|"
                            r"d\[\d+\] = dims_buf\[\d+\];|\(void\)d;)\n", re.M)


def without_dims_loads(source: str) -> str:
    """Generated source less the dims-early loads' lines (and every `(void)d;`), for tests of what else precedes a
    kernel's wait; tests/test_dims_early.py checks the loads themselves."""
    return DIMS_LOAD_LINE.sub("", source)


MAIN_ARCH = "sm90"  # the GPU the kernels are measured on


def arch_params(*archs: str) -> list:
    """One pytest param per arch for a compile test: MAIN_ARCH in CI, the others marked slow (CI leaves
    slow out for its time, .ci/run; `pytest -m slow` and examples/gpu_check.sh run them). Every arch still
    compiles in CI through tests/test_compile.py's every-arch test."""
    return [pytest.param(a, marks=() if a == MAIN_ARCH else pytest.mark.slow) for a in archs]


PRECOMPILE_ENV = "ATLAS_GPU_PRECOMPILE"


class PrecompileDevice:
    """Stands in for runtime/device.Device under ATLAS_GPU_PRECOMPILE: it has the arch to compile for (and
    a name); any other use of it skips the test, whose kernels are compiled (and cached) by then."""

    def __init__(self, ordinal: int = 0):
        self.arch, self.name = os.environ[PRECOMPILE_ENV], "no GPU (precompile)"

    def __getattr__(self, name: str):
        pytest.skip(f"{PRECOMPILE_ENV}: kernels compiled for {self.arch}, no GPU to run them ({name})")


def pytest_configure(config):
    if os.environ.get(PRECOMPILE_ENV):
        import atlasc.runtime.device

        atlasc.runtime.device.Device = PrecompileDevice


@functools.cache
def _gpu_available() -> str | None:
    """None when pycuda and a CUDA device are usable (or ATLAS_GPU_PRECOMPILE is set), else the reason they
    are not."""
    if os.environ.get(PRECOMPILE_ENV):
        return None
    try:
        import pycuda.driver as cuda
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken CUDA install: skip either way)
        return f"pycuda not importable: {e}"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001  (any driver error means no usable GPU)
        return f"CUDA not usable: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_available()
    if reason is None:
        # pytest -n: other workers share the GPU meanwhile (precompiling uses no GPU: nothing to skip)
        if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(PRECOMPILE_ENV):
            alone = pytest.mark.skip(reason="gpu_alone: reads the device's free memory, so it runs without "
                                            "pytest -n (examples/gpu_check.sh runs it after the others)")
            for item in gpu_items:
                if "gpu_alone" in item.keywords:
                    item.add_marker(alone)
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def load_manifest() -> list[dict]:
    """The fixtures' manifest: one entry per model (name, arch, kind, cases, inputs, outputs ...)."""
    path = FIXTURES / "manifest.json"
    assert path.exists(), f"no fixtures manifest at {path}: run examples/export_hf.py"  # committed: never skip
    return json.loads(path.read_text())


@pytest.fixture
def fixtures_dir() -> Path:
    """examples/fixtures: `<name>.onnx` and `<name>.<case>.npz` (keys `in.<input>` / `out.<output>`)."""
    return FIXTURES


@pytest.fixture
def manifest() -> list[dict]:
    return load_manifest()


class CliResult:
    def __init__(self, code: int, stdout: str, stderr: str):
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def __repr__(self) -> str:
        return f"CliResult(code={self.code}, stdout={self.stdout!r}, stderr={self.stderr!r})"


@pytest.fixture
def cli(capsys):
    """Run `atlasc ARGS...` in-process through `atlasc.cli.main` (the real error boundary)."""
    from atlasc.cli import main

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:  # a warning would reach the user's terminal
            warnings.simplefilter("always")
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        ours = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]
        assert not ours, f"atlasc {' '.join(map(str, args))} warned: {ours}"
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return invoke


def assert_compile_refused(model, tmp_path: Path, needle: str) -> None:
    """`atlasc compile` of this ModelProto exits 2 with `needle` in a traceback-free message and writes
    no artifact."""
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    r = subprocess.run([sys.executable, "-m", "atlasc", "compile", str(path), "-o", str(tmp_path / "m.atlas"),
                        "--arch", "sm80"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert not (tmp_path / "m.atlas").exists()
