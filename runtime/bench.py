"""Benchmark and profile a decoder artifact on the GPU.

`bench`: for each batch size, prefill a prompt of random tokens and decode `gen` tokens, several
times; medians of prefill ms and decode ms/step, tokens/s, and the bandwidth roofline: the bytes a
decode step must read (every weight once, except embedding tables of which only the looked-up rows
are read, plus the KV cache up to the current length) over the bandwidth (4.30 TB/s measured on the
H200 by a device-to-device copy, or --bandwidth).

`profile`: one step captured as a CUDA graph with an event-record node around every kernel and replayed
(the kernels run back to back, as in `run`; the host only launches the graph): time, bytes moved and
FLOPs per kernel (from the manifest's shapes at that step's sizes).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np

from atlasc.artifact.dims import evaluate_dim
from atlasc.runtime.cudagraph import CapturedGraph, CudaGraphError, GraphEvents
from atlasc.runtime.generate import Sampling, generate
from atlasc.runtime.launches import node_launch

H200_BANDWIDTH = 4.30e12  # bytes/s, device-to-device copy measured on the H200 (shared/gpu/README.md)


@dataclass
class BenchRow:
    batch: int
    prompt: int
    gen: int
    prefill_ms: float
    decode_ms_per_step: float
    tokens_per_s: float
    bytes_per_step: int
    roofline_ms: float
    roofline_pct: float
    peak_device_gib: float


def _gathered_tables(manifest) -> dict[str, int]:
    """Weights read only through Gather's data input (embedding tables): name -> bytes of one row."""
    weights = {w.name: w for w in manifest.weights}
    used_other, gathered = set(), {}
    for e in manifest.entries.values():
        for n in e.nodes:
            for k, i in enumerate(n.inputs):
                if i in weights:
                    if n.op == "Gather" and k == 0 and n.attrs.get("axis", 0) == 0:
                        w = weights[i]
                        gathered[i] = w.nbytes // max(w.shape[0], 1)
                    else:
                        used_other.add(i)
    return {k: v for k, v in gathered.items() if k not in used_other}


def decode_bytes(manifest, batch: int, context: int) -> int:
    """Bytes one decode step must read: weights once (embedding rows only) + the KV cache so far."""
    tables = _gathered_tables(manifest)
    total = sum(w.nbytes for w in manifest.weights if w.name not in tables)
    total += sum(row * batch for row in tables.values())
    kv = manifest.kv_cache
    if kv is not None:
        total += 2 * kv.layers * batch * kv.kv_heads * context * kv.head_dim * np.dtype(kv.dtype).itemsize
    return total


def bench(model, batches, prompt: int, gen: int, repeats: int = 3, bandwidth: float = H200_BANDWIDTH,
          seed: int = 0) -> list[BenchRow]:
    """Median timings per batch size (see the module docstring)."""
    m = model.manifest
    vocab = int(m.entries["prefill"].outputs[0].shape[-1])
    rng = np.random.default_rng(seed)
    rows = []
    for b in batches:
        prompts = [list(rng.integers(1, vocab, size=prompt)) for _ in range(b)]
        generate(model, prompts, min(gen, 4))  # warm up: graph capture, caches
        prefill, steps = [], []
        for _ in range(repeats):
            r = generate(model, prompts, gen, sampling=Sampling())
            prefill.append(r.prefill_seconds)
            steps += r.decode_seconds
        step = statistics.median(steps) if steps else float("nan")
        nbytes = decode_bytes(m, b, prompt + gen // 2)
        roof = nbytes / bandwidth
        free, total = model.dev.free_memory()
        rows.append(BenchRow(b, prompt, gen, round(statistics.median(prefill) * 1e3, 3), round(step * 1e3, 4),
                             round(b / step, 1), nbytes, round(roof * 1e3, 4), round(100 * roof / step, 1),
                             round((total - free) / 2**30, 2)))
    return rows


@dataclass
class KernelRow:
    kernel: str
    op: str
    node: str
    us: float
    bytes: int
    flops: int
    method: str = "graph"  # how it was timed: "graph" (event nodes in a replayed graph) or "host" launches

    @property
    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9 if self.us else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e-6) / 1e12 if self.us else 0.0


def _numel(shape_json, env) -> int:
    n = 1
    for d in shape_json:
        n *= evaluate_dim(d, env)
    return n


def _write_step_inputs(model, batch: int, context: int, entry: str) -> tuple[dict, object]:
    """Upload inputs for one step of `entry` at (batch, context) (token ids 1, zero floats, greedy sampling);
    returns the symbol values and the manifest entry that serves the call (decode_small when it is narrower)."""
    m = model.manifest
    e = m.entries[entry]
    roles = m.report.get("roles", {})
    seq = 1 if entry == "decode" else context
    past = context - seq if entry == "decode" else 0
    env = {roles.get("batch", "batch"): batch, roles.get("past", "past_seq"): past, **e.bindings}
    if entry != "decode":
        env[roles.get("seq", "seq")] = seq
    feeds = {}
    for spec in e.inputs:
        shape = tuple(evaluate_dim(d, env) for d in spec.shape)
        if spec.name == "sample_params":
            feeds[spec.name] = np.array([0, 1, 0], np.float32)
        elif spec.name == "sample_state":
            feeds[spec.name] = np.zeros(3, np.int64)
        elif spec.dtype == "int64":
            feeds[spec.name] = np.ones(shape, np.int64)
        else:
            feeds[spec.name] = np.zeros(shape, np.dtype(spec.dtype))
    model.write_inputs(entry, feeds, {roles.get("past", "past_seq"): past})
    return env, m.entries[model.routed.get(entry, entry)]


def step_times(model, batch: int = 1, context: int = 128, replays: int = 10, steps: int = 10) -> list[float]:
    """Microseconds per decode step at (batch, context), one value per replay: `steps` copies of the step's
    launches captured back to back in one CUDA graph (programmatic edges where the model has them, model.pdl)
    between two event nodes, replayed `replays` times after one warm-up. The GPU runs the steps without the
    host in between, so two artifacts timed in turn in one process compare their kernels alone."""
    env, e = _write_step_inputs(model, batch, context, "decode")
    launches = [(*node_launch(n, env), n.name) for n in e.nodes if n.kernel]
    stream = model.dev.stream
    events = GraphEvents(2)
    graph = None
    try:

        def record():
            events.record(stream, 0)
            for _ in range(steps):
                model._launch_all(launches)
            events.record(stream, 1)

        graph = CapturedGraph(stream, record, programmatic=model.pdl)
        graph.launch()  # warm-up
        events.elapsed_ms()
        out = []
        for _ in range(replays):
            graph.launch()
            out.append(events.elapsed_ms()[0] * 1e3 / steps)
        return out
    finally:
        if graph is not None:
            graph.close()
        events.close()


def profile(model, batch: int = 1, context: int = 128, entry: str = "decode", repeats: int = 20) -> list[KernelRow]:
    """Median per-kernel time of one step of `entry` at (batch, context). The step is captured as a CUDA
    graph with an event-record node before every kernel and after the last (GraphEvents), and replayed:
    the GPU runs the kernels back to back, and a kernel's time is the span between its two events (the
    gap before the next kernel included), so the rows add up to the replayed step. Where the driver
    refuses event nodes in a capture, each kernel is launched from the host between two events instead
    (KernelRow.method "host"), which counts the host's launch time for kernels shorter than it."""
    m = model.manifest
    env, e = _write_step_inputs(model, batch, context, entry)
    cuda = model.dev.cuda
    values = {v.name: v for v in e.values}
    weights = {w.name: w for w in m.weights}

    def nbytes(name):
        if name in weights:
            return weights[name].nbytes
        v = values[name]
        return _numel(v.shape, env) * np.dtype(v.dtype).itemsize

    launched = [n for n in e.nodes if n.kernel]  # "": an aliased reshape, no kernel
    times = {n.name: [] for n in launched}
    launches = [node_launch(n, env) for n in launched]  # the variants a run at this batch uses
    method = "graph"
    try:
        _time_in_graph(model, launched, launches, times, repeats)
    except CudaGraphError:
        method = "host"
        for n in launched:
            times[n.name].clear()
        # launched from the host, back to back, each between two events; one wait per step (a wait after
        # every kernel let the GPU idle and clock down: the v5 profile summed to 2x the replayed step)
        events = [(cuda.Event(), cuda.Event()) for _ in launched]
        for _ in range(repeats):
            for n, (kernel, grid, block, smem, args), (start, end) in zip(launched, launches, events):
                start.record(model.dev.stream)
                model.kernels.launch(kernel, grid, block, smem, model.arena, node=n.name, args=args)
                end.record(model.dev.stream)
            events[-1][1].synchronize()
            for n, (start, end) in zip(launched, events):
                times[n.name].append(end.time_since(start) * 1e3)
    def moved_by(n) -> int:
        moved = sum(nbytes(i) for i in n.inputs if i) + sum(nbytes(o) for o in n.outputs)
        if n.op == "Gather" and n.inputs[0] in weights:  # an embedding lookup reads rows, not the table
            moved -= weights[n.inputs[0]].nbytes - nbytes(n.outputs[0])
        return moved

    # a chain kernel (codegen/quant_chain.py) computes the nodes it names; the ones after its first launch nothing
    chains = {k: c["chain"] for k, c in m.report.get("codegen", {}).get("kernels", {}).items() if c.get("chain")}
    by_name = {n.name: n for n in e.nodes}
    rows = []
    for n, (kernel, *_) in zip(launched, launches):
        nodes = [by_name[name] for name in chains.get(kernel, [n.name])]
        op = "+".join(x.op for x in nodes)  # a chain's row names its phases' ops
        rows.append(KernelRow(kernel, op, n.name, statistics.median(times[n.name]), sum(map(moved_by, nodes)),
                              sum(_flops(x, values, weights, env) for x in nodes), method))
    return sorted(rows, key=lambda r: -r.us)


def _time_in_graph(model, launched, launches, times: dict, repeats: int) -> None:
    """times[node] += the us of each replay of the step captured with an event node around every kernel."""
    stream = model.dev.stream
    events = GraphEvents(len(launched) + 1)
    graph = None
    try:

        def record():
            for i, (n, (kernel, grid, block, smem, args)) in enumerate(zip(launched, launches)):
                events.record(stream, i)
                model.kernels.launch(kernel, grid, block, smem, model.arena, node=n.name, args=args)
            events.record(stream, len(launched))

        graph = CapturedGraph(stream, record)
        graph.launch()  # warm-up
        events.elapsed_ms()
        for _ in range(repeats):
            graph.launch()
            for n, ms in zip(launched, events.elapsed_ms()):
                times[n.name].append(ms * 1e3)
    finally:
        if graph is not None:
            graph.close()
        events.close()


def _flops(n, values, weights, env) -> int:
    def shape(name):
        if name in weights:
            return tuple(weights[name].shape)
        return tuple(evaluate_dim(d, env) for d in values[name].shape)

    out = shape(n.outputs[0])
    w_index = {"NormLinear": 3, "NormLinearQ": 3, "NormLinearRotary": 5, "LinearGated": 1, "LinearRotary": 3}.get(n.op)
    if w_index is not None:  # 2 x rows x N x K (the weight's rows are the projection's outputs)
        x = shape(n.inputs[0])
        return 2 * int(np.prod(x[:-1])) * x[-1] * shape(n.inputs[w_index])[0]
    if n.op in ("MatMul", "Linear", "Gemm"):
        k = shape(n.inputs[0])[-1]
        return 2 * int(np.prod(out)) * k
    if n.op == "Attention":
        q, kk = shape(n.inputs[0]), shape(n.inputs[1])
        return 4 * int(np.prod(q)) * kk[-2]
    return int(np.prod(out))


def rows_as_dicts(rows) -> list[dict]:
    return [asdict(r) for r in rows]
