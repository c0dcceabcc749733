"""Run an artifact on an NVIDIA GPU: one arena, weights uploaded once, prepared launches, CUDA graphs.

Load: verify the artifact, load the cubins for this GPU's arch (a clear error names the arches the
artifact has), make the one device allocation (an out-of-memory error gives the bytes needed and
free), upload the weights image in one copy, and capture the CUDA graph of every entry and batch bucket
(instantiated and uploaded: the driver's own allocation for them happens here too). Run: write the dims
buffer and the inputs into the arena, launch the entry's kernels (or replay its captured CUDA graph), read
the outputs back. No device allocation happens after load. ATLAS_PDL=1 (sm90+; opt-in: 3% faster at batch
1 in docs/perf.md v7, 5% slower in v9) makes the captured graphs' kernel-to-kernel edges programmatic, so a
kernel's blocks launch while the previous kernel drains (each kernel waits for its inputs in
atlas::pdl_enter and lets the next one launch in atlas::pdl_leave, its last statement).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import numpy as np

from atlasc.artifact import Artifact
from atlasc.runtime.bind import bind_call, output_shape
from atlasc.runtime.cudagraph import CUDA_ERROR_OUT_OF_MEMORY, PDL_ENV, CapturedGraph, CudaGraphError
from atlasc.runtime.device import Device, DeviceOutOfMemoryError, KernelTable
from atlasc.runtime.launches import bucket_of, entry_buckets, node_launch


class GpuModel:
    """An artifact loaded on the GPU; same interface as CpuModel (`run`, `reset`, `manifest`)."""

    device = "gpu"

    def __init__(self, artifact: Artifact, *, device: Device | None = None, cuda_graphs: bool = True):
        self.dev = device or Device()
        m = artifact.manifest
        self.manifest = m
        # one module per cubin part (a chunked build has several; each kernel lives in one of them)
        self.modules = [self.dev.load_module(cubin) for cubin in artifact.cubins(self.dev.arch)]
        self.arena = self.dev.alloc_arena(m.memory.arena_bytes)
        weights = artifact.weights_array()
        t = time.perf_counter()
        self.dev.upload(self.arena, 0, weights)
        self.dev.synchronize()
        self.upload_seconds = time.perf_counter() - t
        scratch = m.memory.regions.get("scratch")
        if scratch is not None:  # kernels' counters start at 0 (and every kernel leaves them at 0)
            self.dev.cuda.memset_d8_async(int(self.arena) + scratch.offset, 0, scratch.nbytes, self.dev.stream)
            self.dev.synchronize()
        self.symbols = [s.name for s in m.symbols]
        self.bounds = {s.name: (s.lower, s.upper) for s in m.symbols}
        self.buckets = {name: entry_buckets(e) for name, e in m.entries.items()}
        self.schedules = {}  # (entry, bucket) -> [(kernel, grid, block, smem, node)], built on first use
        self.last_env = {}  # entry -> the symbol values of its latest write_inputs
        self.routed: dict[str, str] = {}  # entry called -> the entry its latest write_inputs ran (bind_call)
        kernels = sorted({k for e in m.entries.values() for n in e.nodes if n.kernel  # "": an aliased reshape
                          for k in (n.kernel, *(v.kernel for v in n.variants))})
        self.kernels = KernelTable(self.dev, self.modules, kernels)
        self.dims_host = self.dev.cuda.pagelocked_zeros(max(len(self.symbols), 1), np.int64)
        self.cuda_graphs = cuda_graphs
        # programmatic dependent launch inside the captured graphs: opt-in (ATLAS_PDL=1; measured 3% at batch
        # 1, +-1% at 8 / 32: docs/perf.md v7); needs sm90+ and kernels starting with atlas::pdl_enter (report.codegen)
        self.pdl = (os.environ.get(PDL_ENV, "0") == "1" and int(self.dev.arch[2:]) >= 90
                    and bool(m.report.get("codegen", {}).get("pdl_wait")))
        self.pdl_error = ""  # why the driver refused programmatic edges, when it did (graphs fall back)
        self.graphs = {}
        if cuda_graphs:  # every (entry, bucket) graph now: instantiating one allocates device memory
            try:
                for name, (symbol, uptos) in self.buckets.items():
                    for upto in (*uptos, None):  # None: the default kernels, above every bucket
                        self._graph(*self.schedule(name, {symbol: upto} if upto is not None else {}))
                self.dev.synchronize()
            except BaseException as e:  # a failed load keeps nothing on the device
                self.close()
                if isinstance(e, CudaGraphError) and e.code == CUDA_ERROR_OUT_OF_MEMORY:
                    raise DeviceOutOfMemoryError(f"the model's CUDA graphs do not fit beside its arena: {e}",
                                                 hint="compile with a smaller --max-batch / --max-seq, or run "
                                                      "with --no-cuda-graphs") from None
                raise
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the KV cache (a new generation starts)."""
        kv = self.manifest.kv_cache
        if kv is not None:
            region = self.manifest.memory.regions["kv_cache"]
            self.dev.cuda.memset_d8_async(int(self.arena) + region.offset, 0, region.nbytes, self.dev.stream)
            self.dev.synchronize()

    def read_kv_cache(self) -> np.ndarray | None:
        """A host copy of the whole cache [layers, 2, max_batch, kv_heads, max_seq, head_dim] (tests, debugging)."""
        kv = self.manifest.kv_cache
        if kv is None:
            return None
        dt = np.dtype(kv.dtype)
        shape = (kv.layers, 2, kv.max_batch, kv.kv_heads, kv.max_seq, kv.head_dim)
        n = int(np.prod(shape)) * dt.itemsize
        return self.dev.download(self.arena, kv.offset, n).view(dt).reshape(shape)

    def write_kv_cache(self, cache: np.ndarray) -> None:
        """Overwrite the whole cache from a host array shaped like read_kv_cache()."""
        kv = self.manifest.kv_cache
        self.dev.upload(self.arena, kv.offset, np.ascontiguousarray(cache, dtype=np.dtype(kv.dtype)))
        self.dev.synchronize()

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        if self.arena is not None:
            self.arena.free()
            self.arena = None

    # -- execution ------------------------------------------------------------------------------
    def schedule(self, entry: str, env: Mapping[str, int]) -> tuple[tuple, list[tuple]]:
        """(key, launches): the entry's launches [(kernel, grid, block, smem, node)] for the symbol values
        env, each node's tightest variant that covers them; key = (entry, bucket), shared by every env
        of one bucket (and by its captured graph)."""
        key = (entry, bucket_of(self.buckets[entry], env))
        launches = self.schedules.get(key)
        if launches is None:
            launches = [(*node_launch(n, env), n.name) for n in self.manifest.entries[entry].nodes if n.kernel]
            self.schedules[key] = launches
        return key, launches

    def _launch_all(self, launches: list[tuple]) -> None:
        for kernel, grid, block, smem, node in launches:
            self.kernels.launch(kernel, grid, block, smem, self.arena, node=node)

    def enqueue(self, entry: str) -> None:
        """Issue the entry's kernels for the symbol values of its latest write_inputs on the stream
        (replaying the graph captured for their bucket when graphs are enabled); the entry that call was
        routed to (bind_call) when it has a narrower twin."""
        entry = self.routed.get(entry, entry)
        key, launches = self.schedule(entry, self.last_env.get(entry, {}))
        if not self.cuda_graphs:
            self._launch_all(launches)
            return
        self._graph(key, launches).launch()

    def _graph(self, key: tuple, launches: list[tuple]) -> CapturedGraph:
        """The CUDA graph of one (entry, bucket): captured, instantiated and uploaded on first use (load
        captures every one, so that no run allocates)."""
        graph = self.graphs.get(key)
        if graph is None:
            if self.pdl:
                try:
                    graph = CapturedGraph(self.dev.stream, lambda: self._launch_all(launches), programmatic=True)
                except CudaGraphError as e:  # a driver without programmatic edges: plain ones
                    self.pdl, self.pdl_error = False, str(e)
            if graph is None:
                graph = CapturedGraph(self.dev.stream, lambda: self._launch_all(launches))
            self.graphs[key] = graph
        return graph

    def write_inputs(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int]) -> dict:
        """Bind and upload one call's inputs and symbols for `entry_name`, or for the narrower twin that
        serves the call (bind_call; enqueue then runs that one); returns the symbol values."""
        called = entry_name
        entry_name, env = bind_call(self.manifest, entry_name, inputs, symbols, self.bounds)
        self.routed[called] = entry_name
        entry = self.manifest.entries[entry_name]
        self.last_env[entry_name] = env
        self.dims_host[: len(self.symbols)] = [env.get(s, 0) for s in self.symbols]
        self.dev.cuda.memcpy_htod_async(int(self.arena) + self.manifest.memory.dims_offset, self.dims_host,
                                        self.dev.stream)
        for spec in entry.inputs:
            self.dev.upload(self.arena, spec.offset, np.ascontiguousarray(inputs[spec.name]))
        return env

    def run(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int] | None = None,
            outputs: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Execute one entry point; returns its outputs by name (only `outputs` if given: less to copy back)."""
        env = self.write_inputs(entry_name, inputs, symbols or {})
        self.enqueue(entry_name)
        out = {}
        for spec in self.manifest.entries[self.routed.get(entry_name, entry_name)].outputs:
            if outputs is not None and spec.name not in outputs:
                continue
            shape = output_shape(spec, env)
            dt = np.dtype(spec.dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            out[spec.name] = self.dev.download(self.arena, spec.offset, n).view(dt).reshape(shape)
        return out
