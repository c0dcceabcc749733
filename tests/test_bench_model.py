"""The byte count behind `atlasc bench`'s roofline (CPU: it reads only the manifest), and `atlasc profile`'s
graph timing against a simulated driver."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.bench import _gathered_tables, decode_bytes

from conftest import FIXTURES
from fake_gpu import FakeDevice


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_decode_bytes_counts_weights_once_embedding_rows_and_the_cache(tmp_path, no_nvcc):
    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm80",), max_batch=4, max_seq=64))
    with open_artifact(path) as art:
        m = art.manifest
        tables = _gathered_tables(m)
        assert len(tables) == 1  # the token embedding: read by Gather only
        (name, row), = tables.items()
        table = next(w for w in m.weights if w.name == name)
        assert row == table.nbytes // table.shape[0] == table.shape[1] * 4
        others = sum(w.nbytes for w in m.weights if w.name != name)
        kv = m.kv_cache
        per_token = 2 * kv.layers * kv.kv_heads * kv.head_dim * np.dtype(kv.dtype).itemsize
        assert decode_bytes(m, 1, 10) == others + row + 10 * per_token
        assert decode_bytes(m, 3, 20) == others + 3 * row + 3 * 20 * per_token


class _FakeGraphDriver:
    """The libcuda calls of CapturedGraph and GraphEvents, simulated: a capture records event and kernel
    launches in order; a graph launch walks them with each kernel taking its fixed duration, stamping
    each event with the time reached (so elapsed times are exactly the kernels' durations)."""

    def __init__(self, durations_us: dict[str, float]):
        self.durations, self.capturing, self.graphs, self.stamps, self.next_id = durations_us, None, {}, {}, 1
        self.uploaded = 0  # graphs uploaded (cuGraphUpload)

    def _id(self, out) -> int:
        self.next_id += 1
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self.next_id
        return self.next_id

    def cuStreamBeginCapture_v2(self, stream, mode):
        self.capturing = []
        return 0

    def cuStreamEndCapture(self, stream, graph):
        self.graphs[self._id(graph)] = self.capturing
        self.capturing = None
        return 0

    def cuGraphInstantiateWithFlags(self, exec_, graph, flags):
        ctypes.cast(exec_, ctypes.POINTER(ctypes.c_void_p))[0] = graph.value
        return 0

    def cuGraphUpload(self, exec_, stream):
        assert exec_.value in self.graphs  # an instantiated graph
        self.uploaded += 1
        return 0

    def cuGraphLaunch(self, exec_, stream):
        t = 0.0
        for kind, what in self.graphs[exec_.value]:
            if kind == "event":
                self.stamps[what] = t
            else:
                t += self.durations[what]
        return 0

    def cuEventCreate(self, ev, flags):
        self._id(ev)
        return 0

    def cuEventRecordWithFlags(self, ev, stream, flags):
        assert flags.value == 1 and self.capturing is not None  # CU_EVENT_RECORD_EXTERNAL, inside a capture
        self.capturing.append(("event", ev.value))
        return 0

    def cuEventSynchronize(self, ev):
        return 0

    def cuEventElapsedTime_v2(self, ms, a, b):
        ctypes.cast(ms, ctypes.POINTER(ctypes.c_float))[0] = (self.stamps[b.value] - self.stamps[a.value]) / 1e3
        return 0

    def cuGraphExecDestroy(self, exec_):
        return 0

    def cuGraphDestroy(self, graph):
        return 0

    def cuEventDestroy_v2(self, ev):
        return 0


def _fake_model(manifest, driver):
    """A stand-in GpuModel for bench.profile: its launches recorded into the simulated driver's capture."""
    from types import SimpleNamespace

    def launch(kernel, grid, block, smem, arena, node="", args=()):
        driver.capturing.append(("kernel", (kernel, args)))

    return SimpleNamespace(manifest=manifest, arena=0, kernels=SimpleNamespace(launch=launch),
                           dev=SimpleNamespace(stream=SimpleNamespace(handle=1), cuda=None),
                           write_inputs=lambda entry, feeds, symbols: None, routed={})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_profile_times_each_kernel_between_its_graph_events(tmp_path, monkeypatch, no_nvcc):
    """`atlasc profile`'s graph timing, with a simulated driver: every launched decode kernel gets exactly
    the time between the events around it (the batch-1 variants at batch 1), method "graph"."""

    from atlasc.runtime import bench, cudagraph
    from atlasc.runtime.launches import node_launch

    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    art = open_artifact(path)
    m = art.manifest
    launched = [n for n in m.entries["decode"].nodes if n.kernel]
    env = {"batch": 1, "past_seq": 15, **m.entries["decode"].bindings}
    calls = [(node_launch(n, env)[0], node_launch(n, env)[4]) for n in launched]  # (kernel, args)
    assert len(set(calls)) == len(calls) > len({k for k, _ in calls})  # layers share kernels, not offsets
    durations = {c: 1.0 + i for i, c in enumerate(calls)}  # distinct us per launch
    driver = _FakeGraphDriver(durations)
    monkeypatch.setattr(cudagraph, "_libcuda", lambda: driver)

    model = _fake_model(m, driver)
    rows = bench.profile(model, batch=1, context=16, repeats=3)
    assert len(rows) == len(launched) and {r.method for r in rows} == {"graph"}
    by_node = {r.node: r for r in rows}
    for n, (k, args) in zip(launched, calls):
        assert by_node[n.name].kernel == k and by_node[n.name].us == pytest.approx(durations[k, args], rel=1e-5)
    art.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_profile_counts_a_chains_nodes_in_its_row(tmp_path, monkeypatch, no_nvcc):
    """A chain kernel (ATLAS_QUANT_BULK_CHAIN=1, codegen/quant_chain.py) is one row of `atlasc profile`: the nodes it
    computes named by their ops, their bytes and FLOPs summed; the nodes after its first get no row."""

    from test_gpu_runtime import _llama_h128

    from atlasc.runtime import bench, cudagraph
    from atlasc.runtime.launches import node_launch

    monkeypatch.setenv("ATLAS_QUANT_BULK_CHAIN", "1")
    monkeypatch.setenv("ATLAS_INT4_PATH", "w4a16-bulk")
    path = tmp_path / "h.atlas"
    compile_model(_llama_h128(tmp_path), path, CompileOptions(archs=("sm90",), max_batch=1, max_seq=64,
                                                               quant="int4", group_size=128))
    art = open_artifact(path)
    m = art.manifest
    chains = {k: c["chain"] for k, c in m.report["codegen"]["kernels"].items() if c.get("chain")}
    env = {"batch": 1, "past_seq": 15, **m.entries["decode"].bindings}
    launched = [n for n in m.entries["decode"].nodes if n.kernel]
    driver = _FakeGraphDriver({(node_launch(n, env)[0], node_launch(n, env)[4]): 1.0 for n in launched})
    monkeypatch.setattr(cudagraph, "_libcuda", lambda: driver)

    model = _fake_model(m, driver)
    rows = {r.kernel: r for r in bench.profile(model, batch=1, context=16, repeats=1)}
    assert len(rows) == len(launched) and len(chains) == 2
    weights = {w.name: w.nbytes for w in m.weights}
    nodes = {n.name: n for n in m.entries["decode"].nodes}
    for kernel, names in chains.items():
        members = [nodes[name] for name in names]
        assert rows[kernel].op == "+".join(n.op for n in members) and rows[kernel].op.startswith("LinearQ4+NormLinearQ")
        # at least every member's weights (packed codes and scales) are counted
        assert rows[kernel].bytes > sum(weights[i] for n in members for i in n.inputs if i in weights) > 0
        assert rows[kernel].flops > 0
    art.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_step_times_replay_the_decode_step_between_two_events(tmp_path, monkeypatch, no_nvcc):
    """bench.step_times with a simulated driver: one graph holds `steps` copies of the batch's decode launches
    between two events; each replay gives their summed duration / steps."""
    from types import SimpleNamespace

    from atlasc.runtime import bench, cudagraph
    from atlasc.runtime.launches import node_launch

    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    art = open_artifact(path)
    m = art.manifest
    env = {"batch": 3, "past_seq": 15, **m.entries["decode"].bindings}
    kernels = [node_launch(n, env)[0] for n in m.entries["decode"].nodes if n.kernel]
    durations = {k: 1.0 + i for i, k in enumerate(dict.fromkeys(kernels))}
    driver = _FakeGraphDriver(durations)
    monkeypatch.setattr(cudagraph, "_libcuda", lambda: driver)
    captured = []

    def launch_all(launches):
        for kernel, *_ in launches:
            driver.capturing.append(("kernel", kernel))
        captured.append([k for k, *_ in launches])

    model = SimpleNamespace(manifest=m, arena=0, _launch_all=launch_all, pdl=False,
                            dev=SimpleNamespace(stream=SimpleNamespace(handle=1), cuda=None),
                            write_inputs=lambda entry, feeds, symbols: None, routed={})
    times = bench.step_times(model, batch=3, context=16, replays=4, steps=5)
    assert captured == [kernels] * 5  # the batch-3 variants (bucket 4), five steps in one capture
    assert times == pytest.approx([sum(durations[k] for k in kernels)] * 4, rel=1e-5)
    art.close()


def test_fused_projections_count_their_matmul_flops():
    """`atlasc profile`'s FLOPs of NormLinear / NormLinearQ / NormLinearRotary (artifact nodes: names as
    inputs): 2 x rows x N x K of the projection they hold (not one per output element)."""
    from types import SimpleNamespace as NS

    from atlasc.runtime.bench import _flops

    values = {"a": NS(shape=(3, 1, 64)), "y": NS(shape=(3, 1, 96)), "q": NS(shape=(3, 2, 1, 16))}
    weights = {"w": np.zeros((96, 64), np.float16), "wq": np.zeros((96, 32), np.uint8), "s": np.zeros(96)}
    want = 2 * 3 * 96 * 64
    assert _flops(NS(op="NormLinear", inputs=["a", "", "g", "w"], outputs=["y"]), values, weights, {}) == want
    assert _flops(NS(op="NormLinearQ", inputs=["a", "", "g", "wq", "s"], outputs=["y"]), values, weights, {}) == want
    rot = NS(op="NormLinearRotary", inputs=["a", "", "g", "", "", "w"], outputs=["q", "pk", "pv"])
    assert _flops(rot, values, weights, {}) == want
    assert _flops(NS(op="Add", inputs=["a", "a"], outputs=["y"]), values, weights, {}) == 3 * 96



def _fake_gpu(monkeypatch):
    """(simulated driver, device whose launches go into the driver's capture, list of replayed graphs)."""
    from atlasc.runtime import cudagraph

    driver = _FakeGraphDriver({})
    monkeypatch.setenv("ATLAS_PDL", "0")  # the simulated driver has plain edges only
    replayed = []
    driver.cuGraphLaunch = lambda exec_, stream: replayed.append(exec_.value) or 0
    monkeypatch.setattr(cudagraph, "_libcuda", lambda: driver)
    device = FakeDevice()
    device.on_launch = lambda name: (driver.capturing if driver.capturing is not None
                                     else device.launched).append(("kernel", name))
    return driver, device, replayed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("fixture,max_batch,batches", [("llama", 4, (1, 2)), ("llama-fp16", 16, (3, 12))])
def test_gpu_model_captures_every_graph_at_load(tmp_path, monkeypatch, fixture, max_batch, batches, no_nvcc):
    """No device allocation after load: GpuModel captures, instantiates and uploads the CUDA graph of every
    (entry, batch bucket) while loading (a simulated driver and device), so generating at batch sizes that
    take the batch-1 bucket, the default kernels, and (max batch 16) the decode_small twin or decode,
    captures none and launches no kernel outside a graph; without graphs nothing is captured."""
    from atlasc.runtime.generate import generate
    from atlasc.runtime.gpu import GpuModel
    from atlasc.runtime.launches import entry_buckets

    path = tmp_path / f"{fixture}.atlas"
    compile_model(FIXTURES / f"{fixture}.onnx", path, CompileOptions(archs=("sm90",), max_batch=max_batch,
                                                                      max_seq=64))
    driver, device, replayed = _fake_gpu(monkeypatch)
    with open_artifact(path) as art:
        model = GpuModel(art, device=device)
        want = {(name, upto) for name, e in art.manifest.entries.items() for upto in (*entry_buckets(e)[1], None)}
        assert set(model.graphs) == want and any(upto is not None for _, upto in want)
        assert driver.uploaded == len(want) == len(driver.graphs)
        used = set()
        for b in batches:
            replayed.clear()
            generate(model, [[1 + i, 2, 3] for i in range(b)], 3)
            assert replayed and not device.launched and len(driver.graphs) == len(want)
            used |= {key for key, g in model.graphs.items() if g.exec.value in replayed}
        assert len(used) >= 3  # prefill and two decode graphs: not every generation took one key
        eager = GpuModel(art, device=FakeDevice(), cuda_graphs=False)
        assert not eager.graphs and len(driver.graphs) == len(want)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_gpu_model_load_that_runs_out_of_memory_for_graphs_frees_everything(tmp_path, monkeypatch, no_nvcc):
    """A graph upload that runs out of device memory at load: DeviceOutOfMemoryError (one line, a hint),
    the arena and every graph made so far freed."""
    from atlasc.runtime.device import DeviceOutOfMemoryError
    from atlasc.runtime.gpu import GpuModel

    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    driver, device, _ = _fake_gpu(monkeypatch)
    destroyed = []
    driver.cuGraphExecDestroy = lambda exec_: destroyed.append(exec_.value) or 0
    driver.cuGraphUpload = lambda exec_, stream: 2 if len(driver.graphs) == 2 else 0  # CUDA_ERROR_OUT_OF_MEMORY

    def error_string(result, msg):
        ctypes.cast(msg, ctypes.POINTER(ctypes.c_char_p))[0] = b"out of memory"
        return 0

    driver.cuGetErrorString = error_string
    with open_artifact(path) as art:
        with pytest.raises(DeviceOutOfMemoryError, match="CUDA graphs do not fit") as info:
            GpuModel(art, device=device)
    assert "\n" not in str(info.value) and "--no-cuda-graphs" in info.value.hint
    assert device.freed == 1 and len(destroyed) == 2  # the graph that failed, and the one before it


@pytest.mark.parametrize("env", ["ATLAS_PDL", "ATLAS_COPY_STREAM", "ATLAS_MAPPED_STAGING"])
def test_runtime_switches_are_on_unless_0(env, monkeypatch):
    """ATLAS_PDL (programmatic graph edges, docs/perf.md v17), ATLAS_COPY_STREAM (the tokens' copy back on a
    second stream) and ATLAS_MAPPED_STAGING (a pipelined step's inputs and tokens through mapped memory, v24): on
    by default, 0 turns them off, anything else is a one-line usage error."""
    from atlasc.errors import UsageError
    from atlasc.runtime.gpu import copy_stream_setting, pdl_setting
    from atlasc.runtime.staging import mapped_setting

    setting = {"ATLAS_PDL": pdl_setting, "ATLAS_COPY_STREAM": copy_stream_setting,
               "ATLAS_MAPPED_STAGING": mapped_setting}[env]
    monkeypatch.delenv(env, raising=False)
    assert setting() is True
    monkeypatch.setenv(env, "0")
    assert setting() is False
    monkeypatch.setenv(env, "on")
    with pytest.raises(UsageError, match=f"{env}='on'"):
        setting()


def test_bench_vs_torch_refuses_an_unknown_quant_before_any_work():
    """examples/bench_vs_torch.py --quant takes a comma-separated list; an unknown member is a usage error
    (exit 2) naming it, before any model is built or a GPU is touched; so is a --compile-jobs below 1."""
    import subprocess
    import sys

    script = FIXTURES.parent / "bench_vs_torch.py"
    r = subprocess.run([sys.executable, str(script), "--quant", "int8,int3", "--skip-torch"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown int3" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(script), "--compile-jobs", "0", "--skip-torch"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--compile-jobs: 0 is not a positive count" in r.stderr


def _compile_stub(onnx_path, art_path, options, switch):
    """bench_vs_torch.compile_in_child's stand-in for test_bench_vs_torch_compiles_in_parallel_then_benches_in_order:
    runs in the pool's spawned process; writes the switch it saw in its own environment and its pid into the
    artifact; fails for the value "fail"."""
    import os

    if switch and switch[1] == "fail":
        raise RuntimeError("stub compile failed")
    if switch:
        os.environ[switch[0]] = switch[1]
    art_path.write_text(f"{switch[0]}={os.environ.get(switch[0])} pid {os.getpid()}")
    return f"stub {switch[1]}"


def test_bench_vs_torch_compiles_in_parallel_then_benches_in_order(monkeypatch, tmp_path, capsys):
    """--compile-jobs 2 with --compile-ab NAME=a,b: both artifacts are compiled in other processes (each with its
    switch set there) before the first is benched, then benched in the runs' order with the switch also set in
    this process; every artifact but the last is removed after its bench. Without jobs, compile and bench
    alternate in this process."""
    import os

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import bench_vs_torch

    import atlasc.artifact
    import atlasc.runtime.bench
    import atlasc.runtime.device
    import atlasc.runtime.gpu

    events = []

    class Dev:
        arch = "sm90"

    class Model:
        pdl, pdl_error = True, None

        def __init__(self, art, device):
            events.append(("bench", art, os.environ.get("ATLAS_TEST_SWITCH")))

        def close(self):
            pass

    monkeypatch.setattr(bench_vs_torch, "write", lambda cfg, path: path.write_text("onnx"))
    monkeypatch.setattr(bench_vs_torch, "compile_in_child", _compile_stub)
    monkeypatch.setattr(bench_vs_torch, "compile_one", _compile_stub)
    monkeypatch.setattr(atlasc.runtime.device, "Device", Dev)
    monkeypatch.setattr(atlasc.runtime.gpu, "GpuModel", Model)
    monkeypatch.setattr(atlasc.artifact, "open_artifact", lambda path: path.read_text())
    monkeypatch.setattr(atlasc.runtime.bench, "bench", lambda model, *a: [])
    monkeypatch.setattr(atlasc.runtime.bench, "rows_as_dicts", lambda rows: [{"batch": 1}])
    monkeypatch.setenv("ATLAS_TEST_SWITCH", "")  # so that the switch set here is undone after the test
    monkeypatch.delenv("ATLAS_TEST_SWITCH")
    rows = bench_vs_torch.bench_atlasc("llama-3.2-1b", [1], 8, 8, tmp_path, 1, ("int4",),
                                       compile_ab="ATLAS_TEST_SWITCH=a,b", jobs=2)
    assert [r["engine"] for r in rows] == ["atlasc ATLAS_TEST_SWITCH=a", "atlasc ATLAS_TEST_SWITCH=b"]
    (_, art_a, env_a), (_, art_b, env_b) = events
    assert (art_a.split()[0], env_a) == ("ATLAS_TEST_SWITCH=a", "a")
    assert (art_b.split()[0], env_b) == ("ATLAS_TEST_SWITCH=b", "b")
    assert str(os.getpid()) not in (art_a.split()[-1], art_b.split()[-1])  # compiled in the pool's processes
    out = capsys.readouterr().out
    assert out.index("[atlasc ATLAS_TEST_SWITCH=b] stub b") < out.index("[atlasc ATLAS_TEST_SWITCH=a] {'batch': 1}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-3.2-1b-ATLAS_TEST_SWITCHb.atlas", "llama-3.2-1b.onnx"]
    events.clear()
    bench_vs_torch.bench_atlasc("llama-3.2-1b", [1], 8, 8, tmp_path, 1, ("int4",),
                                compile_ab="ATLAS_TEST_SWITCH=a,b")
    assert [e[1].split()[-1] for e in events] == [str(os.getpid())] * 2  # one at a time, here
    out = capsys.readouterr().out
    assert out.index("[atlasc ATLAS_TEST_SWITCH=a] {'batch': 1}") < out.index("[atlasc ATLAS_TEST_SWITCH=b] stub b")
    # a failed compile in the pool stops the bench before any artifact is benched
    events.clear()
    with pytest.raises(RuntimeError, match="stub compile failed"):
        bench_vs_torch.bench_atlasc("llama-3.2-1b", [1], 8, 8, tmp_path, 1, ("int4",),
                                    compile_ab="ATLAS_TEST_SWITCH=fail,b", jobs=2)
    assert events == []


def test_compile_one_prints_each_stage(monkeypatch, tmp_path, capsys):
    """bench_vs_torch.compile_one prints a line, with the artifact's name, as the compile enters each stage (not at
    each detail), so that a bench cut by a time limit shows where its compiles were."""
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import bench_vs_torch

    import atlasc.compiler

    class Result:
        class manifest:  # noqa: N801 - stands in for the result's attribute
            entries = {}

        seconds = {}

    def compile_model(onnx_path, art_path, options, progress):
        for stage, detail in (("import", "m.onnx"), ("pass", "canonicalize"), ("pass", "dce"),
                              ("accuracy", "prompt 1"), ("accuracy", "prompt 2"), ("nvcc", "sm90")):
            progress(stage, detail)
        return Result

    monkeypatch.setattr(atlasc.compiler, "compile_model", compile_model)
    assert bench_vs_torch.compile_one(tmp_path / "m.onnx", tmp_path / "m.atlas", None, None).startswith("compiled in")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[compile m.atlas]")]
    assert [line.split(": ")[-1] for line in lines] == ["import", "pass", "accuracy", "nvcc"]


def test_compile_in_child_sends_back_the_message(monkeypatch, tmp_path):
    """bench_vs_torch.compile_in_child turns a compile's error (the compiler's own classes need not survive the trip
    between processes) into a RuntimeError naming the artifact, the error's class and its message."""
    from conftest import REPO

    from atlasc.errors import UnsupportedModelError

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import bench_vs_torch

    def fail(*args):
        raise UnsupportedModelError([("Foo", "23", "n0")])

    monkeypatch.setattr(bench_vs_torch, "compile_one", fail)
    with pytest.raises(RuntimeError, match=r"^m\.atlas: UnsupportedModelError: unsupported ONNX op: Foo \(opset 23"):
        bench_vs_torch.compile_in_child(tmp_path / "m.onnx", tmp_path / "m.atlas", None, None)
